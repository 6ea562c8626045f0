"""One reply's constraints along its context: the grammar's state, penalty counts and logit bias,
applied to a row's raw logits before processing, in the order docs/methods.md gives in
'Constraints: the order of operations on a row'. No llama.cpp here.

The row that predicts context index ``position`` must be changed the same way for the draft and
the target, from the same context: prompt + committed + the draft prefix d_<i. So the shaper
follows the context token by token — :meth:`LogitShaper.advance` for every token proposed or
committed, :meth:`LogitShaper.rewind` for every rejected one — and remembers, per position, the
grammar's mask there. The engine walks it in step with ``committed``: the draft advances it while
it drafts, the target's rows are shaped from the masks the drafts left, and a rejection rewinds it
exactly as it truncates the caches.

A grammar may start only once the reply has produced a trigger (tool calls with
``tool_choice="auto"``: the grammar covers the call after ``<tool_call>``); positions before it
are unconstrained, and rewinding past the trigger switches the grammar off again.

End of generation is never fed to the grammar: its mask allows the model's end tokens only where
the grammar accepts, the reply ends there, and a block may still hold drafts after one (llguidance
does not count an end token in what it rolls back). Positions after one are unconstrained.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..rules.sampling import top_k_logits
from .grammar import GrammarMatcher, TokenMask
from .penalties import Penalties, apply_bias, apply_penalties, repeat_window

__all__ = ["LogitShaper", "NARROW_MASK"]

# A mask allowing at most this many tokens is applied by gathering them (LogitShaper.candidates);
# a wider one by looking among the row's WIDE_POOL · k largest entries for the allowed top k.
NARROW_MASK = 2048
WIDE_POOL = 4


class LogitShaper:
    """What changes raw logits for one reply.

    prompt_tokens: the prompt's ids; new_matcher: builds the grammar's state for the reply (None:
    no grammar); trigger: ids after which the grammar starts (empty: from the reply's first
    token); bias: (ids int64 (b,), values float32 (b,)); penalties: see :class:`Penalties`.
    """

    def __init__(
        self,
        prompt_tokens: Sequence[int],
        *,
        new_matcher: Callable[[], GrammarMatcher] | None = None,
        trigger: Sequence[int] = (),
        bias: tuple[np.ndarray, np.ndarray] | None = None,
        penalties: Penalties | None = None,
        end_tokens: frozenset[int] = frozenset(),
    ) -> None:
        self.context = [int(t) for t in prompt_tokens]
        self.n_prompt = len(self.context)
        self.new_matcher, self.trigger = new_matcher, tuple(int(t) for t in trigger)
        self.bias = bias if bias is not None and len(bias[0]) else None
        self.penalties = penalties if penalties is not None and penalties.active else None
        self.end_tokens = end_tokens
        self.matcher: GrammarMatcher | None = None
        self.grammar_start: int | None = None  # context index where the grammar began
        self.ended_at: int | None = None  # context index of the reply's first end token
        self._consumed_flags: list[bool] = []  # per reply token: did the matcher consume it
        self._masks: dict[int, TokenMask | None] = {}
        self.active = bool(new_matcher or self.bias is not None or self.penalties)
        if new_matcher is not None and not self.trigger:
            self._start_grammar()

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the current position."""
        return self.matcher is not None

    @property
    def position(self) -> int:
        """The context index the next row predicts (= the context's length)."""
        return len(self.context)

    # --- following the context ---------------------------------------------------------------------

    def advance(self, token: int) -> None:
        """The context gains ``token`` (a draft, a forced token or a committed one)."""
        if not self.active:
            return
        token = int(token)
        if token in self.end_tokens and self.ended_at is None:
            self.ended_at = self.position
        consume = self.matcher is not None and self.ended_at is None
        if consume:
            self.mask_at(self.position)  # rows at this position may still be shaped later
            self.matcher.consume(token)
        self._consumed_flags.append(consume)
        self.context.append(token)
        if self.new_matcher is not None and self.matcher is None and self._trigger_ends_here():
            self._start_grammar()

    def rewind(self, n_tokens: int) -> None:
        """The context loses its last ``n_tokens`` (rejected drafts, or tokens never shown)."""
        if not self.active or n_tokens <= 0:
            return
        new_length = len(self.context) - n_tokens
        if new_length < self.n_prompt:
            raise ValueError(
                f"cannot rewind {n_tokens} tokens: the reply has {len(self.context) - self.n_prompt}"
            )
        n_consumed = sum(self._consumed_flags[new_length - self.n_prompt :])
        if self.matcher is not None:
            if self.grammar_start > new_length:
                self.matcher, self.grammar_start = None, None  # back before the trigger
            else:
                self.matcher.rollback(n_consumed)
        if self.ended_at is not None and self.ended_at >= new_length:
            self.ended_at = None
        del self.context[new_length:]
        del self._consumed_flags[new_length - self.n_prompt :]
        for position in [p for p in self._masks if p > new_length]:
            del self._masks[position]

    def rewind_to(self, length: int) -> None:
        """Keep the first ``length`` context tokens."""
        self.rewind(len(self.context) - length)

    def _trigger_ends_here(self) -> bool:
        n = len(self.trigger)
        return len(self.context) - self.n_prompt >= n and tuple(self.context[-n:]) == self.trigger

    def _start_grammar(self) -> None:
        self.matcher = self.new_matcher()
        self.grammar_start = len(self.context)

    # --- the grammar here ------------------------------------------------------------------------------

    def mask_at(self, position: int) -> TokenMask | None:
        """The grammar's verdict at ``position`` (≤ the current one); None where no grammar
        applies. A past position's mask was kept when the context passed it."""
        if self.ended_at is not None and position > self.ended_at:
            return None
        if position in self._masks:
            return self._masks[position]
        if position != self.position:
            # Not kept: the grammar was off there (a mask is kept whenever a token is consumed).
            return None
        mask = self.matcher.mask() if self.matcher is not None else None
        self._masks[position] = mask
        return mask

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here ([] when none, or no grammar applies): its
        fast-forward tokens, or else the one token its mask allows here, or, where it allows
        only end tokens, the first of them (the text must end; which end token the rule decides,
        as for any draft). llguidance's fast-forward never names an end token."""
        if self.matcher is None or self.ended:
            return []
        run = self.matcher.forced()
        if run:
            return run
        mask = self.mask_at(self.position)
        sole = mask.sole_id()
        if sole is not None:
            return [sole]
        # Counted on the packed bits: listing the ids of a mostly-open mask costs a millisecond.
        if mask.n_allowed == 0 or mask.n_allowed > len(self.end_tokens):
            return []
        allowed = mask.allowed_ids()
        return [int(allowed[0])] if self.end_tokens.issuperset(allowed.tolist()) else []

    def take_forced(self, room: int) -> list[int]:
        """Up to ``room`` tokens the grammar forces from here, advanced over: run after run (each
        forced run may end where the next begins), until none is forced or the text ends."""
        taken: list[int] = []
        while len(taken) < room:
            run = self.forced()[: room - len(taken)]
            if not run:
                break
            for token in run:
                self.advance(token)
            taken += run
        return taken

    def sole_token(self, position: int) -> int | None:
        """The one token the grammar allows at ``position`` (≤ the current one), or None: a row
        predicting it is a point mass there whatever its logits (docs/methods.md, 'Constraints: the
        order of operations on a row')."""
        mask = self.mask_at(position)
        return None if mask is None else mask.sole_id()

    @property
    def ended(self) -> bool:
        """Whether the context holds an end token past the prompt (nothing after it counts)."""
        return self.ended_at is not None

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` at the current position (always without one)."""
        mask = self.mask_at(self.position)
        return mask is None or mask.allows(token)

    # --- shaping rows ----------------------------------------------------------------------------------

    def shape(self, logits: np.ndarray, first_position: int) -> np.ndarray:
        """Shaped copies of raw logit rows: (V,) for the row predicting ``first_position``, or
        (n, V) for rows predicting first_position, first_position + 1, … (float32)."""
        rows = np.array(logits, dtype=np.float32, copy=True, ndmin=2)
        for index in range(len(rows)):
            self._shape_row(rows[index], first_position + index)
        return rows if np.ndim(logits) == 2 else rows[0]

    def candidates(
        self, logits: np.ndarray, position: int, n_keep: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Entries of the raw row ``logits`` (W,) that hold the shaped row's n_keep largest, found
        without shaping all of it: (ids int64 (m,) ascending, their shaped logits float32 (m,)),
        for :func:`~cactus_edge.rules.sampling.process_candidates`; None where the whole row must be
        shaped (no grammar here, or the wide-mask shortcut cannot prove its answer).

        A narrow mask (≤ NARROW_MASK tokens, most positions of a JSON reply) gives its allowed
        entries, every other being -inf. A wide one gives the allowed entries among the row's
        own WIDE_POOL · n_keep largest, when at least n_keep are allowed: an entry outside the
        pool is below the pool's smallest value, or equal to it with a higher id than the pool's
        entries there (the pool takes the lowest ids of a tie), so it sorts after all of them
        and the top n_keep, in order, are the shaped row's."""
        mask = self.mask_at(position)
        if mask is None:
            return None
        row = logits
        if self.bias is not None or self.penalties is not None:
            row = np.array(logits, dtype=np.float32, copy=True)
            self._bias_and_penalize(row, position)
        if mask.n_allowed <= NARROW_MASK:
            ids = mask.allowed_ids()
            ids = ids[ids < row.shape[-1]]
            return ids, np.asarray(row[ids], dtype=np.float32)
        pool_ids, pool_values = top_k_logits(np.asarray(row, dtype=np.float32)[None], WIDE_POOL * n_keep)
        pool_ids, pool_values = pool_ids[0], pool_values[0]
        allowed = mask.allows_each(pool_ids)
        kept_values = pool_values[allowed]  # descending, as the pool
        if kept_values.size < n_keep:
            return None
        kept_ids = pool_ids[allowed]
        order = np.argsort(kept_ids)
        return kept_ids[order], kept_values[order]

    def _shape_row(self, row: np.ndarray, position: int) -> None:
        self._bias_and_penalize(row, position)
        mask = self.mask_at(position)
        if mask is not None:
            additive, width = mask.additive, row.shape[-1]
            row += additive[:width]
            if width > additive.shape[0]:
                row[additive.shape[0] :] = -np.inf

    def _bias_and_penalize(self, row: np.ndarray, position: int) -> None:
        if self.bias is not None:
            apply_bias(row, *self.bias)
        if self.penalties is not None:
            # Only the window and the reply are read: converting the whole prompt per row would
            # cost O(context) on every draft and verify row.
            window = repeat_window(self.context, position, self.penalties.repeat_last_n)
            generated = self.context[self.n_prompt : position]
            apply_penalties(
                row, np.asarray(window, dtype=np.int64), np.asarray(generated, dtype=np.int64), self.penalties
            )

    def problems(self, expected: Sequence[int]) -> list[str]:
        """Where the shaper's context or the grammar's consumed tokens differ from ``expected``
        (prompt + the reply's committed tokens); [] when they agree."""
        if not self.active:
            return []
        found = []
        if self.context != list(expected):
            found.append(f"grammar: follows {len(self.context)} tokens, the reply has {len(expected)}")
        reply = [t for t in expected[self.grammar_start or 0 :] if t not in self.end_tokens]
        if self.matcher is not None and self.matcher.consumed != reply:
            found.append(
                f"grammar: consumed {len(self.matcher.consumed)} tokens, not the reply's last "
                f"{len(expected) - self.grammar_start}"
            )
        return found
