"""Choosing the draft length from measured costs (pure functions and small state, no llama.cpp).

Before each step the engine asks for the k (0 allowed: plain decoding) that maximises expected
tokens per second,

    E[tokens | k] / (k · draft_ms + verify_ms(k + 1)),   E[tokens | k] = 1 + Σ_{j=1..k} Π_{i<j} α_i

where α_i is the running estimate of P(accept position i | positions before it were accepted).
Costs are running averages measured by the engine itself, so the same code picks long drafts on
a GPU (verification nearly free) and short or no drafts on a 2-core CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SMOOTHING = 0.2  # weight of a new measurement in the moving averages
PRIOR_ACCEPTANCE = 0.6  # optimistic, so speculation is tried before anything is measured
MIN_PROBE_INTERVAL = 16  # steps between probes (one token more than the policy says)…
MAX_PROBE_INTERVAL = 256  # …doubling up to this while probes keep failing


def expected_tokens(acceptance: np.ndarray, n_draft: int) -> float:
    """E[emitted tokens] for a block of n_draft drafts: accepted prefix + the next token.

    acceptance: (≥ n_draft,) conditional acceptance probabilities by position.
    """
    if n_draft == 0:
        return 1.0
    return 1.0 + float(np.sum(np.cumprod(acceptance[:n_draft])))


def choose_draft_length(acceptance: np.ndarray, draft_ms: float, verify_ms, max_draft: int) -> int:
    """The k in 0..max_draft maximising expected tokens per millisecond.

    verify_ms: callable n → milliseconds to verify a batch of n tokens.
    """
    best_k, best_rate = 0, 1.0 / verify_ms(1)
    for k in range(1, max_draft + 1):
        rate = expected_tokens(acceptance, k) / (k * draft_ms + verify_ms(k + 1))
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


@dataclass
class CostModel:
    """Running averages of what decoding costs on this machine, per engine."""

    draft_ms: float | None = None  # one single-token draft decode
    verify_ms_by_size: dict[int, float] = field(default_factory=dict)  # batch size → ms
    _line: tuple[float, float] | None = field(default=None, repr=False)  # fit cache, reset on record

    def record_draft(self, ms: float) -> None:
        self.draft_ms = ms if self.draft_ms is None else _blend(self.draft_ms, ms)

    def record_verify(self, n_tokens: int, ms: float) -> None:
        old = self.verify_ms_by_size.get(n_tokens)
        self.verify_ms_by_size[n_tokens] = ms if old is None else _blend(old, ms)
        self._line = None

    @property
    def ready(self) -> bool:
        """Both costs a model-drafted step needs have been measured."""
        return self.draft_ms is not None and bool(self.verify_ms_by_size)

    def verify_ms(self, n_tokens: int) -> float:
        """Measured cost of verifying n tokens, else a line through the measured sizes. With one
        size measured, other sizes are guessed to cost the same (the optimistic, memory-bound
        guess): speculation gets tried, is measured, and is dropped if it loses."""
        table = self.verify_ms_by_size
        if n_tokens in table:
            return table[n_tokens]
        if len(table) == 1:
            return next(iter(table.values()))
        if self._line is None:
            sizes = np.array(sorted(table), dtype=np.float64)
            slope, intercept = np.polyfit(sizes, [table[int(s)] for s in sizes], 1)
            self._line = (float(slope), float(intercept))
        slope, intercept = self._line
        return max(slope * n_tokens + intercept, 1e-3)


@dataclass
class AcceptanceTracker:
    """Running estimate of the conditional acceptance probability at each draft position."""

    max_draft: int
    rates: np.ndarray = field(init=False)
    probe_every: int = MIN_PROBE_INTERVAL
    steps_since_probe: int = 0

    def __post_init__(self) -> None:
        self.rates = np.full(max(self.max_draft, 1), PRIOR_ACCEPTANCE)

    def should_probe(self) -> bool:
        """Count a step; True every ``probe_every`` steps. Acceptance and costs drift with the
        text, and a policy that stopped drafting would otherwise never learn it should resume."""
        self.steps_since_probe += 1
        if self.steps_since_probe < self.probe_every:
            return False
        self.steps_since_probe = 0
        return True

    def record_probe(self, n_accepted: int) -> None:
        """A probe that accepted nothing doubles the wait before the next (a failed probe costs a
        draft catch-up and a wider verify); one that paid resets it."""
        if n_accepted:
            self.probe_every = MIN_PROBE_INTERVAL
        else:
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_INTERVAL)

    def record(self, acceptance_probs: tuple[float, ...]) -> None:
        """Use the rule's acceptance probabilities (a lower-variance signal than 0/1 outcomes)."""
        for position, prob in enumerate(acceptance_probs[: len(self.rates)]):
            self.rates[position] = _blend(self.rates[position], prob)


def _blend(old: float, new: float) -> float:
    return (1 - SMOOTHING) * old + SMOOTHING * new
