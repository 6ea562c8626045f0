"""Penalties and logit bias on raw logits (docs/methods.md, 'Constraints: the order of operations on
a row'). Pure numpy, no llama.cpp.

Both change a row before processing (temperature, top-k, …), the same way for the draft's row and
the target's row at one position: bias first, then llama.cpp's repeat penalty over the last N
tokens of the context, then OpenAI's frequency and presence penalties over the generated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Penalties:
    """repeat_penalty: llama.cpp's (1 = off), over the last ``repeat_last_n`` tokens of the
    context, prompt included. frequency_penalty, presence_penalty: OpenAI's (0 = off), over the
    generated tokens."""

    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def active(self) -> bool:
        repeat = self.repeat_penalty != 1.0 and self.repeat_last_n != 0
        return repeat or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def apply_bias(logits: np.ndarray, bias_ids: np.ndarray, bias_values: np.ndarray) -> None:
    """logits (V,) += bias at bias_ids, in place; ids past this row (a draft with a smaller
    vocabulary) are skipped."""
    inside = bias_ids < logits.shape[-1]
    logits[bias_ids[inside]] += bias_values[inside]


def apply_penalties(
    logits: np.ndarray, window: np.ndarray, generated: np.ndarray, penalties: Penalties
) -> None:
    """Penalise one row of raw logits (V,) in place, as llama.cpp's
    ``llama_sampler_penalties_apply`` does for a token with count c > 0.

    window: int (n,), the last repeat_last_n context tokens (repeat penalty: a positive logit is
        divided by it, a negative one multiplied);
    generated: int (m,), the generated tokens (logit −= c · frequency_penalty + presence_penalty).
    """
    vocab_size = logits.shape[-1]
    if penalties.repeat_penalty != 1.0 and window.size:
        ids = np.unique(window)
        ids = ids[ids < vocab_size]
        values = logits[ids]
        logits[ids] = np.where(
            values > 0, values / penalties.repeat_penalty, values * penalties.repeat_penalty
        )
    if (penalties.frequency_penalty or penalties.presence_penalty) and generated.size:
        ids, counts = np.unique(generated, return_counts=True)
        inside = ids < vocab_size
        ids, counts = ids[inside], counts[inside]
        logits[ids] -= counts * penalties.frequency_penalty + penalties.presence_penalty


def repeat_window(context: Sequence[int], end: int, last_n: int) -> Sequence[int]:
    """The tokens the repeat penalty counts for the row that predicts context index ``end``:
    context[end − last_n : end] (last_n −1: the whole context; 0: none); a slice of the same type."""
    if last_n == 0:
        return context[:0]
    start = 0 if last_n < 0 else max(0, end - last_n)
    return context[start:end]
