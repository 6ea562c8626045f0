"""One reply's constraints along its context: the grammar's state, penalty counts and logit bias,
applied to a row's raw logits before processing (SPEC, "Constraints"). No llama.cpp here.

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

from .grammar import GrammarMatcher
from .penalties import Penalties, apply_bias, apply_penalties, repeat_window

__all__ = ["LogitShaper"]


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
        self._masks: dict[int, np.ndarray | None] = {}
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

    def mask_at(self, position: int) -> np.ndarray | None:
        """The grammar's verdict at ``position`` (≤ the current one) as an additive mask, float32
        (V,): 0 where it allows a token, -inf where it refuses one; None where no grammar applies.
        A past position's mask was kept when the context passed it. Additive, because adding it
        to a row costs a twentieth of assigning -inf through a boolean index (150k entries)."""
        if self.ended_at is not None and position > self.ended_at:
            return None
        if position in self._masks:
            return self._masks[position]
        if position != self.position:
            # Not kept: the grammar was off there (a mask is kept whenever a token is consumed).
            return None
        mask = None
        if self.matcher is not None:
            with np.errstate(divide="ignore"):  # log(1) = 0 where allowed, log(0) = -inf
                mask = np.log(self.matcher.allowed().astype(np.float32))
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
        allowed = np.flatnonzero(self.mask_at(self.position) == 0)
        if allowed.size == 1 or (allowed.size and self.end_tokens.issuperset(allowed.tolist())):
            return [int(allowed[0])]
        return []

    @property
    def ended(self) -> bool:
        """Whether the context holds an end token past the prompt (nothing after it counts)."""
        return self.ended_at is not None

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` at the current position (always without one)."""
        mask = self.mask_at(self.position)
        return mask is None or mask[token] == 0

    # --- shaping rows ----------------------------------------------------------------------------------

    def shape(self, logits: np.ndarray, first_position: int) -> np.ndarray:
        """Shaped copies of raw logit rows: (V,) for the row predicting ``first_position``, or
        (n, V) for rows predicting first_position, first_position + 1, … (float32)."""
        rows = np.array(logits, dtype=np.float32, copy=True, ndmin=2)
        for index in range(len(rows)):
            self._shape_row(rows[index], first_position + index)
        return rows if np.ndim(logits) == 2 else rows[0]

    def _shape_row(self, row: np.ndarray, position: int) -> None:
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
        mask = self.mask_at(position)
        if mask is not None:
            width = row.shape[-1]
            row += mask[:width]
            if width > mask.shape[0]:
                row[mask.shape[0] :] = -np.inf

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
