"""Text-quality measures of generated token sequences (pure Python and numpy, no llama.cpp).

Degeneration, defined precisely: a response is degenerate when its final quarter contains a span
of at least ``min_span`` tokens repeated at least ``min_repeats`` times in a row (the loops a
published replication of lossy acceptance on long reasoning reported). Distinct-n is the share of
a response's n-grams that are unique (1.0: no n-gram repeats).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_SPAN = 8
MIN_REPEATS = 3


def repeated_span(tokens: Sequence[int], min_span: int = MIN_SPAN, min_repeats: int = MIN_REPEATS) -> int:
    """The length of the shortest span (≥ min_span tokens) that occurs min_repeats times in a row
    in ``tokens``, or 0 when none does. O(n²) over n tokens; n is a quarter response here."""
    array = np.asarray(tokens, dtype=np.int64)
    for span in range(min_span, len(array) // min_repeats + 1):
        # same[i]: token i equals token i + span. A block of span tokens repeated r times in a row
        # is a run of (r − 1) · span such positions.
        same = array[:-span] == array[span:]
        if _longest_run(same) >= (min_repeats - 1) * span:
            return span
    return 0


def _longest_run(flags: np.ndarray) -> int:
    if not flags.any():
        return 0
    padded = np.concatenate(([0], flags.astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[::2]).max())


def is_degenerate(tokens: Sequence[int], min_span: int = MIN_SPAN, min_repeats: int = MIN_REPEATS) -> bool:
    """Whether the final quarter of the response loops (see the module docstring)."""
    tail = list(tokens)[-(len(tokens) // 4) :] if len(tokens) >= 4 else []
    return repeated_span(tail, min_span, min_repeats) > 0


def distinct_ngram_ratio(tokens: Sequence[int], n: int = 4) -> float | None:
    """Unique n-grams / n-grams in the response; None when it has no n-gram."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None
