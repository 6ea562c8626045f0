"""Acceptance rules against the exact single-position oracle (docs/methods.md, 'The exact
oracle'), with seeded statistical tests.

Every statistical test uses a chi-square goodness-of-fit test at significance 0.001 and shows, in
the same test, that a deliberately broken rule is rejected by it.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from cactus_edge.rules.acceptance import (
    Cactus,
    ExactMatch,
    SpeculativeSampling,
    TypicalAcceptance,
    _Dist,
    _residual,
    acceptance_rate,
    kl_divergence,
    make_rule,
    output_distribution,
    output_kl,
    output_kls,
)
from cactus_edge.rules.sampling import SparseProbs, sample_token, to_dense

N_TRIALS = 20_000
ALPHA = 1e-3


def random_pair(rng, vocab_size=8, sparse=False, support=5, concentration=0.4):
    """A (draft row, target row) pair of peaked, disagreeing rows (so rejections are common);
    sparse rows have overlapping but unequal top-k-like supports."""
    if not sparse:
        draft = rng.dirichlet(np.ones(vocab_size) * concentration)
        target = rng.dirichlet(np.ones(vocab_size) * concentration)
        return draft, target
    draft_ids = np.sort(rng.choice(vocab_size, support, replace=False))
    shared = rng.choice(draft_ids, support // 2, replace=False)
    others = rng.choice(np.setdiff1d(np.arange(vocab_size), shared), support - len(shared), replace=False)
    target_ids = np.sort(np.concatenate([shared, others]))
    draft = SparseProbs(draft_ids, rng.dirichlet(np.ones(support) * concentration), vocab_size)
    target = SparseProbs(target_ids, rng.dirichlet(np.ones(support) * concentration), vocab_size)
    return draft, target


def stack(rows):
    if isinstance(rows[0], SparseProbs):
        return SparseProbs(
            np.stack([r.token_ids for r in rows]), np.stack([r.probs for r in rows]), rows[0].vocab_size
        )
    return np.stack(rows)


def emitted_first_tokens(rule, draft_row, target_row, n_trials, seed):
    """Empirical first emitted token of k=1 blocks whose draft token is drawn from draft_row."""
    rng = np.random.default_rng(seed)
    draft_probs = stack([draft_row])
    target_probs = stack([target_row, target_row])
    vocab_size = target_row.shape[-1]
    counts = np.zeros(vocab_size, dtype=np.int64)
    for _ in range(n_trials):
        token = sample_token(draft_row, rng)
        verdict = rule.verify(np.array([token]), draft_probs, target_probs, rng)
        counts[token if verdict.n_accepted == 1 else verdict.next_token] += 1
    return counts


def chi_square_pvalue(counts, expected_probs):
    """Chi-square p-value; cells with expected count < 5 are pooled. Mass observed where the
    model says 0 is an outright failure (p = 0)."""
    expected = np.asarray(expected_probs, dtype=np.float64) * counts.sum()
    if np.any(counts[expected == 0] > 0):
        return 0.0
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    if len(observed) < 2:
        return 1.0
    return float(stats.chisquare(observed, expected).pvalue)


class WrongResidualSpS(SpeculativeSampling):
    """A classic bug: on rejection sample the target row itself instead of max(0, q − p)."""

    def rejection_dist(self, token, draft, target, vocab_size):
        return target


class CactusSwappedResidual(Cactus):
    """A slip of argument order: on rejection sample normalize(max(0, p − h)) instead of h − p."""

    def rejection_dist(self, token, draft, target, vocab_size):
        return _residual(draft, self.modified_target(token, target), vocab_size)


RULES = [
    SpeculativeSampling(),
    Cactus(0.05),
    Cactus(0.25),
    Cactus(1.0),
    TypicalAcceptance(),
    ExactMatch(),
]


@pytest.mark.statistical
@pytest.mark.parametrize("rule", RULES, ids=repr)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_empirical_output_matches_oracle(rule, sparse):
    rng = np.random.default_rng(1234 + sparse)
    draft_row, target_row = random_pair(rng, vocab_size=12, sparse=sparse)
    expected = to_dense(output_distribution(rule, draft_row, target_row))
    counts = emitted_first_tokens(rule, draft_row, target_row, N_TRIALS, seed=5)
    assert chi_square_pvalue(counts, expected) > ALPHA, (rule, counts, expected)


@pytest.mark.parametrize(
    ("broken", "oracle_rule"),
    [(WrongResidualSpS(), SpeculativeSampling()), (CactusSwappedResidual(0.25), Cactus(0.25))],
    ids=["sps-wrong-residual", "cactus-swapped-residual"],
)
@pytest.mark.statistical
def test_the_same_test_catches_a_broken_rule(broken, oracle_rule):
    rng = np.random.default_rng(99)
    draft_row, target_row = random_pair(rng, vocab_size=12)
    expected = to_dense(output_distribution(oracle_rule, draft_row, target_row))
    counts = emitted_first_tokens(broken, draft_row, target_row, N_TRIALS, seed=7)
    assert chi_square_pvalue(counts, expected) < ALPHA


@pytest.mark.statistical
@pytest.mark.parametrize("rule", [SpeculativeSampling(), ExactMatch(), Cactus(0.0)], ids=repr)
def test_lossless_rules_reproduce_the_target(rule):
    rng = np.random.default_rng(5)
    draft_row, target_row = random_pair(rng, vocab_size=10)
    np.testing.assert_allclose(output_distribution(rule, draft_row, target_row), target_row, atol=1e-12)
    counts = emitted_first_tokens(rule, draft_row, target_row, N_TRIALS, seed=3)
    assert chi_square_pvalue(counts, target_row) > ALPHA
    # ...and a lossy rule on the same pair is told apart from the target by the same test.
    lossy_counts = emitted_first_tokens(Cactus(4.0), draft_row, target_row, N_TRIALS, seed=3)
    assert chi_square_pvalue(lossy_counts, target_row) < ALPHA


@pytest.mark.statistical
def test_two_positions_and_bonus_follow_the_target_under_sps():
    """Joint law of the first two emitted tokens with k = 2 (fixed rows): q0 ⊗ q1 under SpS."""
    rng = np.random.default_rng(11)
    vocab_size = 5
    drafts = [rng.dirichlet(np.ones(vocab_size)) for _ in range(2)]
    targets = [rng.dirichlet(np.ones(vocab_size)) for _ in range(3)]
    draft_probs, target_probs = np.stack(drafts), np.stack(targets)
    rule = SpeculativeSampling()
    counts = np.zeros((vocab_size, vocab_size), dtype=np.int64)
    for _ in range(N_TRIALS):
        tokens = np.array([sample_token(row, rng) for row in drafts])
        verdict = rule.verify(tokens, draft_probs, target_probs, rng)
        emitted = [*tokens[: verdict.n_accepted], verdict.next_token]
        if len(emitted) >= 2:
            counts[emitted[0], emitted[1]] += 1
        else:  # rejected at position 0: the second token would come from the next step's q1
            counts[emitted[0], sample_token(targets[1], rng)] += 1
    expected = np.outer(targets[0], targets[1]).ravel()
    assert chi_square_pvalue(counts.ravel(), expected) > ALPHA


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_bonus_token_follows_last_target_row_when_all_accepted(rule):
    rng = np.random.default_rng(21)
    vocab_size = 6
    sure = np.eye(vocab_size)[2]  # draft and target agree with certainty: always accepted
    bonus_row = rng.dirichlet(np.ones(vocab_size))
    draft_probs = np.stack([sure, sure])
    target_probs = np.stack([sure, sure, bonus_row])
    bonus = np.zeros(vocab_size, dtype=np.int64)
    for _ in range(N_TRIALS):
        verdict = rule.verify(np.array([2, 2]), draft_probs, target_probs, rng)
        assert verdict.n_accepted == 2
        bonus[verdict.next_token] += 1
    assert chi_square_pvalue(bonus, bonus_row) > ALPHA
    assert chi_square_pvalue(bonus, np.roll(bonus_row, 1)) < ALPHA


def test_cactus_delta_zero_gives_the_same_verdicts_as_sps():
    rng = np.random.default_rng(3)
    for trial in range(300):
        sparse = trial % 2 == 0
        pairs = [random_pair(rng, vocab_size=30, sparse=sparse, support=8) for _ in range(4)]
        draft_probs = stack([d for d, _ in pairs])
        target_probs = stack([t for _, t in pairs] + [pairs[0][1]])
        tokens = np.array([sample_token(d, rng) for d, _ in pairs])
        sps = SpeculativeSampling().verify(tokens, draft_probs, target_probs, np.random.default_rng(trial))
        cactus = Cactus(0.0).verify(tokens, draft_probs, target_probs, np.random.default_rng(trial))
        assert sps == cactus


def test_acceptance_is_non_decreasing_in_delta():
    rng = np.random.default_rng(8)
    deltas = [0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 8.0]
    for _ in range(200):
        draft_row, target_row = random_pair(rng, vocab_size=10)
        acceptance = [
            float(
                sum(
                    draft_row[n] * min(1.0, Cactus(delta).raised_prob(target_row[n]) / draft_row[n])
                    for n in range(10)
                )
            )
            for delta in deltas
        ]
        assert all(b >= a - 1e-12 for a, b in zip(acceptance, acceptance[1:], strict=False))
        # The oracle agrees: the probability of emitting the drafted token is the acceptance.
        assert acceptance[-1] >= acceptance[0]


@pytest.mark.parametrize("delta", [0.1, 0.5, 1.0, 3.0])
def test_kl_of_output_is_at_most_kl_of_draft(delta):
    rng = np.random.default_rng(13)
    rule = Cactus(delta)
    for _ in range(200):
        draft_row, target_row = random_pair(rng, vocab_size=10)
        out = output_distribution(rule, draft_row, target_row)
        assert kl_divergence(out, target_row) <= kl_divergence(draft_row, target_row) + 1e-12
        assert output_kl(rule, draft_row, target_row) == pytest.approx(kl_divergence(out, target_row))


def test_output_is_draft_when_every_draft_token_is_accepted():
    # h(n) >= p(n) for every n in supp(p): every a_n = 1, so out = p exactly.
    target_row = np.array([0.4, 0.3, 0.2, 0.1])
    draft_row = np.array([0.5, 0.5, 0.0, 0.0])
    rule = Cactus(1.0)
    assert all(rule.raised_prob(target_row[n]) >= draft_row[n] for n in (0, 1))
    np.testing.assert_allclose(output_distribution(rule, draft_row, target_row), draft_row, atol=1e-12)


@pytest.mark.parametrize("delta", [0.01, 0.1, 0.5, 1.0])
def test_per_step_kl_of_h_is_within_delta_when_h_is_small(delta):
    rng = np.random.default_rng(17)
    rule = Cactus(delta)
    checked = 0
    for _ in range(500):
        target_row = rng.dirichlet(np.ones(12) * 0.5)
        token = int(rng.integers(12))
        if target_row[token] == 0 or rule.raised_prob(target_row[token]) > 0.5:
            continue
        h = rule.modified_target(token, _Dist(None, target_row)).probs
        assert abs(h.sum() - 1) < 1e-12
        assert kl_divergence(h, target_row) <= delta + 1e-12
        checked += 1
    assert checked > 100


def test_delta_zero_oracle_is_the_target_and_lossy_kl_is_positive():
    rng = np.random.default_rng(2)
    draft_row, target_row = random_pair(rng, vocab_size=10)
    np.testing.assert_allclose(output_distribution(Cactus(0.0), draft_row, target_row), target_row)
    assert output_kl(Cactus(1.0), draft_row, target_row) > 0
    assert output_kl(SpeculativeSampling(), draft_row, target_row) == 0


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_greedy_rows_reduce_every_rule_to_exact_match(rule):
    rng = np.random.default_rng(4)
    vocab_size, n_draft = 7, 5
    for _ in range(100):
        draft_tokens = rng.integers(vocab_size, size=n_draft)
        target_argmax = np.where(
            rng.random(n_draft + 1) < 0.7,
            np.append(draft_tokens, 0),
            rng.integers(vocab_size, size=n_draft + 1),
        )
        draft_probs = np.eye(vocab_size)[draft_tokens]
        target_probs = np.eye(vocab_size)[target_argmax]
        verdict = rule.verify(draft_tokens, draft_probs, target_probs, rng)
        mismatches = np.flatnonzero(draft_tokens != target_argmax[:n_draft])
        expected_n = int(mismatches[0]) if mismatches.size else n_draft
        assert verdict.n_accepted == expected_n
        assert verdict.next_token == target_argmax[expected_n]


@pytest.mark.statistical
def test_point_mass_draft_accepts_with_target_or_raised_probability():
    """A prompt-lookup proposal is a one-entry sparse row: SpS accepts with q(d), Cactus with h(d)."""
    vocab_size = 9
    target_row = SparseProbs(np.array([1, 4, 6]), np.array([0.2, 0.5, 0.3]), vocab_size)
    lookup_row = SparseProbs(np.array([4]), np.array([1.0]), vocab_size)
    for rule, accept in [(SpeculativeSampling(), 0.5), (Cactus(1.0), Cactus(1.0).raised_prob(0.5))]:
        out = to_dense(output_distribution(rule, lookup_row, target_row))
        assert out[4] == pytest.approx(accept)
        counts = emitted_first_tokens(rule, lookup_row, target_row, N_TRIALS, seed=1)
        assert chi_square_pvalue(counts, out) > ALPHA
    np.testing.assert_allclose(
        to_dense(output_distribution(SpeculativeSampling(), lookup_row, target_row)), to_dense(target_row)
    )


@pytest.mark.parametrize("delta", [-0.1, float("nan"), float("inf"), "1"])
def test_invalid_delta_raises(delta):
    with pytest.raises(ValueError, match="delta"):
        Cactus(delta)


def test_zero_probability_draft_token_is_refused():
    draft_probs = np.array([[0.5, 0.5, 0.0]])
    target_probs = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="zero draft probability"):
        SpeculativeSampling().verify(np.array([2]), draft_probs, target_probs, np.random.default_rng())


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="k\\+1"):
        SpeculativeSampling().verify(
            np.array([0]), np.ones((1, 3)) / 3, np.ones((1, 3)) / 3, np.random.default_rng()
        )
    with pytest.raises(ValueError, match="method"):
        make_rule("medusa")


@st.composite
def blocks(draw):
    vocab_size = draw(st.integers(2, 40))
    n_draft = draw(st.integers(0, 6))
    sparse = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    concentration = draw(st.sampled_from([0.05, 0.5, 5.0]))

    def row():
        if sparse:
            support = int(rng.integers(1, vocab_size + 1))
            ids = np.sort(rng.choice(vocab_size, support, replace=False))
            return SparseProbs(ids, rng.dirichlet(np.ones(support) * concentration), vocab_size)
        return rng.dirichlet(np.ones(vocab_size) * concentration)

    drafts = [row() for _ in range(n_draft)]
    targets = [row() for _ in range(n_draft + 1)]
    rule = draw(st.sampled_from(["cactus", "sps", "tas", "exact"]))
    delta = draw(st.floats(0, 10))
    return vocab_size, drafts, targets, make_rule(rule, delta), rng


def stack_rows(rows, vocab_size):
    """Dense rows stack as they are; sparse rows of different support sizes are padded with
    unused ids at probability 0 (how top-p leaves them)."""
    if not rows:
        return np.zeros((0, vocab_size))
    if not isinstance(rows[0], SparseProbs):
        return np.stack(rows)
    width = max(len(r.token_ids) for r in rows)
    ids, probs = [], []
    for r in rows:
        unused = np.setdiff1d(np.arange(vocab_size), r.token_ids)[: width - len(r.token_ids)]
        ids.append(np.concatenate([r.token_ids, unused]))
        probs.append(np.concatenate([r.probs, np.zeros(len(unused))]))
    return SparseProbs(np.stack(ids), np.stack(probs), vocab_size)


@settings(max_examples=300, deadline=None)
@given(blocks())
def test_property_valid_inputs_give_valid_verdicts_and_distributions(block):
    vocab_size, drafts, targets, rule, rng = block
    tokens = np.array([sample_token(d, rng) for d in drafts], dtype=np.int64)
    verdict = rule.verify(tokens, stack_rows(drafts, vocab_size), stack_rows(targets, vocab_size), rng)
    assert 0 <= verdict.n_accepted <= len(drafts)
    assert 0 <= verdict.next_token < vocab_size
    # Every rule emits a token the target allows at that position (residual, argmax or bonus).
    assert to_dense(targets[verdict.n_accepted])[verdict.next_token] > 0
    for draft_row, target_row in zip(drafts, targets, strict=False):
        out = to_dense(output_distribution(rule, draft_row, target_row))
        assert np.all(out >= 0)
        assert math.isclose(out.sum(), 1.0, abs_tol=1e-6)


@pytest.mark.parametrize(
    "rule",
    [Cactus(0.5), Cactus(1.0), Cactus(3.0), TypicalAcceptance(), TypicalAcceptance(0.3, 0.1)],
    ids=repr,
)
def test_vectorized_output_kl_equals_the_per_token_oracle(rule):
    # output_kl's matrix form (used per step by the engine and the KL budget) against the oracle
    # loop of output_distribution, on sparse rows like the engine's: top-k, top-p, partial overlap.
    from cactus_edge.rules.sampling import SamplingConfig, process_logits

    rng = np.random.default_rng(7)
    for _ in range(150):
        logits = rng.standard_normal((2, 500)).astype(np.float32) * rng.uniform(0.5, 4)
        logits[1] = logits[0] + rng.standard_normal(500).astype(np.float32) * rng.uniform(0, 2)
        config = SamplingConfig(
            temperature=rng.uniform(0.3, 1.5), top_k=int(rng.integers(1, 40)), top_p=rng.uniform(0.5, 1.0)
        )
        draft_probs, target_probs = process_logits(logits, config)
        oracle = kl_divergence(output_distribution(rule, draft_probs, target_probs), target_probs)
        assert output_kl(rule, draft_probs, target_probs) == pytest.approx(oracle, abs=1e-12)


@pytest.mark.statistical
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_acceptance_rate_is_the_accepted_share_of_one_token_blocks(rule, sparse):
    """The exact per-position acceptance rate against the share of k = 1 blocks `verify`
    accepts (binomial test), and SpS's closed form Σ min(p, q)."""
    draft_row, target_row = random_pair(np.random.default_rng(11), sparse=sparse)
    rate = acceptance_rate(rule, draft_row, target_row)
    rng = np.random.default_rng(12)
    draft_probs, target_probs = stack([draft_row]), stack([target_row, target_row])
    accepted = sum(
        rule.verify(np.array([sample_token(draft_row, rng)]), draft_probs, target_probs, rng).n_accepted
        for _ in range(4000)
    )
    assert stats.binomtest(accepted, 4000, rate).pvalue > ALPHA
    if type(rule) is SpeculativeSampling:
        assert rate == pytest.approx(np.minimum(to_dense(draft_row), to_dense(target_row)).sum())


