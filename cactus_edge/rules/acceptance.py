"""Acceptance rules: which draft tokens survive verification (docs/methods.md, 'The rules, as
formulas').

Pure numpy: no llama.cpp here. Every rule sees, for draft position i, the draft's processed row
``draft_probs[i]`` (p_i), the target's processed row ``target_probs[i]`` (q_i) and the drafted token
d_i ~ p_i, and stops at the first rejection. Rows may be dense float arrays or
:class:`~cactus_edge.rules.sampling.SparseProbs`; a point-mass draft (prompt lookup) is a one-entry
sparse row or a one-hot dense row.

Each rule is described by one per-position law — the probability ``a_n`` of accepting drafted token
n, and the distribution ``r_n`` emitted on rejection — from which both :meth:`verify` and the exact
oracle :func:`output_distribution` are built, so the two cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..checks import is_number
from .sampling import ProbRows, SparseProbs, row_support, sample_index, sample_token

__all__ = [
    "AcceptanceRule",
    "SpeculativeSampling",
    "Cactus",
    "TypicalAcceptance",
    "ExactMatch",
    "Verdict",
    "output_distribution",
    "output_kl",
    "step_kl",
    "output_kls",
    "kl_divergence",
    "make_rule",
]


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one block of k draft tokens.

    n_accepted: length of the accepted draft prefix, 0..k.
    next_token: the token emitted after that prefix (recovered on rejection, bonus otherwise).
    acceptance_probs: the acceptance probability a_i at each position that was tried
        (n_accepted + 1 entries on rejection, k when all were accepted).
    """

    n_accepted: int
    next_token: int
    acceptance_probs: tuple[float, ...] = field(default=())


@dataclass(frozen=True)
class _Dist:
    """One distribution over the vocabulary: ``ids is None`` means dense over 0..V-1."""

    ids: np.ndarray | None
    probs: np.ndarray  # float64

    @staticmethod
    def of(row: ProbRows) -> _Dist:
        if isinstance(row, SparseProbs):
            ids, probs = row_support(row)
            return _Dist(ids, probs)
        return _Dist(None, np.asarray(row, dtype=np.float64))

    def prob(self, token: int) -> float:
        if self.ids is None:
            return float(self.probs[token])
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def sample(self, rng: np.random.Generator) -> int:
        index = sample_index(self.probs, rng)
        return index if self.ids is None else int(self.ids[index])


