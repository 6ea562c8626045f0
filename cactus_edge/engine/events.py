"""What a stream hands out: one :class:`StreamEvent` per token, then a final one with the finish
reason and the statistics; :class:`GenerationResult` collects a whole stream. No llama.cpp here."""

from __future__ import annotations

from dataclasses import dataclass

from ..rules.logprobs import TokenLogprob
from .stats import FinishReason, GenerationStats


@dataclass(frozen=True)
class StreamEvent:
    """One emitted token (or, last, the end of the stream).

    text: visible text this event adds ("" while a possible stop string or an unfinished UTF-8
        character is held back).
    token: the token id; None on the final event.
    from_draft: True for an accepted draft token, False for a token the target produced.
    step: index of the verifier call that produced the token.
    finish_reason: set on the final event only.
    stats: the generation's running statistics (complete on the final event).
    logprob: with ``logprobs`` on, the token's log-probability under the target's raw logits
        (and the top alternatives); None otherwise and on the final event.
    """

    text: str
    token: int | None
    from_draft: bool = False
    step: int = 0
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    logprob: TokenLogprob | None = None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token, with ``logprobs`` on
