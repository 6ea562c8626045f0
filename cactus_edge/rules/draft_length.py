"""Choosing the draft length from measured costs (pure functions and small state, no llama.cpp).

Before each step the engine asks for the k (0 allowed: plain decoding) that maximises expected
tokens per second,

    E[tokens | k] / (draft_ms(k) + verify_ms(k + 1)),   E[tokens | k] = 1 + Σ_{j=1..k} Π_{i<j} α_i

where α_i is the running estimate of P(accept position i | positions before it were accepted).
Costs are running averages, per batch size, measured by the engine itself, so the same code picks
long drafts on a GPU (verification nearly free) and short or no drafts on a 2-core CPU. draft_ms(k)
is not k single decodes in general: the first draft decode also feeds the tokens the draft skipped
while k was 0, and a lookup guess lets one batch decode produce several draft rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SMOOTHING = 0.2  # weight of a new measurement in the moving averages
PRIOR_ACCEPTANCE = 0.6  # optimistic, so speculation is tried before anything is measured
MIN_PROBE_INTERVAL = 16  # steps between probes (one token more than the policy says)…
MAX_PROBE_INTERVAL = 256  # …doubling up to this while probes keep failing
# Draft only when the expected rate beats plain decoding by this fraction: the estimates are
# moving averages of noisy timings, and a step also costs what they leave out (sampling, lookup).
SPECULATION_MARGIN = 0.05
# Tokens a draft catch-up (the lazily fed prompt, or what plain steps skipped) is spread over at
# most: once fed, the draft stays nearly in sync for the rest of the reply, but the reply may end.
CATCH_UP_HORIZON = 64


def expected_tokens(acceptance: np.ndarray, n_draft: int) -> float:
    """E[emitted tokens] for a block of n_draft drafts: accepted prefix + the next token.

    acceptance: (≥ n_draft,) conditional acceptance probabilities by position.
    """
    if n_draft == 0:
        return 1.0
    return 1.0 + float(np.sum(np.cumprod(acceptance[:n_draft])))


def choose_draft_length(
    acceptance: np.ndarray, draft_ms, verify_ms, max_draft: int, margin: float = 0.0
) -> int:
    """The k in 0..max_draft maximising expected tokens per millisecond; a k > 0 must also beat
    plain decoding by ``margin`` (a fraction), or k = 0.

    draft_ms: callable k → milliseconds to draft k tokens (k ≥ 1), catch-up included.
    verify_ms: callable n → milliseconds to verify a batch of n tokens.
    """
    best_k, best_rate = 0, (1.0 + margin) / verify_ms(1)
    # E[tokens | k] for every k at once, as Python floats: this runs on every plain step, where
    # per-k numpy calls would cost more than the arithmetic.
    expected = [1.0, *(1.0 + np.cumsum(np.cumprod(acceptance[:max_draft]))).tolist()]
    for k in range(1, max_draft + 1):
        rate = expected[min(k, len(expected) - 1)] / (draft_ms(k) + verify_ms(k + 1))
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


def best_probe_length(draft_ms, verify_ms, max_draft: int) -> int:
    """The draft length (1..max_draft) whose block, if fully accepted, yields the most tokens per
    millisecond: where a probe has the best chance to show that drafting pays. Batch costs are not
    linear on CPUs (Q4_0's repacked kernels make 4 tokens cheaper than 3), so this is often not
    the shortest block. Ties go to the shorter one."""
    return max(range(1, max(max_draft, 1) + 1), key=lambda k: (k + 1) / (draft_ms(k) + verify_ms(k + 1)))


def could_pay(n_draft: int, draft_ms, verify_ms, margin: float = 0.0) -> bool:
    """Whether drafting n_draft tokens could beat plain decoding if every draft were accepted.
    When not, a probe cannot show that speculation pays, so it is not worth its cost."""
    best_case = (n_draft + 1) / (draft_ms(n_draft) + verify_ms(n_draft + 1))
    return best_case > (1.0 + margin) / verify_ms(1)


@dataclass
class BatchCosts:
    """Running average of one model's llama_decode milliseconds per batch size.

    On a CPU a batch of n tokens costs a fixed part (reading the weights once) plus a per-token
    part, and some sizes hit faster kernels than their neighbours (4 may cost less than 3), so
    measured sizes are used as measured and only unmeasured sizes come from a fitted line."""

    by_size: dict[int, float] = field(default_factory=dict)
    _line: tuple[float, float] | None = field(default=None, repr=False)  # fit cache, reset on record

    def record(self, n_tokens: int, ms: float) -> None:
        old = self.by_size.get(n_tokens)
        self.by_size[n_tokens] = ms if old is None else _blend(old, ms)
        self._line = None

    def __bool__(self) -> bool:
        return bool(self.by_size)

    def __call__(self, n_tokens: int) -> float:
        """Measured cost of a batch of n tokens, else a line through the measured sizes. With one
        size measured, other sizes are guessed to cost the same (the optimistic, memory-bound
        guess): speculation gets tried, is measured, and is dropped if it loses."""
        table = self.by_size
        if n_tokens in table:
            return table[n_tokens]
        if len(table) == 1:
            return next(iter(table.values()))
        if self._line is None:
            sizes = np.array(sorted(table), dtype=np.float64)
            slope, intercept = np.polyfit(sizes, [table[int(s)] for s in sizes], 1)
            self._line = (max(float(slope), 0.0), float(intercept))
        slope, intercept = self._line
        return max(slope * n_tokens + intercept, 1e-3)


# Batch sizes whose cost `auto` measures before its first choice (verify: k + 1 for k ≤ 8; draft:
# single tokens and the short batches of a lookup-guided draft). Larger sizes come from a line.
CALIBRATION_VERIFY_SIZES = tuple(range(1, 10))
CALIBRATION_DRAFT_SIZES = (1, 2, 3, 4, 5)


@dataclass
class CostModel:
    """What decoding costs on this machine, per engine: draft and target batches by size.
    ``calibrated``: which models ("target", "draft") had the sizes above measured up front;
    ``kept``: which of them started from a table an earlier process measured (cost_cache)."""

    draft: BatchCosts = field(default_factory=BatchCosts)
    verify: BatchCosts = field(default_factory=BatchCosts)
    calibrated: set[str] = field(default_factory=set)
    kept: set[str] = field(default_factory=set)

    def record_draft(self, n_tokens: int, ms: float) -> None:
        self.draft.record(n_tokens, ms)

    def record_verify(self, n_tokens: int, ms: float) -> None:
        self.verify.record(n_tokens, ms)

    def verify_ms(self, n_tokens: int) -> float:
        return self.verify(n_tokens)

    @property
    def ready(self) -> bool:
        """Both costs a model-drafted step needs have been measured."""
        return bool(self.draft) and bool(self.verify)

    def model_draft_ms(
        self, n_draft: int, n_catch_up: int = 0, n_guided: int = 0, run_tokens: float = 0.0
    ) -> float:
        """Milliseconds to draft n_draft tokens with the draft model, charged to this step.

        One decode per token, except that the first decode also feeds the n_catch_up committed
        tokens the draft skipped while k was 0, and the n_guided tokens of a lookup guess (one
        batch yields a row per guessed token, used while the draft's samples follow the guess).
        The catch-up buys every step of the drafting run it starts, so it is spread over the
        steps of a run of ``run_tokens`` expected tokens (at most n_draft + 1 per step).
        """
        batched = min(n_draft - 1, n_guided)
        singles = (n_draft - 1 - batched) * self.draft(1)
        in_sync = self.draft(1 + batched)
        if n_catch_up == 0:
            return in_sync + singles
        catch_up = max(self.draft(n_catch_up + 1 + batched) - in_sync, 0.0)
        return in_sync + catch_up / max(1.0, run_tokens / (n_draft + 1)) + singles


def expected_run(first_acceptance: float) -> float:
    """Expected number of tokens before the first rejection when each is accepted with
    probability first_acceptance (geometric; capped at 0.99, i.e. 99 tokens)."""
    rate = min(max(first_acceptance, 0.0), 0.99)
    return rate / (1.0 - rate)


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

    def record_probe(self, paid: bool) -> None:
        """A probe after which the policy still would not draft doubles the wait before the next
        (a probe costs a draft catch-up and a wider verify); one that turned speculation back on
        resets it."""
        if paid:
            self.probe_every = MIN_PROBE_INTERVAL
        else:
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_INTERVAL)

    def record_lookup_outcome(self, followed: bool) -> None:
        """A plain step that had a lookup guess: did the target's token follow it? Free evidence
        about the first position of guided drafting (a draft fed the guess mostly follows it too,
        so it is accepted about when the target follows), and the only evidence while k is 0.
        Later positions learn from real drafts only: applied to all of them, this evidence overstates
        how far drafts follow, and `auto` drafts far more tokens than are accepted."""
        self.rates[0] = _blend(self.rates[0], 1.0 if followed else 0.0)

    def record(self, acceptance_probs: tuple[float, ...]) -> None:
        """Use the rule's acceptance probabilities (a lower-variance signal than 0/1 outcomes)."""
        for position, prob in enumerate(acceptance_probs[: len(self.rates)]):
            self.rates[position] = _blend(self.rates[position], prob)


def _blend(old: float, new: float) -> float:
    return (1 - SMOOTHING) * old + SMOOTHING * new
