"""A model given by registered name, by path or as ``hf:OWNER/REPO/FILE.gguf``, as the file to
load. Only the ``hf:`` shorthand downloads (on first use, then pinned); a pinned Hugging Face
model's file is checked against its pin on every load."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelNotFetchedError, ModelNotFoundError
from .fetch import check_pinned_file, fetch_model
from .registry import (
    ModelSpec,
    QuantizedSource,
    Registry,
    default_models_dir,
    hub_shorthand,
    load_registry,
    looks_like_path,
)


def resolve_model_path(
    name_or_path: str | os.PathLike, registry: Registry | None = None, models_dir: Path | None = None
) -> Path:
    """A GGUF path for a registered model name, a file path, or an ``hf:`` shorthand (fetched and
    pinned on its first use; registered models are never downloaded here).

    Raises ModelNotFoundError (a path that does not exist), ModelNotFetchedError (a registered
    model not fetched yet), UnknownModelError, or PinMismatchError (a pinned Hugging Face model's
    file no longer holds the pinned bytes: see fetch.check_pinned_file).
    """
    text = os.fspath(name_or_path)
    shorthand = hub_shorthand(text, models_dir)
    if shorthand is not None:
        return _hub_file(shorthand, models_dir or default_models_dir())
    candidate = Path(text).expanduser()
    if candidate.is_file():
        return candidate
    if looks_like_path(text) or candidate.exists():
        raise ModelNotFoundError(f"model file not found: {text}")
    spec = (registry or load_registry(models_dir=models_dir)).model(text)
    path = spec.path(models_dir)
    if not path.is_file():
        raise ModelNotFetchedError(f"model {spec.name!r} is not {_how_to_get(spec, path)}")
    check_pinned_file(spec, path, models_dir or default_models_dir())
    return path


def _how_to_get(spec: ModelSpec, path: Path) -> str:
    """The end of a "model is not …" message: where its file should be and how to get it."""
    if isinstance(spec.source, QuantizedSource):
        return f"made yet (expected {path}); run: {spec.source.remake_command(spec.name)}"
    return f"fetched yet (expected {path}); run: cactus-edge models fetch {spec.name}"


def _hub_file(spec: ModelSpec, models_dir: Path) -> Path:
    """An ``hf:`` model's file: fetched (with a progress bar) and pinned the first time, then held
    to its pin like a registered Hugging Face model's."""
    path = spec.path(models_dir)
    if not path.is_file():
        return fetch_model(spec, models_dir)
    check_pinned_file(spec, path, models_dir)
    return path
