"""Log-probabilities of emitted tokens, as OpenAI's ``logprobs`` reports them. Pure numpy.

They are the log-softmax of the **target's raw logits** at each emitted position: before logit
bias, penalties, temperature, truncation and the grammar (llama-server's default). So
a token has the same log-probability whether the draft proposed it or the target sampled it, and
a plain and a speculative run that emit the same tokens report the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """token: the emitted id; logprob: its log-probability (natural log); top: the n most likely
    ids at that position with theirs, most likely first (ties by lower id); token_bytes and
    top_bytes: the tokens' bytes (a token may hold part of a UTF-8 character)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    token_bytes: bytes = b""
    top_bytes: tuple[bytes, ...] = ()


def with_bytes(entries: list[TokenLogprob], token_bytes: Callable[[int], bytes]) -> list[TokenLogprob]:
    """The entries with their tokens' bytes filled in (what OpenAI's ``bytes`` fields report)."""
    return [
        replace(e, token_bytes=token_bytes(e.token), top_bytes=tuple(token_bytes(t) for t, _ in e.top))
        for e in entries
    ]


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], n_top: int = 0) -> list[TokenLogprob]:
    """One TokenLogprob per row: logits (n, V) raw float rows, tokens (n,) the id emitted at each
    row's position. O(V) per row (one exp and sum), plus a partial sort for n_top > 0."""
    result = []
    for row, token in zip(np.asarray(logits), tokens, strict=True):
        row = row.astype(np.float64)
        top_value = row.max()
        log_total = top_value + np.log(np.exp(row - top_value).sum())
        top: tuple[tuple[int, float], ...] = ()
        if n_top > 0:
            count = min(n_top, row.size)
            ids = np.argpartition(-row, count - 1)[:count]
            ids = ids[np.lexsort((ids, -row[ids]))]
            top = tuple((int(i), float(row[i] - log_total)) for i in ids)
        result.append(TokenLogprob(int(token), float(row[int(token)] - log_total), top))
    return result
