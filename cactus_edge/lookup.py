"""Prompt-lookup drafting: propose the tokens that followed the last n-gram where it occurred
earlier in the context (prompt and generated text). No draft model, near-zero cost; strong when the
output repeats its input, as in code editing. A proposal is a point mass: draft probability 1."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .sampling import SparseProbs


def lookup_continuation(
    context: Sequence[int], max_tokens: int, *, max_ngram: int = 4, min_ngram: int = 2
) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the context's last n-gram,
    trying the longest n first; [] when no n-gram recurs. Single-token matches are not used by
    default: on code editing they mostly propose the wrong continuation (measured: 1.17–1.33×
    median speedup with unigrams allowed vs 1.38–1.51× without, SpS, auto, default pair).

    context: token ids, shape (n,); max_tokens: the most tokens to propose.
    """
    tokens = np.asarray(context, dtype=np.int64)
    if max_tokens <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        pattern = tokens[-n:]
        # Windows that start early enough to have at least one token after them.
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        starts = starts[starts + n < len(tokens)]
        if starts.size:
            begin = int(starts[-1]) + n
            return tokens[begin : begin + max_tokens].tolist()
    return []


def point_mass_rows(tokens: Sequence[int], vocab_size: int) -> list[SparseProbs]:
    """One single-entry row per proposed token: the draft 'distribution' of a lookup proposal."""
    return [SparseProbs(np.array([token]), np.ones(1), vocab_size) for token in tokens]