def _aligned(a: _Dist, b: _Dist, vocab_size: int) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Both distributions on one index set: the union of supports if both are sparse, else dense."""
    if a.ids is not None and b.ids is not None:
        ids = np.union1d(a.ids, b.ids)
        return ids, _scatter(ids, a), _scatter(ids, b)
    return None, _densify(a, vocab_size), _densify(b, vocab_size)


def _scatter(ids: np.ndarray, dist: _Dist) -> np.ndarray:
    out = np.zeros(len(ids), dtype=np.float64)
    out[np.searchsorted(ids, dist.ids)] = dist.probs
    return out


def _densify(dist: _Dist, vocab_size: int) -> np.ndarray:
    if dist.ids is None:
        return dist.probs
    out = np.zeros(vocab_size, dtype=np.float64)
    out[dist.ids] = dist.probs
    return out


def _residual(target: _Dist, draft: _Dist, vocab_size: int) -> _Dist:
    """normalize(max(0, target − draft)); falls back to ``target`` when that mass is zero (the two
    agree on the support, so rejection can only come from rounding)."""
    ids, target_on, draft_on = _aligned(target, draft, vocab_size)
    excess = np.maximum(target_on - draft_on, 0.0)
    total = excess.sum()
    if total <= 1e-12:
        return target
    return _Dist(ids, excess / total)


class AcceptanceRule:
    """Interface shared by every rule. Subclasses describe one position through
    :meth:`acceptance_prob` and :meth:`rejection_dist`; :meth:`verify` walks the block."""

    name = "rule"
    lossless = False

    def acceptance_prob(self, token: int, draft: _Dist, target: _Dist) -> float:
        raise NotImplementedError

    def rejection_dist(self, token: int, draft: _Dist, target: _Dist, vocab_size: int) -> _Dist:
        raise NotImplementedError

    def judge(
        self, token: int, draft: _Dist, target: _Dist, vocab_size: int, rng: np.random.Generator
    ) -> tuple[bool, int, float]:
        """Decide one position: (accepted, emitted token on rejection or -1, acceptance prob)."""
        accept_prob = self.acceptance_prob(token, draft, target)
        if rng.random() < accept_prob:
            return True, -1, accept_prob
        return False, self.rejection_dist(token, draft, target, vocab_size).sample(rng), accept_prob

    def verify(
        self,
        draft_tokens: np.ndarray,
        draft_probs: ProbRows,
        target_probs: ProbRows,
        rng: np.random.Generator,
    ) -> Verdict:
        """Verify a block of drafts.

        draft_tokens: int array (k,), d_i drawn from draft_probs[i].
        draft_probs: (k, V) dense or SparseProbs rows, or a list of k single rows.
        target_probs: (k+1, V) dense or SparseProbs rows (or a list); row k is the bonus position.
        """
        draft_tokens = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
        draft_probs, target_probs = _as_rows(draft_probs), _as_rows(target_probs)
        n_draft = len(draft_tokens)
        vocab_size = _check_block(draft_tokens, draft_probs, target_probs)
        accept_probs: list[float] = []
        for position in range(n_draft):
            token = int(draft_tokens[position])
            draft = _Dist.of(draft_probs[position])
            if draft.prob(token) <= 0.0:
                raise ValueError(
                    f"draft token {token} at position {position} has zero draft probability; "
                    "draft tokens must be sampled from draft_probs"
                )
            target = _Dist.of(target_probs[position])
            accepted, emitted, accept_prob = self.judge(token, draft, target, vocab_size, rng)
            accept_probs.append(accept_prob)
            if not accepted:
                return Verdict(position, emitted, tuple(accept_probs))
        bonus = sample_token(target_probs[n_draft], rng)
        return Verdict(n_draft, bonus, tuple(accept_probs))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _as_rows(rows: ProbRows | list) -> ProbRows | list:
    """Rows as given: an (n, V) array, a SparseProbs, or a list of single rows (no stacking copy)."""
    if isinstance(rows, (SparseProbs, list)):
        return rows
    return np.asarray(rows, dtype=np.float64)


def _vocab_size(rows) -> int:
    return (rows[0] if isinstance(rows, list) else rows).shape[-1]


def _check_block(draft_tokens: np.ndarray, draft_probs: ProbRows, target_probs: ProbRows) -> int:
    n_draft = len(draft_tokens)
    if len(draft_probs) != n_draft:
        raise ValueError(f"draft_probs must have k={n_draft} rows, got {len(draft_probs)}")
    if len(target_probs) != n_draft + 1:
        raise ValueError(f"target_probs must have k+1={n_draft + 1} rows, got {len(target_probs)}")
    vocab_size = _vocab_size(target_probs)
    if n_draft and _vocab_size(draft_probs) != vocab_size:
        raise ValueError(
            f"draft_probs and target_probs disagree on the vocabulary size: "
            f"{_vocab_size(draft_probs)} vs {vocab_size}"
        )
    if n_draft and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab_size):
        raise ValueError(f"draft_tokens must be token ids in [0, {vocab_size})")
    return vocab_size


class SpeculativeSampling(AcceptanceRule):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023)."""

    name = "sps"
    lossless = True

    def modified_target(self, token: int, target: _Dist) -> _Dist:
        """h in docs/methods.md, 'The rules, as formulas'; for SpS it is the target row itself."""
        return target

    def modified_target_prob(self, token: int, target: _Dist) -> float:
        """h(token) without building h: O(1) on a dense row."""
        return target.prob(token)

    def acceptance_prob(self, token: int, draft: _Dist, target: _Dist) -> float:
        return min(1.0, self.modified_target_prob(token, target) / draft.prob(token))

    def rejection_dist(self, token: int, draft: _Dist, target: _Dist, vocab_size: int) -> _Dist:
        return _residual(self.modified_target(token, target), draft, vocab_size)

    def raised_probs(self, target_probs: np.ndarray) -> np.ndarray:
        return target_probs

    def output_on_columns(self, draft_on: np.ndarray, target_on: np.ndarray) -> np.ndarray:
        """The exact output distribution at n positions at once (the per-token law of
        :func:`output_distribution` as small matrices; same result).

        draft_on, target_on: p and q of each position on shared columns, shape (n, m): column j
        of row i is one token for both (columns no row uses hold 0 in both). Returns out, shape
        (n, m). The work is (n, s, m) for s the widest draft support, as in the per-token law.
        """
        drafted = _drafted_columns(draft_on)  # (n, s): each row's draft support, then p = 0 fillers
        draft_probs = np.take_along_axis(draft_on, drafted, axis=1)
        target_probs = np.take_along_axis(target_on, drafted, axis=1)
        raised = self.raised_probs(target_probs)  # h_d(d)
        positive = draft_probs > 0.0
        accept = np.where(positive, np.minimum(1.0, raised / np.where(positive, draft_probs, 1.0)), 0.0)
        # h_d elsewhere: q scaled by (1 − h_d(d)) / (1 − q(d)); q itself where q(d) is 0 or 1.
        movable = (target_probs > 0.0) & (target_probs < 1.0)
        scale = np.where(movable, (1.0 - raised) / np.where(movable, 1.0 - target_probs, 1.0), 1.0)
        modified = scale[:, :, None] * target_on[:, None, :]  # (n, drafted d, token x)
        at_drafted = np.where(movable, raised, target_probs)[:, :, None]
        np.put_along_axis(modified, drafted[:, :, None], at_drafted, axis=2)
        excess = np.maximum(modified - draft_on[:, None, :], 0.0)
        total = excess.sum(axis=2, keepdims=True)
        residual = np.where(total > 1e-12, excess / np.where(total > 1e-12, total, 1.0), modified)
        out = np.einsum("nd,ndx->nx", draft_probs * (1.0 - accept), residual)
        kept = np.zeros_like(out)
        np.put_along_axis(kept, drafted, draft_probs * accept, axis=1)  # columns unique per row
        return out + kept


