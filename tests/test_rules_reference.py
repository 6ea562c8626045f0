"""Every acceptance rule against the independent reference in tests/reference_rules.py.

Exact checks (acceptance probability, rejection distribution, output law, acceptance rate, KL,
both the per-token and the matrix form) compare at 1e-12 on seeded random rows. Statistical
checks run `verify` on whole blocks and compare what it emits with the reference's exact block
law (chi-square, significance 0.001); the same counts must reject the law of the rule with one
constant wrong, so each statistical test shows its own power.
"""

import math

import numpy as np
import pytest
from scipy import stats

from cactus_edge.rules.acceptance import (
    Cactus,
    ExactMatch,
    SpeculativeSampling,
    TypicalAcceptance,
    _Dist,
    acceptance_rate,
    output_distribution,
    output_kl,
    output_kls,
)
from cactus_edge.rules.sampling import SparseProbs, sample_token, to_dense

from . import reference_rules as ref
from .test_acceptance import random_pair

ALPHA = 1e-3
N_BLOCKS = 20_000

# (rule, reference law) pairs: every rule and a spread of δ.
CASES = [
    (SpeculativeSampling(), ref.law_for("sps")),
    (Cactus(0.0), ref.law_for("sps")),
    (Cactus(0.05), ref.law_for("cactus", delta=0.05)),
    (Cactus(0.5), ref.law_for("cactus", delta=0.5)),
    (Cactus(1.0), ref.law_for("cactus", delta=1.0)),
    (Cactus(3.0), ref.law_for("cactus", delta=3.0)),
    (TypicalAcceptance(), ref.law_for("tas")),
    (TypicalAcceptance(0.3, 0.6), ref.law_for("tas", posterior_threshold=0.3, posterior_alpha=0.6)),
    (ExactMatch(), ref.law_for("exact")),
]
CASE_IDS = [repr(rule) for rule, _ in CASES]


# --- literal values, computed by hand ---------------------------------------------------------


def test_cactus_raises_the_drafted_token_by_the_golden_amounts():
    # q(n) = 0.3, δ = 1: h(n) = 0.3 + √(2·1·0.3·0.7) = 0.3 + √0.42 = 0.948074069840786;
    # the rest of q = (0.3, 0.5, 0.2) scales by (1 − 0.948074…)/0.7 = 0.074179900227449.
    h = Cactus(1.0).modified_target(0, _Dist(None, np.array([0.3, 0.5, 0.2]))).probs
    np.testing.assert_allclose(h, [0.948074069840786, 0.0370899501137245, 0.0148359800454898], rtol=1e-12)
    # q(n) = 0.5, δ = 0.125: 0.5 + √(2·0.125·0.25) = 0.5 + 0.25 = 0.75 exactly.
    assert Cactus(0.125).raised_prob(0.5) == 0.75
    # q(n) = 0.5, δ = 2: 0.5 + √1 = 1.5, capped at 1.
    assert Cactus(2.0).raised_prob(0.5) == 1.0
    # q(n) = 0.1, δ = 0.5: 0.1 + √(0.09) = 0.4; the matrix form agrees.
    assert Cactus(0.5).raised_probs(np.array([0.1, 0.3]))[0] == pytest.approx(0.4, abs=1e-15)
    assert Cactus(1.0).raised_probs(np.array([0.3]))[0] == pytest.approx(0.948074069840786, abs=1e-15)