@pytest.mark.parametrize(
    "rule", [Cactus(0.5), Cactus(2.0), TypicalAcceptance(), TypicalAcceptance(0.3, 0.1)], ids=repr
)
def test_output_kls_of_a_whole_step_equal_the_oracle_position_by_position(rule):
    # The engine measures all positions of a step at once: rows of different widths (model drafts
    # with top-p padding, one-token lookup drafts, drafts the target never proposes) share one
    # padded matrix computation, which must not leak between positions.
    from cactus_edge.rules.sampling import SamplingConfig, process_logits

    rng = np.random.default_rng(11)
    for _ in range(60):
        n_positions = int(rng.integers(1, 7))
        config = SamplingConfig(temperature=rng.uniform(0.3, 1.5), top_k=int(rng.integers(2, 30)), top_p=0.9)
        logits = rng.standard_normal((2 * n_positions, 300)).astype(np.float32) * rng.uniform(0.5, 4)
        target_rows = process_logits(logits[:n_positions], config)
        drafts = []
        for position, row in enumerate(process_logits(logits[n_positions:], config)):
            if rng.random() < 0.3:  # a lookup draft: a point mass, inside or outside the target's top-k
                token = int(rng.choice([target_rows[position].token_ids[0], rng.integers(0, 300)]))
                row = SparseProbs(np.array([token]), np.ones(1), 300)
            drafts.append(row)
        targets = [target_rows[i] for i in range(n_positions)]
        oracle = [
            kl_divergence(output_distribution(rule, d, t), t) for d, t in zip(drafts, targets, strict=True)
        ]
        np.testing.assert_allclose(output_kls(rule, drafts, targets), oracle, rtol=0, atol=1e-12)


