"""Measuring what `auto` needs: each model's cost of a decode by batch size, on this machine, kept
between processes (cost_cache) while a fresh single decode says it still holds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..llama.model import Model
from ..rules.draft_length import CALIBRATION_DRAFT_SIZES, CALIBRATION_VERIFY_SIZES, CostModel
from .cost_cache import MAX_KEPT_CONTEXT, load_costs, save_costs, still_holds


def calibrate(costs: CostModel, target: Model, draft: Model | None, filler: int) -> None:
    """Measure what `auto` needs before its first choice, once per cost model and model: the
    target's cost of each verify batch size and the draft's of short batches
    (:func:`measure_batch_costs`). Learning only the sizes it happens to use, `auto` missed cheap
    ones (on Q4_0, 4 tokens cost less than 3); real steps keep refining every size. A measurement
    made by an earlier process for the same CPU, file and settings is reused (cost_cache)."""
    for role, model, sizes, record in (
        ("target", target, CALIBRATION_VERIFY_SIZES, costs.record_verify),
        ("draft", draft, CALIBRATION_DRAFT_SIZES, costs.record_draft),
    ):
        if model is not None and role not in costs.calibrated:
            costs.calibrated.add(role)
            table, was_kept = _batch_costs(model, sizes, filler)
            if was_kept:
                costs.kept.add(role)
            for n_tokens, ms in table.items():
                record(n_tokens, ms)


def _batch_costs(model: Model, sizes: Sequence[int], filler: int) -> tuple[dict[int, float], bool]:
    """(costs by batch size, whether kept): the table kept for this model (cost_cache), if one
    fresh decode of a single token still costs what it says; else freshly measured costs, kept
    when every size fitted and the context was short (attention grows with it: a table taken
    behind a long prompt would overstate every later request's costs)."""
    identity = model.cost_identity()
    if identity is None:
        return measure_batch_costs(model, sizes, filler), False
    kept = load_costs(identity, sizes)
    if kept is not None and still_holds(kept, measure_batch_costs(model, [1], filler)):
        return kept, True
    n_past = model.n_past
    measured = measure_batch_costs(model, sizes, filler)
    if set(sizes) <= set(measured) and n_past <= MAX_KEPT_CONTEXT:
        save_costs(identity, measured)
    return measured, False


def measure_engine_costs(target: Model, draft: Model | None, sizes, repeats: int) -> dict:
    """{"verify_ms": {n: ms}, "draft_ms": one draft token's ms or None}, medians of ``repeats``."""
    filler = target.tokens[-1] if target.tokens else max(target.bos_token, 0)
    draft_ms = draft and measure_batch_costs(draft, [1], filler, repeats).get(1)
    return {"verify_ms": measure_batch_costs(target, sizes, filler, repeats), "draft_ms": draft_ms}


def measure_batch_costs(
    model: Model, sizes: Sequence[int], filler: int, repeats: int = 1
) -> dict[int, float]:
    """This machine's cost of a batch, by size: the median ms inside llama_decode of ``repeats``
    decodes of ``filler`` × n at the end of the cache (logits for every row, as a verify), cut
    right after; sizes that do not fit the context are skipped. One untimed decode first: a
    model's first decode builds its graph (a lazily fed draft may not have decoded yet)."""
    n_past, measured = model.n_past, {}
    for n_tokens in (n for n in sizes if n_past + n <= model.n_ctx):
        times = []
        for _ in range(repeats + (not measured)):
            try:
                model.decode([filler] * n_tokens, output_rows=range(n_tokens))
                times.append(model.last_decode_ms)
            finally:
                model.truncate(n_past)
        measured[n_tokens] = statistics.median(times[-repeats:])
    return measured