def test_cactus_accepts_and_recovers_with_the_golden_probabilities():
    # p = (0.9, 0.1, 0), q = (0.3, 0.5, 0.2), n = 0, δ = 1: h(0) = 0.948074… > 0.9, so accept.
    # δ = 0.125 gives h(0) = 0.3 + √(0.0525) = 0.529128784747792: accept with 0.529128…/0.9.
    draft, target = _Dist(None, np.array([0.9, 0.1, 0.0])), _Dist(None, np.array([0.3, 0.5, 0.2]))
    assert Cactus(1.0).acceptance_prob(0, draft, target) == 1.0
    assert Cactus(0.125).acceptance_prob(0, draft, target) == pytest.approx(
        0.529128784747792 / 0.9, rel=1e-12
    )
    # Rejected: h − p = (0.529… − 0.9, 0.5·s − 0.1, 0.2·s), s = 0.470871…/0.7 = 0.672673…;
    # positive parts 0.236337…, 0.134535… (sum 0.370871…), normalized 0.637247…, 0.362753….
    residual = Cactus(0.125).rejection_dist(0, draft, target, 3).probs
    np.testing.assert_allclose(residual, [0.0, 0.637247035099, 0.362752964901], rtol=1e-9)


def test_sps_recovers_from_the_golden_residual():
    # p = (0.6, 0.4, 0), q = (0.2, 0.5, 0.3), n = 0: a = 0.2/0.6 = 1/3; max(0, q − p) = (0, 0.1,
    # 0.3), normalized (0, 0.25, 0.75); the output law is q again.
    draft, target = _Dist(None, np.array([0.6, 0.4, 0.0])), _Dist(None, np.array([0.2, 0.5, 0.3]))
    rule = SpeculativeSampling()
    assert rule.acceptance_prob(0, draft, target) == pytest.approx(1 / 3, rel=1e-15)
    np.testing.assert_allclose(rule.rejection_dist(0, draft, target, 3).probs, [0, 0.25, 0.75], atol=1e-15)
    np.testing.assert_allclose(output_distribution(rule, draft.probs, target.probs), target.probs, atol=1e-15)


def test_typical_acceptance_thresholds_use_natural_logs():
    # q = (0.3, 0.3, 0.3, 0.07, 0.03): H = −0.9·ln 0.3 − 0.07·ln 0.07 − 0.03·ln 0.03 = 1.374920
    # nats; 0.3·e^−H = 0.075858 < 0.09, so q(3) = 0.07 is rejected. In bits H = 1.983591 and
    # 0.3·e^−H = 0.041272: a rule taking log2 would accept it.
    target = _Dist(None, np.array([0.3, 0.3, 0.3, 0.07, 0.03]))
    rule = TypicalAcceptance()
    assert rule.threshold(target) == pytest.approx(0.0758579, rel=1e-5)
    assert rule.acceptance_prob(3, _Dist(None, np.full(5, 0.2)), target) == 0.0
    assert rule.acceptance_prob(0, _Dist(None, np.full(5, 0.2)), target) == 1.0
    # A flat q over two tokens: H = ln 2, α·e^−H = 0.15; the threshold is min(0.09, 0.15).
    assert rule.threshold(_Dist(None, np.array([0.5, 0.5]))) == 0.09
    assert TypicalAcceptance(1.0, 0.3).threshold(_Dist(None, np.array([0.5, 0.5]))) == pytest.approx(0.15)


def test_exact_match_keeps_the_draft_with_the_target_probability():
    # y ~ q = (0.2, 0.5, 0.3) is kept iff y = n = 1: a = 0.5; otherwise y ~ (0.2, 0, 0.3)/0.5.
    draft, target = _Dist(None, np.array([0.1, 0.8, 0.1])), _Dist(None, np.array([0.2, 0.5, 0.3]))
    assert ExactMatch().acceptance_prob(1, draft, target) == 0.5
    np.testing.assert_allclose(ExactMatch().rejection_dist(1, draft, target, 3).probs, [0.4, 0.0, 0.6])


# --- exact agreement on random rows -----------------------------------------------------------


def _row_pairs(n_pairs: int, seed: int):
    """Seeded (draft, target) pairs: dense and sparse, peaked and flat, with partial overlap."""
    rng = np.random.default_rng(seed)
    for index in range(n_pairs):
        sparse = index % 2 == 1
        concentration = [0.1, 0.4, 2.0][index % 3]
        yield random_pair(rng, vocab_size=12, sparse=sparse, support=6, concentration=concentration)