def test_output_kls_works_on_supports_not_on_stored_widths():
    # top-k 1,000 with a tight top-p stores 1,000 entries per row, nearly all of them zero: the
    # shared columns (and the (n, m, m) law) must be as wide as the supports, not the rows.
    from cactus_edge.rules.acceptance import _shared_columns
    from cactus_edge.rules.sampling import SamplingConfig, process_logits

    logits = np.random.default_rng(5).standard_normal((6, 2000)).astype(np.float32) * 3
    rows = process_logits(logits, SamplingConfig(temperature=0.7, top_k=1000, top_p=0.5))
    drafts, targets = [rows[i] for i in range(3)], [rows[i] for i in range(3, 6)]
    assert drafts[0].token_ids.size == 1000
    widest = max(np.count_nonzero(d.probs) for d in drafts) + max(np.count_nonzero(t.probs) for t in targets)
    draft_on, target_on = _shared_columns(list(zip(drafts, targets, strict=True)))
    assert draft_on.shape[1] == target_on.shape[1] <= widest < 200
    oracle = [
        kl_divergence(output_distribution(Cactus(1.0), d, t), t) for d, t in zip(drafts, targets, strict=True)
    ]
    np.testing.assert_allclose(output_kls(Cactus(1.0), drafts, targets), oracle, rtol=0, atol=1e-12)


def test_typical_acceptance_ties_at_the_threshold_are_decided_as_judge_decides_them():
    # A uniform q with alpha = 1: q(d) = 1/m and the threshold alpha·exp(−H) = exp(−log m) agree
    # up to rounding, so the batched law must round exactly as the rule's own threshold does (an
    # entropy summed over the padded columns, 10 draft ids outside q here, flips m = 9, 10, 12, 18).
    rule = TypicalAcceptance(posterior_threshold=1.0, posterior_alpha=1.0)
    draft_ids = np.concatenate([[0, 1], np.arange(40, 50)])
    draft_row = SparseProbs(draft_ids, np.full(draft_ids.size, 1.0 / draft_ids.size), 50)
    for size in (9, 10, 12, 18):
        target_row = SparseProbs(np.arange(size), np.full(size, 1.0 / size), 50)
        oracle = kl_divergence(output_distribution(rule, draft_row, target_row), target_row)
        assert output_kls(rule, [draft_row], [target_row])[0] == pytest.approx(oracle, abs=1e-12)