def _drafted_columns(draft_on: np.ndarray) -> np.ndarray:
    """Column indices (n, s), s the widest support: each row's columns with p > 0 first, then
    distinct columns with p = 0 (they weigh nothing)."""
    width = int(np.count_nonzero(draft_on > 0.0, axis=1).max())
    return np.argsort(draft_on <= 0.0, axis=1, kind="stable")[:, :width]


class Cactus(SpeculativeSampling):
    """Constrained acceptance speculative sampling (Hao & Mou, ICLR 2026).

    Raises the drafted token's target mass by sqrt(2·delta·q(n)·(1−q(n))) (capped at 1) and scales
    the rest of the target row down to match, then applies the SpS test against that h.
    """

    name = "cactus"
    lossless = False

    def __init__(self, delta: float) -> None:
        if not is_number(delta) or not math.isfinite(delta) or delta < 0:
            raise ValueError(f"delta must be a finite number >= 0, got {delta!r}")
        self.delta = float(delta)
        self.lossless = self.delta == 0.0

    def raised_prob(self, target_prob: float) -> float:
        """h(n) from q(n)."""
        bump = math.sqrt(2.0 * self.delta * target_prob * (1.0 - target_prob))
        return min(target_prob + bump, 1.0)

    def modified_target_prob(self, token: int, target: _Dist) -> float:
        return self.raised_prob(target.prob(token))

    def raised_probs(self, target_probs: np.ndarray) -> np.ndarray:
        """h(n) for many tokens at once, from q(n) (float64 array)."""
        bump = np.sqrt(2.0 * self.delta * target_probs * (1.0 - target_probs))
        return np.minimum(target_probs + bump, 1.0)

    def modified_target(self, token: int, target: _Dist) -> _Dist:
        target_prob = target.prob(token)
        if target_prob >= 1.0 or target_prob <= 0.0:
            return target
        raised = self.raised_prob(target_prob)
        # (1 − h(n)) / (1 − q(n)) is exactly 1.0 when delta = 0, so h = q bit for bit.
        probs = target.probs * ((1.0 - raised) / (1.0 - target_prob))
        if target.ids is None:
            probs[token] = raised
        else:
            probs[np.flatnonzero(target.ids == token)[0]] = raised
        return _Dist(target.ids, probs)

    def __repr__(self) -> str:
        return f"Cactus(delta={self.delta!r})"