@pytest.mark.parametrize(("rule", "law"), CASES, ids=CASE_IDS)
def test_acceptance_and_rejection_match_the_reference_at_every_drafted_token(rule, law):
    compared = 0
    for draft_row, target_row in _row_pairs(120, seed=31):
        draft_probs, target_probs = ref.dense(draft_row), ref.dense(target_row)
        draft, target = _Dist.of(draft_row), _Dist.of(target_row)
        for token in np.flatnonzero(draft_probs):
            accept, residual = law(draft_probs, target_probs, int(token))
            assert rule.acceptance_prob(int(token), draft, target) == pytest.approx(accept, abs=1e-12)
            if residual is not None:
                rejected = to_dense(_as_row(rule.rejection_dist(int(token), draft, target, 12), 12))
                np.testing.assert_allclose(rejected, residual, atol=1e-12)
                compared += 1
    assert compared > 100  # rejections are common on these rows


@pytest.mark.parametrize(("rule", "law"), CASES, ids=CASE_IDS)
def test_output_law_acceptance_rate_and_kl_match_the_reference(rule, law):
    for draft_row, target_row in _row_pairs(120, seed=47):
        expected = ref.output_law(law, draft_row, target_row)
        np.testing.assert_allclose(
            to_dense(output_distribution(rule, draft_row, target_row)), expected, atol=1e-12
        )
        assert acceptance_rate(rule, draft_row, target_row) == pytest.approx(
            ref.acceptance_rate(law, draft_row, target_row), abs=1e-12
        )
        assert output_kl(rule, draft_row, target_row) == pytest.approx(
            ref.kl(expected, target_row), abs=1e-10
        )


@pytest.mark.parametrize(("rule", "law"), CASES, ids=CASE_IDS)
def test_the_matrix_form_of_a_step_matches_the_reference(rule, law):
    """output_kls over several sparse positions at once (the engine's fidelity meter and the KL
    budget use it) equals the reference KL position by position."""
    rng = np.random.default_rng(53)
    for _ in range(40):
        pairs = [
            random_pair(rng, vocab_size=30, sparse=True, support=int(rng.integers(2, 9))) for _ in range(4)
        ]
        if rng.random() < 0.5:  # a lookup draft: one token with probability 1
            token = int(pairs[1][1].token_ids[0])
            pairs[1] = (SparseProbs(np.array([token]), np.ones(1), 30), pairs[1][1])
        drafts, targets = [d for d, _ in pairs], [t for _, t in pairs]
        expected = [ref.kl(ref.output_law(law, d, t), t) for d, t in pairs]
        np.testing.assert_allclose(output_kls(rule, drafts, targets), expected, rtol=0, atol=1e-10)


def _as_row(dist: _Dist, vocab_size: int):
    if dist.ids is None:
        return dist.probs
    return SparseProbs(dist.ids, dist.probs, vocab_size)


# --- whole blocks through verify, against the exact block law ----------------------------------


def emitted_blocks(rule, draft_rows, target_rows, n_blocks: int, seed: int) -> dict[tuple[int, ...], int]:
    """What n_blocks seeded verifications of one block emit (accepted drafts, then the recovered
    or bonus token), with d_i drawn from the draft's row at each position."""
    rng = np.random.default_rng(seed)
    draft_stack, target_stack = np.stack(draft_rows), np.stack(target_rows)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n_blocks):
        tokens = np.array([sample_token(row, rng) for row in draft_rows])
        verdict = rule.verify(tokens, draft_stack, target_stack, rng)
        key = (*tokens[: verdict.n_accepted].tolist(), verdict.next_token)
        counts[key] = counts.get(key, 0) + 1
    return counts


