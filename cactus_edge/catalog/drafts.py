"""`--draft auto`: a draft model for a target, found among the models on this machine (registered
and fetched, or any GGUF in the models folder) whose tokenizer the target shares, smallest first."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CactusEdgeError
from ..llama.gguf import check_pair_compatible, read_gguf
from .registry import Registry, default_models_dir, load_registry
from .resolve import resolve_model_path

AUTO = "auto"


@dataclass(frozen=True)
class DraftSearch:
    """What `--draft auto` found: the chosen draft's path (None: none fits) and how many local
    models it tried, for the one line that says so."""

    draft: Path | None
    n_tried: int

    def outcome(self, target_name: str) -> str:
        """The one line for the user: which draft was chosen, or why none was."""
        if self.draft is not None:
            return f"--draft auto chose {self.draft.name}"
        if self.n_tried == 0:
            return f"--draft auto: no local model is smaller than {target_name}"
        tokenizer = f"{target_name}'s tokenizer"
        if self.n_tried == 1:
            return f"--draft auto: the one smaller local model does not share {tokenizer}"
        return f"--draft auto: none of the {self.n_tried} smaller local models shares {tokenizer}"


def find_draft(
    target: str | os.PathLike, registry: Registry | None = None, models_dir: Path | None = None
) -> DraftSearch:
    """The smallest local GGUF smaller than ``target`` that passes the pair check against it
    (the same check every pair gets before loading)."""
    models_dir = models_dir or default_models_dir()
    target_path = resolve_model_path(target, registry, models_dir).resolve()
    target_info = read_gguf(target_path, tokens=True)
    target_size = target_path.stat().st_size
    candidates = sorted(
        (path.stat().st_size, path)
        for path in _local_models(registry or load_registry(models_dir=models_dir), models_dir)
        if path != target_path and path.stat().st_size < target_size
    )
    for n_tried, (_, path) in enumerate(candidates, start=1):
        try:
            check_pair_compatible(read_gguf(path, tokens=True), target_info)
        except CactusEdgeError:  # another tokenizer, or not a readable GGUF
            continue
        return DraftSearch(path, n_tried)
    return DraftSearch(None, len(candidates))


def _local_models(registry: Registry, models_dir: Path) -> set[Path]:
    """Every registered model that is present, and every other GGUF in the models folder."""
    present = {spec.path(models_dir) for spec in registry.models.values()}
    found = {path for path in present if path.is_file()}
    if models_dir.is_dir():
        found |= {path for path in models_dir.rglob("*.gguf") if path.is_file()}
    return {path.resolve() for path in found}