class TypicalAcceptance(AcceptanceRule):
    """Typical acceptance (Medusa; vLLM): accept d iff q(d) > min(threshold, alpha·exp(−H(q)));
    on the first rejection emit argmax q. Ignores the draft distribution; lossy."""

    name = "tas"

    def __init__(self, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> None:
        if not (0.0 <= posterior_threshold <= 1.0):
            raise ValueError(f"posterior_threshold must be in [0, 1], got {posterior_threshold!r}")
        if not (0.0 <= posterior_alpha <= 1.0):
            raise ValueError(f"posterior_alpha must be in [0, 1], got {posterior_alpha!r}")
        self.posterior_threshold = float(posterior_threshold)
        self.posterior_alpha = float(posterior_alpha)

    def threshold(self, target: _Dist) -> float:
        probs = target.probs[target.probs > 0]
        entropy = float(-(probs * np.log(probs)).sum())
        return min(self.posterior_threshold, self.posterior_alpha * math.exp(-entropy))

    def acceptance_prob(self, token: int, draft: _Dist, target: _Dist) -> float:
        return 1.0 if target.prob(token) > self.threshold(target) else 0.0

    def judge(self, token, draft, target, vocab_size, rng):
        # Deterministic: no random draw, as in Medusa and vLLM.
        if self.acceptance_prob(token, draft, target) == 1.0:
            return True, -1, 1.0
        return False, _argmax(target), 0.0

    def rejection_dist(self, token: int, draft: _Dist, target: _Dist, vocab_size: int) -> _Dist:
        return _Dist(np.array([_argmax(target)]), np.ones(1))

    def output_on_columns(self, draft_on: np.ndarray, target_on: np.ndarray) -> np.ndarray:
        """See :meth:`SpeculativeSampling.output_on_columns`: accepted mass stays on the drafted
        token, the rest goes to argmax q (the first in column order, as :meth:`judge` picks it)."""
        # The threshold row by row with judge's own arithmetic: q(d) can equal α·e^−H to the
        # last bit (a uniform q with α = 1), and a sum rounded another way would flip the test.
        threshold = np.array([self.threshold(_Dist(None, row[row > 0.0])) for row in target_on])
        accepted = target_on > threshold[:, None]
        out = np.where(accepted, draft_on, 0.0)
        rows = np.arange(len(out))
        out[rows, np.argmax(target_on, axis=1)] += np.where(accepted, 0.0, draft_on).sum(axis=1)
        return out

    def __repr__(self) -> str:
        return (
            f"TypicalAcceptance(posterior_threshold={self.posterior_threshold!r}, "
            f"posterior_alpha={self.posterior_alpha!r})"
        )


def _argmax(dist: _Dist) -> int:
    index = int(np.argmax(dist.probs))
    return index if dist.ids is None else int(dist.ids[index])


class ExactMatch(AcceptanceRule):
    """What llama.cpp, llama-cpp-python and mlx-lm do: sample y ~ q, keep d iff y == d, else emit y."""

    name = "exact"
    lossless = True

    def acceptance_prob(self, token: int, draft: _Dist, target: _Dist) -> float:
        return target.prob(token)

    def rejection_dist(self, token: int, draft: _Dist, target: _Dist, vocab_size: int) -> _Dist:
        # y ~ q conditioned on y != d.
        ids, probs = (
            (np.arange(vocab_size), target.probs)
            if target.ids is None
            else (
                target.ids,
                target.probs,
            )
        )
        probs = np.where(ids == token, 0.0, probs)
        total = probs.sum()
        if total <= 0.0:
            return target
        return _Dist(None if target.ids is None else ids, probs / total)

    def judge(self, token, draft, target, vocab_size, rng):
        sampled = target.sample(rng)
        accept_prob = target.prob(token)
        return (True, -1, accept_prob) if sampled == token else (False, sampled, accept_prob)


class KLBudgetRule(AcceptanceRule):
    """A lossy rule held to a KL budget for a whole response (docs/methods.md, 'A KL budget per
    response'). Position by position, the exact KL(out ‖ target) the lossy rule would add there is
    computed first (it depends on the rows only, not on the sampled draft); the lossy rule judges
    the position while ``spent`` + that KL stays within ``budget``, and SpS (lossless) judges it and
    every later position of the response otherwise. The choice is a function of the prefix, so by
    the chain rule the response-level KL is at most the expected ``spent``, which never exceeds the
    budget. Budget 0 is SpS by construction.

    A position whose KL is too costly to measure (:func:`kl_is_measurable`: a dense row, or a
    support wider than MAX_KL_SUPPORT) is judged by SpS and spends nothing; later positions may
    still be lossy. One instance per response: ``spent`` is its running sum. ``position_kls``
    holds the KL of each position judged by the last :meth:`verify` (0 for SpS positions).
    """

    def __init__(self, rule: AcceptanceRule, budget: float) -> None:
        if not is_number(budget) or math.isnan(budget) or budget < 0:
            raise ValueError(f"kl_budget must be a number >= 0, got {budget!r}")
        self.rule, self.budget = rule, float(budget)
        self.lossless_rule = SpeculativeSampling()
        self.spent = 0.0
        self.exhausted = rule.lossless
        self.lossless = rule.lossless
        self.position_kls: tuple[float, ...] = ()
        self.name = f"{rule.name}+budget"

    def verify(self, draft_tokens, draft_probs, target_probs, rng) -> Verdict:
        draft_tokens = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
        draft_probs, target_probs = _as_rows(draft_probs), _as_rows(target_probs)
        vocab_size = _check_block(draft_tokens, draft_probs, target_probs)
        accept_probs: list[float] = []
        kls: list[float] = []
        lossy_kls = self._lossy_kls(draft_probs, target_probs, len(draft_tokens))
        for position, token in enumerate(draft_tokens.tolist()):
            rule, kl = self._rule_for(lossy_kls[position])
            draft, target = _Dist.of(draft_probs[position]), _Dist.of(target_probs[position])
            if draft.prob(token) <= 0.0:
                raise ValueError(f"draft token {token} at position {position} has zero draft probability")
            accepted, emitted, accept_prob = rule.judge(token, draft, target, vocab_size, rng)
            accept_probs.append(accept_prob)
            kls.append(kl)
            self.spent += kl
            if not accepted:
                self.position_kls = tuple(kls)
                return Verdict(position, emitted, tuple(accept_probs))
        self.position_kls = tuple(kls)
        bonus = sample_token(target_probs[len(draft_tokens)], rng)
        return Verdict(len(draft_tokens), bonus, tuple(accept_probs))

    def _lossy_kls(self, draft_probs, target_probs, n_draft: int) -> np.ndarray:
        """The KL the lossy rule would add at each position, shape (n_draft,); NaN where it is
        not measurable. All measurable positions in one computation (they depend on the rows
        only), unless the budget is already spent."""
        kls = np.full(n_draft, np.nan)
        if self.exhausted or self.budget <= 0:
            return kls
        measurable = [i for i in range(n_draft) if kl_is_measurable(draft_probs[i], target_probs[i])]
        if measurable:
            rows = [draft_probs[i] for i in measurable], [target_probs[i] for i in measurable]
            kls[measurable] = output_kls(self.rule, *rows)
        return kls

    def _rule_for(self, kl: float) -> tuple[AcceptanceRule, float]:
        """The rule for the next position given the KL the lossy rule would add there (NaN: not
        measurable, judged by SpS without spending)."""
        if self.budget <= 0:
            self.exhausted = True
        if self.exhausted or math.isnan(kl):
            return self.lossless_rule, 0.0
        if self.spent + kl <= self.budget:
            return self.rule, max(kl, 0.0)
        self.exhausted = True  # lossless for the rest of the response
        return self.lossless_rule, 0.0

    def __repr__(self) -> str:
        return f"KLBudgetRule({self.rule!r}, budget={self.budget:g})"


def make_rule(
    method: str, delta: float = 1.0, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3
) -> AcceptanceRule:
    """The rule for a method name: ``cactus`` (with delta), ``sps``, ``tas`` (with its threshold
    and alpha) or ``exact``."""
    rules = {
        "cactus": lambda: Cactus(delta),
        "sps": SpeculativeSampling,
        "tas": lambda: TypicalAcceptance(posterior_threshold, posterior_alpha),
        "exact": ExactMatch,
    }
    if method not in rules:
        raise ValueError(f"method must be one of {sorted(rules)}, got {method!r}")
    return rules[method]()


# --- the exact single-position oracle (docs/methods.md, 'The exact oracle') -------------------


def output_distribution(
    rule: AcceptanceRule, draft_probs_row: ProbRows, target_probs_row: ProbRows
) -> ProbRows:
    """Exact distribution of the token emitted at one position when d ~ draft_probs_row:

        out(x) = Σ_n p(n) · [1{x = n} · a_n + (1 − a_n) · r_n(x)]

    Costs O(|supp p| × |supp p ∪ supp q|) for sparse rows. Returns the same kind of row as the
    inputs: dense (V,) if either input is dense, else a SparseProbs over the union of supports.
    """
    vocab_size = target_probs_row.shape[-1]
    draft = _Dist.of(draft_probs_row)
    target = _Dist.of(target_probs_row)
    union_ids, _, _ = _aligned(target, draft, vocab_size)
    out = np.zeros(vocab_size if union_ids is None else len(union_ids), dtype=np.float64)

    def add(dist: _Dist, weight: float) -> None:
        if union_ids is None:
            out[:] += weight * _densify(dist, vocab_size)
        else:
            out[np.searchsorted(union_ids, dist.ids)] += weight * dist.probs

    draft_ids = np.flatnonzero(draft.probs) if draft.ids is None else draft.ids
    for token in draft_ids:
        token = int(token)
        draft_prob = draft.prob(token)
        accept_prob = rule.acceptance_prob(token, draft, target)
        add(_Dist(np.array([token]), np.ones(1)), draft_prob * accept_prob)
        if accept_prob < 1.0:
            add(rule.rejection_dist(token, draft, target, vocab_size), draft_prob * (1 - accept_prob))
    if union_ids is None:
        return out
    return SparseProbs(union_ids, out, vocab_size)


# Positions are measured together while their rows are at most this wide (top-k 20 rows, lookup
# drafts): padding every position to the widest costs less than a call per position. Wider
# nuclei differ in width by position, and padding would multiply the work.
MAX_BATCHED_KL_WIDTH = 64

# The exact per-position KL is an s × m computation (draft support × union of supports): cheap at
# this width, too slow for a step at a few thousand. Wider positions go unmeasured.
MAX_KL_SUPPORT = 256


def kl_is_measurable(draft_probs_row: ProbRows, target_probs_row: ProbRows) -> bool:
    """Whether output_kl is cheap for these rows: both sparse, neither support wider than
    MAX_KL_SUPPORT (top-k rows, narrow top-p nuclei and lookup drafts are)."""
    return all(
        isinstance(row, SparseProbs) and np.count_nonzero(row.probs) <= MAX_KL_SUPPORT
        for row in (draft_probs_row, target_probs_row)
    )


def step_kl(rule: AcceptanceRule, draft_rows, target_rows, n_decided: int) -> float | None:
    """Mean KL(out ‖ target) over the first n_decided positions of a step, as the engine reports
    it: 0 for lossless rules; for a KL budget, the positions it measured to keep the budget (so
    call it right after that rule's ``verify``); None when a row is too costly to measure (dense
    or very wide, see MAX_KL_SUPPORT). draft_rows: k rows; target_rows: at least n_decided rows."""
    if rule.lossless:
        return 0.0
    if isinstance(rule, KLBudgetRule):
        return float(np.mean(rule.position_kls)) if rule.position_kls else None
    drafts, targets = draft_rows[:n_decided], [target_rows[i] for i in range(n_decided)]
    if not drafts or not all(kl_is_measurable(d, t) for d, t in zip(drafts, targets, strict=True)):
        return None
    return float(np.mean(output_kls(rule, drafts, targets)))


def acceptance_rate(rule: AcceptanceRule, draft_probs_row: ProbRows, target_probs_row: ProbRows) -> float:
    """Exact probability that one draft token d ~ draft_probs_row is accepted at one position:
    Σ_d p(d) · a(d). For SpS this is Σ min(p, q), one minus the total variation distance.
    O(|supp p|) acceptance_prob calls; rows dense or sparse."""
    draft = _Dist.of(draft_probs_row)
    target = _Dist.of(target_probs_row)
    draft_ids = np.flatnonzero(draft.probs) if draft.ids is None else draft.ids[draft.probs > 0]
    return float(sum(draft.prob(int(d)) * rule.acceptance_prob(int(d), draft, target) for d in draft_ids))


def kl_divergence(dist_a: ProbRows, dist_b: ProbRows) -> float:
    """KL(a ‖ b) in nats for two rows (dense or sparse); inf if a has mass where b has none."""
    vocab_size = dist_b.shape[-1]
    _, a, b = _aligned(_Dist.of(dist_a), _Dist.of(dist_b), vocab_size)
    return float(_kl_rows(a[None, :], b[None, :])[0])


def _kl_rows(dist_a: np.ndarray, dist_b: np.ndarray) -> np.ndarray:
    """KL(a ‖ b) of each row of two (n, m) arrays on shared columns, shape (n,); inf for a row
    where a has mass on a column where b has none."""
    mass = dist_a > 0.0
    infinite = np.any(mass & (dist_b <= 0.0), axis=1)
    ratio = np.where(mass, dist_a / np.where(dist_b > 0.0, dist_b, 1.0), 1.0)
    kls = np.where(mass, dist_a * np.log(ratio), 0.0).sum(axis=1)
    return np.where(infinite, math.inf, kls)


def output_kl(rule: AcceptanceRule, draft_probs_row: ProbRows, target_probs_row: ProbRows) -> float:
    """KL(out ‖ target) for one position: the fidelity cost of the rule there (0 when lossless)."""
    return float(output_kls(rule, [draft_probs_row], [target_probs_row])[0])


def output_kls(rule: AcceptanceRule, draft_rows, target_rows) -> np.ndarray:
    """KL(out ‖ target) at each of n positions, shape (n,): draft_rows and target_rows are n rows
    each (lists of single rows, or (n, V) blocks). Sparse rows and rules with a vectorized law
    (``output_on_columns``) take one small matrix computation for all positions; anything else the
    per-token oracle, position by position. Both give the same distributions (tested)."""
    n_positions = len(draft_rows)
    if rule.lossless or n_positions == 0:
        return np.zeros(n_positions)
    rows = [(draft_rows[i], target_rows[i]) for i in range(n_positions)]
    law = getattr(rule, "output_on_columns", None)
    if law is None or not all(isinstance(r, SparseProbs) for pair in rows for r in pair):
        return np.array([kl_divergence(output_distribution(rule, d, t), t) for d, t in rows])
    if n_positions > 1 and max(r.token_ids.size for pair in rows for r in pair) > MAX_BATCHED_KL_WIDTH:
        return np.concatenate([output_kls(rule, [d], [t]) for d, t in rows])
    draft_on, target_on = _shared_columns(rows)
    return _kl_rows(law(draft_on, target_on), target_on)


def _shared_columns(rows: list[tuple[SparseProbs, SparseProbs]]) -> tuple[np.ndarray, np.ndarray]:
    """(draft_on, target_on), shape (n, m): each position's target support in its stored order,
    then the draft support the target lacks; padded with zeros to the widest position. Supports,
    not stored rows: a row's zero entries (top-p/min-p padding, up to MAX_SPARSE_NUCLEUS wide)
    would widen the (n, s, m) law with columns that carry no mass."""
    supports = [(row_support(d), row_support(t)) for d, t in rows]
    target_ids = _padded([t[0] for _, t in supports], fill=-1)
    target_on = _padded([t[1] for _, t in supports], fill=0.0)
    draft_ids = _padded([d[0] for d, _ in supports], fill=-2)  # -2 matches no padded target id
    draft_probs = _padded([d[1] for d, _ in supports], fill=0.0)
    same = draft_ids[:, :, None] == target_ids[:, None, :]  # (n, draft entry, target entry)
    draft_at_target = np.einsum("nd,ndt->nt", draft_probs, same.astype(np.float64))
    draft_elsewhere = np.where(same.any(axis=2), 0.0, draft_probs)
    draft_on = np.concatenate([draft_at_target, draft_elsewhere], axis=1)
    return draft_on, np.concatenate([target_on, np.zeros_like(draft_elsewhere)], axis=1)


def _padded(arrays: list[np.ndarray], fill) -> np.ndarray:
    """Rows of different lengths as one (n, max length) array, padded with ``fill``."""
    width = max(len(a) for a in arrays)
    out = np.full((len(arrays), width), fill, dtype=np.result_type(arrays[0], type(fill)))
    for index, values in enumerate(arrays):
        out[index, : len(values)] = values
    return out