def block_pvalue(counts: dict, law: dict) -> float:
    """Chi-square p-value of the counts against an exact law over outcomes; outcomes expecting
    fewer than 5 are pooled; an outcome the law gives no mass is an outright failure."""
    total = sum(counts.values())
    if any(law.get(key, 0.0) <= 0.0 for key in counts):
        return 0.0
    keys = sorted(law, key=law.get)
    expected = np.array([law[k] * total for k in keys])
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    n_pooled = int(np.searchsorted(np.cumsum(expected), 5.0)) + 1
    observed = np.append(observed[n_pooled:], observed[:n_pooled].sum())
    expected = np.append(expected[n_pooled:], expected[:n_pooled].sum())
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def _mutant_sps_law(draft_probs, target_probs, token):
    """SpS with the raw target row as its rejection distribution."""
    accept = min(1.0, target_probs[token] / draft_probs[token])
    return accept, target_probs


def _mutant_tas_law(draft_probs, target_probs, token):
    """TAS with the entropy in bits."""
    support = target_probs[target_probs > 0]
    entropy_bits = float(-(support * np.log2(support)).sum())
    threshold = min(0.09, 0.3 * math.exp(-entropy_bits))
    if target_probs[token] > threshold:
        return 1.0, None
    argmax = np.zeros_like(target_probs)
    argmax[int(np.argmax(target_probs))] = 1.0
    return 0.0, argmax


def _block_rows(seed: int, vocab_size: int = 5, n_draft: int = 2):
    rng = np.random.default_rng(seed)
    drafts = [rng.dirichlet(np.ones(vocab_size) * 0.6) for _ in range(n_draft)]
    targets = [rng.dirichlet(np.ones(vocab_size) * 0.6) for _ in range(n_draft + 1)]
    return drafts, targets


# TAS's rows put draft mass on a token between the nats and bits thresholds (see the golden test).
_TAS_TARGET = np.array([0.3, 0.3, 0.3, 0.07, 0.03])
_TAS_DRAFT = np.array([0.1, 0.1, 0.1, 0.6, 0.1])

BLOCK_CASES = [
    # (rule, its reference law, the law with one constant wrong, rows)
    (SpeculativeSampling(), ref.law_for("sps"), _mutant_sps_law, _block_rows(61)),
    (Cactus(0.25), ref.law_for("cactus", delta=0.25), ref.law_for("cactus", delta=0.125), _block_rows(62)),
    (Cactus(1.0), ref.law_for("cactus", delta=1.0), ref.law_for("cactus", delta=0.5), _block_rows(63)),
    (TypicalAcceptance(), ref.law_for("tas"), _mutant_tas_law, ([_TAS_DRAFT] * 2, [_TAS_TARGET] * 3)),
    (ExactMatch(), ref.law_for("exact"), ref.law_for("sps"), _block_rows(64)),
]


@pytest.mark.statistical
@pytest.mark.parametrize(
    ("rule", "law", "mutant_law", "rows"), BLOCK_CASES, ids=[repr(c[0]) for c in BLOCK_CASES]
)
def test_verified_blocks_follow_the_reference_block_law(rule, law, mutant_law, rows):
    """k = 2 blocks over 5 tokens, 20,000 seeded verifications: the joint law of (accepted
    prefix, recovered or bonus token) — both positions and the bonus — against the reference's
    exact block law. Power: the same counts reject the law with Cactus's factor 2 dropped
    (δ/2), TAS's entropy in bits, SpS's residual replaced by q, or, for exact match, SpS's
    acceptance (the same output law, other verdicts), each at p < 0.001."""
    draft_rows, target_rows = rows
    counts = emitted_blocks(rule, draft_rows, target_rows, N_BLOCKS, seed=7)
    assert block_pvalue(counts, ref.block_law(law, draft_rows, target_rows)) > ALPHA
    assert block_pvalue(counts, ref.block_law(mutant_law, draft_rows, target_rows)) < ALPHA
