"""Prompt-lookup drafting: propose the tokens that followed the last n-gram where it occurred
earlier in the context (prompt and generated text). No draft model, near-zero cost; strong when the
output repeats its input, as in code editing. A proposal is a point mass: draft probability 1."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from ..rules.sampling import SparseProbs


class NgramIndex:
    """Prompt lookup for a context that only grows, in O(new tokens) per call: the tokens that
    followed the most recent earlier occurrence of the context's last n-gram, trying the longest
    n first; [] when no n-gram recurs. Single-token matches are not used by default: on code
    editing they mostly propose the wrong continuation, and allowing them lowers the speedup.

    For every n in min_ngram..max_ngram it maps each n-gram to its most recent start that has at
    least one token after it, updated as tokens are appended, so a lookup is max_ngram dict probes
    instead of a scan of the whole context (whose cost grows with the context). Meant for one
    growing context, as the engine's is within a generation (one index per generation); a context
    that visibly does not extend the indexed text (shorter, or another token where it began or
    ended) is indexed from scratch, but a different text of at least the same length that agrees
    at both ends would not be noticed.
    """

    def __init__(self, *, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.latest_start: dict[int, dict[tuple[int, ...], int]] = {}
        self._reset()

    def _reset(self) -> None:
        self.tokens = []
        self.latest_start = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def continuation(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """At most max_tokens ids that followed the last n-gram earlier on; context (n,) ids."""
        return self.match(context, max_tokens)[0]

    def match(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """(continuation, match length): the continuation as :meth:`continuation` finds it, and
        how many tokens before the context's end equal those before it (the n-gram extended
        backwards, up to MAX_MATCH_LENGTH; 0 when nothing recurs). A long match is a copy in
        progress, whose continuation is far more often right than a 2-gram's."""
        self._sync(context)
        if max_tokens <= 0:
            return [], 0
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self.latest_start[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + max_tokens], _extend_back(tokens, start, n)
        return [], 0

    def _sync(self, context: Sequence[int]) -> None:
        n_known = len(self.tokens)
        if n_known and (
            len(context) < n_known or context[n_known - 1] != self.tokens[-1] or context[0] != self.tokens[0]
        ):
            self._reset()
            n_known = 0
        if len(context) > n_known:
            self._extend([int(token) for token in context[n_known:]])

    def _extend(self, new_tokens: list[int]) -> None:
        """Append tokens; every n-gram that now has a token after it records its start. One
        dict.update per n over zipped slices (C loops), so indexing a 4,000-token prompt on the
        first call costs about what one full scan does."""
        tokens = self.tokens
        n_before = len(tokens)
        tokens.extend(new_tokens)
        for n, starts in self.latest_start.items():
            first, stop = max(n_before - n, 0), len(tokens) - n  # starts first..stop-1 gain a follower
            if stop > first:
                ngrams = zip(*(tokens[first + i : stop + i] for i in range(n)), strict=True)
                starts.update(zip(ngrams, range(first, stop), strict=True))  # later starts win


MAX_MATCH_LENGTH = 64  # longer matches tell nothing more and would only cost comparisons


class PredictionIndex:
    """A client's predicted output (OpenAI's Predicted Outputs) as a draft source: where the reply
    is in the prediction, and what follows there. Before the reply has tokens, the prediction's
    start; then the longest suffix of the reply (``max_ngram`` tokens down to ``min_ngram``) that
    occurs in the prediction, at its first occurrence from where the last match ended (a reply
    walks through the prediction in order), else at its last one. The match length counts how far
    back the reply and the prediction agree (up to MAX_MATCH_LENGTH), as prompt lookup's does, so
    the drafter can take whichever of the two matched longer."""

    def __init__(self, tokens: Sequence[int], *, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.tokens = [int(token) for token in tokens]
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.starts: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for n in range(min_ngram, max_ngram + 1):
            starts: dict[tuple[int, ...], list[int]] = {}
            for start in range(len(self.tokens) - n):  # n-grams with a token after them
                starts.setdefault(tuple(self.tokens[start : start + n]), []).append(start)
            self.starts[n] = starts
        self.cursor = 0  # where the last match ended in the prediction

    def match(self, reply: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """(continuation, match length) for a reply so far; ([], 0) when the reply's end is not
        in the prediction. A reply with no tokens yet matches the prediction's start (length 0),
        and one token that is the prediction's first continues it (length 1)."""
        if max_tokens <= 0 or not self.tokens:
            return [], 0
        if not reply:
            return self.tokens[:max_tokens], 0
        if len(reply) == 1 and reply[0] == self.tokens[0]:
            self.cursor = 1
            return self.tokens[1 : 1 + max_tokens], 1
        for n in range(min(self.max_ngram, len(reply)), self.min_ngram - 1, -1):
            starts = self.starts[n].get(tuple(reply[-n:]))
            if not starts:
                continue
            # The reply moved on by a token at least since the last match: look from there.
            ahead = bisect.bisect_left(starts, self.cursor + 1 - n)
            start = starts[min(ahead, len(starts) - 1)]
            self.cursor = start + n
            agreement = common_suffix(self.tokens, start + n, reply, len(reply), n)
            return self.tokens[start + n : start + n + max_tokens], agreement
        return [], 0


def _extend_back(tokens: list[int], start: int, n: int) -> int:
    """Length of the match between the tokens ending at start + n and those ending at the end,
    given that the last n agree."""
    return common_suffix(tokens, start + n, tokens, len(tokens), n)


def common_suffix(a: Sequence[int], a_end: int, b: Sequence[int], b_end: int, known: int = 0) -> int:
    """How many tokens before ``a_end`` in ``a`` equal those before ``b_end`` in ``b`` (at most
    MAX_MATCH_LENGTH), the last ``known`` of them known to agree already."""
    length = known
    while length < MAX_MATCH_LENGTH and length < min(a_end, b_end):
        if a[a_end - length - 1] != b[b_end - length - 1]:
            break
        length += 1
    return length


def match_bucket(length: int) -> str:
    """The acceptance class of a lookup match: `auto` learns one acceptance curve per class."""
    for floor in (16, 8, 4):
        if length >= floor:
            return f"{floor}+"
    return str(length)


def point_mass_rows(tokens: Sequence[int], vocab_size: int) -> list[SparseProbs]:
    """One single-entry row per proposed token: the draft 'distribution' of a lookup proposal."""
    return [SparseProbs(np.array([token]), np.ones(1), vocab_size) for token in tokens]
