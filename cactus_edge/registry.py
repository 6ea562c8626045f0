"""The model registry (models/registry.toml): names of models and pairs, where their files live,
and how a name or a path on the command line becomes a GGUF file."""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .errors import ModelNotFetchedError, ModelNotFoundError, UnknownModelError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODELS_ENV = "CACTUS_EDGE_MODELS"


@dataclass(frozen=True)
class PypiSource:
    """A GGUF stored in PyPI wheels: part n (1-based) is ``member`` inside ``package`` (both
    formatted with n); the file is the concatenation of all parts in order."""

    package: str
    version: str
    member: str
    parts: int = 1
    part_sha256: tuple[str, ...] = ()

    def package_name(self, part: int) -> str:
        return self.package.format(n=part)

    def member_name(self, part: int) -> str:
        return self.member.format(n=part)


@dataclass(frozen=True)
class HuggingFaceSource:
    repo: str
    filename: str
    revision: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    file: str
    source: PypiSource | HuggingFaceSource | None
    description: str = ""
    size: int | None = None
    sha256: str | None = None

    def path(self, models_dir: Path | None = None) -> Path:
        return (models_dir or default_models_dir()) / self.file


@dataclass(frozen=True)
class PairSpec:
    name: str
    draft: str
    target: str
    description: str = ""


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelSpec] = field(default_factory=dict)
    pairs: dict[str, PairSpec] = field(default_factory=dict)

    def model(self, name: str) -> ModelSpec:
        if name in self.models:
            return self.models[name]
        raise UnknownModelError(_unknown_message("model", name, list(self.models)))

    def pair(self, name: str) -> PairSpec:
        if name in self.pairs:
            return self.pairs[name]
        raise UnknownModelError(_unknown_message("pair", name, list(self.pairs)))

    def expand(self, name: str) -> list[ModelSpec]:
        """The models a name stands for: one model, or both models of a pair (draft first)."""
        if name in self.pairs:
            pair = self.pairs[name]
            specs = [self.model(pair.draft), self.model(pair.target)]
            return specs if specs[0] != specs[1] else specs[:1]
        if name in self.models:
            return [self.models[name]]
        raise UnknownModelError(_unknown_message("model or pair", name, [*self.pairs, *self.models]))


def _unknown_message(kind: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(known))}"
    return f"unknown {kind} {name!r}{hint}"


def _parse_source(raw: dict | None) -> PypiSource | HuggingFaceSource | None:
    if raw is None:
        return None
    kind = raw.get("type")
    if kind == "pypi":
        return PypiSource(
            package=raw["package"],
            version=raw["version"],
            member=raw["member"],
            parts=int(raw.get("parts", 1)),
            part_sha256=tuple(raw.get("part_sha256", ())),
        )
    if kind == "huggingface":
        return HuggingFaceSource(raw["repo"], raw["filename"], raw.get("revision"))
    raise ValueError(f"unknown source type {kind!r} in the model registry")


def parse_registry(data: dict) -> Registry:
    models = {
        name: ModelSpec(
            name=name,
            file=entry["file"],
            source=_parse_source(entry.get("source")),
            description=entry.get("description", ""),
            size=entry.get("size"),
            sha256=entry.get("sha256"),
        )
        for name, entry in data.get("models", {}).items()
    }
    pairs = {
        name: PairSpec(name, entry["draft"], entry["target"], entry.get("description", ""))
        for name, entry in data.get("pairs", {}).items()
    }
    for pair in pairs.values():
        for member in (pair.draft, pair.target):
            if member not in models:
                raise ValueError(f"pair {pair.name!r} names unknown model {member!r}")
    return Registry(models, pairs)


def registry_file() -> Path:
    return Path(str(resources.files("cactus_edge.model_registry") / "registry.toml"))


def load_registry(path: Path | None = None) -> Registry:
    with open(path or registry_file(), "rb") as handle:
        return parse_registry(tomllib.load(handle))


def default_models_dir() -> Path:
    """Where GGUF files live: $CACTUS_EDGE_MODELS, else the checkout's models/ folder when running
    from a source tree, else the user's data directory."""
    if os.environ.get(MODELS_ENV):
        return Path(os.environ[MODELS_ENV]).expanduser()
    registry_dir = registry_file().parent
    if "site-packages" not in registry_dir.parts and os.access(registry_dir, os.W_OK):
        return registry_dir
    from platformdirs import user_data_dir

    return Path(user_data_dir("cactus-edge")) / "models"


def looks_like_path(name: str) -> bool:
    return name.endswith(".gguf") or os.sep in name or "/" in name or name.startswith(".")


def resolve_model_path(
    name_or_path: str | os.PathLike, registry: Registry | None = None, models_dir: Path | None = None
) -> Path:
    """A GGUF path for a registered model name or a file path; never downloads.

    Raises ModelNotFoundError (a path that does not exist), ModelNotFetchedError (a registered
    model not fetched yet) or UnknownModelError.
    """
    text = os.fspath(name_or_path)
    candidate = Path(text).expanduser()
    if candidate.is_file():
        return candidate
    if looks_like_path(text) or candidate.exists():
        raise ModelNotFoundError(f"model file not found: {text}")
    spec = (registry or load_registry()).model(text)
    path = spec.path(models_dir)
    if not path.is_file():
        raise ModelNotFetchedError(
            f"model {spec.name!r} is not fetched yet (expected {path}); "
            f"run: cactus-edge models fetch {spec.name}"
        )
    return path
