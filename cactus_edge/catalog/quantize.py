"""`cactus-edge models quantize`: re-quantize a model, or both models of a pair, on this machine (a
CPU-friendly variant in one step) and register the result under a local name.

llama.cpp's own quantizer does the arithmetic, through :func:`cactus_edge.llama.model.quantize_gguf`
(backend.py is the only module that talks to llama.cpp, and it is imported only when a model is
made). This module chooses names, writes each file atomically beside the other models (temporary
name, GGUF check, sha256, rename) and records it in the models directory's local registry, so the
new name works wherever a registered name does (`--target`, `--pair`, `models verify`, …).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    BackendError,
    InvalidModelFileError,
    InvalidSettingError,
    ModelNotFoundError,
    NameTakenError,
)
from ..files import temporary_next_to
from ..llama.gguf import read_gguf
from .registry import (
    ModelSpec,
    PairSpec,
    QuantizedSource,
    Registry,
    default_models_dir,
    format_size,
    load_registry,
    local_registry_file,
    looks_like_path,
    read_local_registry,
    write_local_entry,
)
from .resolve import resolve_model_path

# llama.cpp's LLAMA_FTYPE_MOSTLY_* types by their lowercase tail (the names llama-quantize takes).
QUANT_TYPES = (
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q2_k",
    "q3_k_s",
    "q3_k_m",
    "q3_k_l",
    "q4_k_s",
    "q4_k_m",
    "q5_k_s",
    "q5_k_m",
    "q6_k",
    "f16",
    "bf16",
)

# A name becomes a file name (<name>.gguf) and must not look like a path on the command line.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_NOT_IN_NAME = re.compile(r"[^a-z0-9._+-]+")


@dataclass(frozen=True)
class QuantizeJob:
    """One model to make: the file ``source_path`` (``origin`` in the registry: the name it was
    given by, or its absolute path) re-quantized into the local model ``name``."""

    origin: str
    source_path: Path
    name: str


@dataclass(frozen=True)
class QuantizedModel:
    """What one job produced; ``reused`` when an identical earlier result was kept instead."""

    name: str
    origin: str
    path: Path
    source_type: str
    quant_type: str
    size: int
    sha256: str
    seconds: float
    reused: bool


@dataclass(frozen=True)
class QuantizeResult:
    models: tuple[QuantizedModel, ...]
    pair: PairSpec | None


def check_quant_type(quant_type: str) -> str:
    """The canonical (lowercase) name of ``quant_type``; any case is accepted, as llama.cpp does."""
    canonical = quant_type.lower()
    if canonical not in QUANT_TYPES:
        raise InvalidSettingError(
            f"unknown quantization type {quant_type!r}; choose one of {', '.join(QUANT_TYPES)}", "type"
        )
    return canonical


def quantize(
    name_or_path: str | os.PathLike,
    quant_type: str,
    *,
    name: str | None = None,
    n_threads: int | None = None,
    force: bool = False,
    models_dir: Path | None = None,
    verbose: bool = False,
    report: Callable[[QuantizedModel], None] | None = None,
) -> QuantizeResult:
    """Re-quantize a registered model, a GGUF path, or both models of a registered pair (then also
    register the pair ``<pair>-<type>``), into ``models_dir``. ``name`` overrides the new model's
    (or, for a pair, the new pair's) name. Every name is checked before anything is made, so a
    refused name wastes no quantization. ``report`` hears of each model as soon as it is done."""
    quant_type = check_quant_type(quant_type)
    models_dir = models_dir or default_models_dir()
    registry = load_registry(models_dir=models_dir)
    local = read_local_registry(local_registry_file(models_dir))
    jobs, pair = _plan(os.fspath(name_or_path), quant_type, name, registry, models_dir)
    for job in jobs:
        _check_model_name(job, quant_type, registry, local, models_dir, force)
    if pair is not None:
        _check_pair_name(pair, {job.name for job in jobs}, registry, local, force)
    from ..llama.library import set_verbose

    set_verbose(verbose)
    made = []
    for job in jobs:
        made.append(_quantize_one(job, quant_type, registry, models_dir, n_threads, force))
        if report is not None:
            report(made[-1])
    if pair is not None:
        entry = {"description": pair.description, "draft": pair.draft, "target": pair.target}
        write_local_entry(models_dir, "pairs", pair.name, entry)
    return QuantizeResult(tuple(made), pair)


def describe(model: QuantizedModel) -> str:
    """The one line `models quantize` prints per model: source → destination, size, sha256, time."""
    head = f"{model.origin} ({model.source_type}) -> {model.name} ({model.quant_type.upper()})"
    facts = f"{format_size(model.size)}, sha256 {model.sha256}"
    if model.reused:
        return f"{head}: reused, already made from these source bytes ({facts}); --force re-makes it"
    return f"{head}: {facts}, {model.seconds:.1f} s, {model.path}"


# --- what to make, under which names ---------------------------------------------------------------


def _is_file(text: str) -> bool:
    """Whether the command line meant a file: the same precedence as resolve_model_path."""
    return Path(text).expanduser().is_file()


def _plan(
    text: str, quant_type: str, name: str | None, registry: Registry, models_dir: Path
) -> tuple[list[QuantizeJob], PairSpec | None]:
    """The jobs for ``text`` (a pair, a model name or a path) and the pair to register, if any.
    Sources are resolved here, so a model that is not fetched is refused before anything runs."""
    if text in registry.pairs and not _is_file(text):
        return _plan_pair(registry.pair(text), quant_type, name, registry, models_dir)
    path = resolve_model_path(text, registry, models_dir)
    if _is_file(text):
        origin, base = str(path.resolve()), _name_from_file(path)
    else:
        origin, base = text, text
    return [QuantizeJob(origin, path, f"{base}-{quant_type}" if name is None else name)], None


def _plan_pair(
    pair: PairSpec, quant_type: str, name: str | None, registry: Registry, models_dir: Path
) -> tuple[list[QuantizeJob], PairSpec]:
    """One job per distinct member (a self-drafting pair is one model), and the new pair."""
    jobs = {
        member: QuantizeJob(
            member, resolve_model_path(member, registry, models_dir), f"{member}-{quant_type}"
        )
        for member in dict.fromkeys((pair.draft, pair.target))
    }
    draft, target = jobs[pair.draft].name, jobs[pair.target].name
    description = f"{pair.name} re-quantized to {quant_type.upper()}: {draft} drafts for {target}"
    new_name = f"{pair.name}-{quant_type}" if name is None else name
    return list(jobs.values()), PairSpec(new_name, draft, target, description)


def _name_from_file(path: Path) -> str:
    """A registry-style name from a file name: lowercase, anything unusual replaced by '-'."""
    return _NOT_IN_NAME.sub("-", path.stem.lower()).strip("-.") or "model"


def _check_name_syntax(name: str) -> None:
    if not _NAME.fullmatch(name) or looks_like_path(name):
        raise InvalidSettingError(
            f"{name!r} cannot be a model name: use letters, digits and . _ + - (not ending in .gguf)",
            "name",
        )


def _refuse_packaged(name: str, registry: Registry, local: dict) -> None:
    """Packaged names are never replaced, --force or not: the registry would become ambiguous."""
    local_names = set(local.get("models", {})) | set(local.get("pairs", {}))
    if name not in local_names and (name in registry.models or name in registry.pairs):
        raise NameTakenError(f"{name!r} is already a packaged model or pair; choose another --name")


def _check_model_name(
    job: QuantizeJob, quant_type: str, registry: Registry, local: dict, models_dir: Path, force: bool
) -> None:
    """Refuse a name or file that belongs to something else. A local model made the same way
    (same origin and type) may be re-made or reused; one made differently only with ``force``."""
    _check_name_syntax(job.name)
    _refuse_packaged(job.name, registry, local)
    if job.name in local.get("pairs", {}):
        raise NameTakenError(f"{job.name!r} is already a local pair; choose another --name")
    final = models_dir / f"{job.name}.gguf"
    if final.resolve() == job.source_path.resolve():
        raise NameTakenError(f"{job.name!r}: the result would replace its own source {job.source_path}")
    owners = [spec.name for spec in registry.models.values() if spec.file == final.name]
    if owners and owners != [job.name]:
        raise NameTakenError(f"{final.name} is the file of model {owners[0]!r}; choose another --name")
    existing = registry.models.get(job.name)
    if existing is None:
        if final.exists() and not force:
            raise NameTakenError(f"{final} exists but is not a registered model; --force replaces it")
        return
    made = existing.source
    same_recipe = isinstance(made, QuantizedSource) and (made.origin, made.ftype) == (job.origin, quant_type)
    if not same_recipe and not force:
        raise NameTakenError(
            f"{job.name!r} is already a local model ({existing.description or existing.file}); choose "
            "another --name, or --force to replace it"
        )


def _check_pair_name(
    pair: PairSpec, model_names: set[str], registry: Registry, local: dict, force: bool
) -> None:
    """Like a model's name: a local pair of the same members may be rewritten, another only with
    ``force``; a name that is also a model (new or local) is refused, since pairs win lookups."""
    _check_name_syntax(pair.name)
    _refuse_packaged(pair.name, registry, local)
    if pair.name in model_names or pair.name in local.get("models", {}):
        raise NameTakenError(f"{pair.name!r} is a model name; choose another --name for the pair")
    existing = registry.pairs.get(pair.name)
    if existing is not None and (existing.draft, existing.target) != (pair.draft, pair.target) and not force:
        raise NameTakenError(
            f"{pair.name!r} is already a local pair ({existing.draft} -> {existing.target}); choose "
            "another --name, or --force to replace it"
        )


# --- making one model --------------------------------------------------------------------------------


def _quantize_one(
    job: QuantizeJob,
    quant_type: str,
    registry: Registry,
    models_dir: Path,
    n_threads: int | None,
    force: bool,
) -> QuantizedModel:
    """Make (or reuse) one model and register it at once, so a failure on a pair's second model
    keeps the first. Reused: the registered result of the same source bytes and type, still intact
    (quantization is deterministic, so re-making it would write the same bytes)."""
    from .fetch import sha256_file

    started = time.monotonic()
    source_type = read_gguf(job.source_path).quantization  # typed error for a non-GGUF source
    recipe = QuantizedSource(job.origin, quant_type, sha256_file(job.source_path))
    existing = registry.models.get(job.name)
    if not force and _made_from(existing, recipe, models_dir):
        path, size, digest, reused = existing.path(models_dir), existing.size, existing.sha256, True
    else:
        path, reused = models_dir / f"{job.name}.gguf", False
        size, digest = _write_quantized(job.source_path, path, quant_type, n_threads)
        write_local_entry(models_dir, "models", job.name, _model_entry(path, size, digest, recipe))
    seconds = time.monotonic() - started
    return QuantizedModel(job.name, job.origin, path, source_type, quant_type, size, digest, seconds, reused)


def _made_from(existing: ModelSpec | None, recipe: QuantizedSource, models_dir: Path) -> bool:
    """Whether ``existing`` was made by ``recipe`` (same origin, source bytes and type) and its
    file still matches its registered size and sha256."""
    from .fetch import verify_model

    return existing is not None and existing.source == recipe and verify_model(existing, models_dir).ok


def _write_quantized(source: Path, final: Path, quant_type: str, n_threads: int | None) -> tuple[int, str]:
    """(size, sha256) of ``source`` quantized into ``final``. llama.cpp writes a temporary file
    beside ``final``, which is read back as a GGUF (magic, header, tensor data inside the file) and
    hashed before the rename: any failure or interrupt removes it, so nothing half-written ever
    appears under the final name."""
    from ..llama import model as backend
    from .fetch import sha256_file

    with temporary_next_to(final) as temporary:
        backend.quantize_gguf(source, temporary, quant_type, n_threads)
        try:
            read_gguf(temporary)
        except (InvalidModelFileError, ModelNotFoundError) as error:
            raise BackendError(
                f"llama.cpp's quantizer did not write a valid GGUF for {final.name} ({error}); "
                "nothing was written"
            ) from error
        size, digest = temporary.stat().st_size, sha256_file(temporary)
        os.replace(temporary, final)
    return size, digest


def _model_entry(path: Path, size: int, digest: str, recipe: QuantizedSource) -> dict:
    description = (
        f"re-quantized to {recipe.ftype.upper()} from {recipe.origin} (sha256 {recipe.origin_sha256}) "
        "by llama.cpp's quantizer"
    )
    source = {"type": "quantized", "from": recipe.origin, "ftype": recipe.ftype}
    source["from_sha256"] = recipe.origin_sha256
    return {"description": description, "file": path.name, "size": size, "sha256": digest, "source": source}
