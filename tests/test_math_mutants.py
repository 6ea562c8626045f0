"""Tests written to kill the mutants mutation testing (mutmut) left alive in the math modules:
acceptance.py (rules, oracle, KL budget), sampling.py (processing) and penalties.py.

Every expectation is independent of cactus_edge: tests/reference_rules.py (written from the
formulas, never importing the package), literals with their arithmetic in a comment, or properties
with a real threshold. See docs/development.md ("Mutation testing") for how to run mutmut.
"""

import math

import numpy as np
import pytest

from cactus_edge.constraints.penalties import Penalties, apply_bias, apply_penalties, repeat_window
from cactus_edge.errors import NonFiniteLogitsError
from cactus_edge.rules.acceptance import (
    MAX_KL_SUPPORT,
    AcceptanceRule,
    Cactus,
    ExactMatch,
    KLBudgetRule,
    SpeculativeSampling,
    TypicalAcceptance,
    kl_divergence,
    kl_is_measurable,
    make_rule,
    output_distribution,
    output_kl,
    output_kls,
    step_kl,
)
from cactus_edge.rules.sampling import (
    SamplingConfig,
    SparseProbs,
    fit_logits_to_vocab,
    has_candidate_path,
    process_candidates,
    process_logits,
    row_prob,
    row_support,
    sample_token,
    to_dense,
    top_k_logits,
    widen_row,
)

from . import reference_rules as ref

# --- penalties and bias ----------------------------------------------------------------------


def test_bias_adds_at_its_ids_and_skips_ids_past_the_row():
    logits = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    apply_bias(logits, np.array([1, 7, 3, 5]), np.array([2.0, 9.0, -1.5, 4.0]))
    # ids 7 and 5 lie past a 5-entry row (a draft's smaller vocabulary): skipped.
    np.testing.assert_array_equal(logits, [0.0, 3.0, 2.0, 1.5, 4.0])


def test_penalties_match_the_reference_on_positive_negative_and_repeated_tokens():
    logits = np.array([2.0, -1.0, 0.5, -3.0, 4.0, 1.0])
    window = np.array([0, 1, 1, 4, 3])
    generated = np.array([4, 4, 4, 2, 1])
    penalties = Penalties(repeat_penalty=1.5, repeat_last_n=5, frequency_penalty=0.25, presence_penalty=0.5)
    shaped = logits.copy()
    apply_penalties(shaped, window, generated, penalties)
    expected = ref.shaped_logits(
        logits,
        window=window.tolist(),
        generated=generated.tolist(),
        repeat_penalty=1.5,
        frequency=0.25,
        presence=0.5,
    )
    np.testing.assert_allclose(shaped, expected, rtol=1e-15)
    # By hand: id 0: 2 / 1.5; id 1: −1 · 1.5 − (1·0.25 + 0.5); id 2: 0.5 − 0.75; id 3: −3 · 1.5;
    # id 4: 4 / 1.5 − (3·0.25 + 0.5) = 8/3 − 1.25; id 5 untouched.
    np.testing.assert_allclose(shaped, [4 / 3, -2.25, -0.25, -4.5, 8 / 3 - 1.25, 1.0], rtol=1e-15)


def test_penalties_skip_ids_past_the_row():
    logits = np.array([2.0, -2.0, 1.0])
    penalties = Penalties(repeat_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    apply_penalties(logits, np.array([0, 5, 9]), np.array([1, 1, 8, 8, 8]), penalties)
    # id 0: 2 / 2 = 1; id 1: −2 − (2·1 + 0.5) = −4.5; ids 5, 8, 9 are outside a 3-entry row.
    np.testing.assert_array_equal(logits, [1.0, -4.5, 1.0])


@pytest.mark.parametrize(
    ("penalties", "active"),
    [
        (Penalties(), False),
        (Penalties(repeat_penalty=1.1), True),
        (Penalties(repeat_penalty=1.1, repeat_last_n=0), False),
        (Penalties(repeat_penalty=1.1, repeat_last_n=-1), True),
        (Penalties(repeat_last_n=0), False),
        (Penalties(frequency_penalty=0.2), True),
        (Penalties(presence_penalty=-0.2), True),
        (Penalties(repeat_last_n=0, presence_penalty=0.2), True),
    ],
)
def test_penalties_are_active_exactly_when_one_of_them_changes_a_logit(penalties, active):
    assert penalties.active is active


def test_each_penalty_alone_changes_only_what_it_names():
    logits = np.array([3.0, -3.0, 1.0])
    only_presence = logits.copy()
    apply_penalties(only_presence, np.array([0, 1]), np.array([2, 2]), Penalties(presence_penalty=0.5))
    np.testing.assert_array_equal(only_presence, [3.0, -3.0, 0.5])  # repeat off: window ignored
    only_frequency = logits.copy()
    apply_penalties(only_frequency, np.array([0]), np.array([2, 2]), Penalties(frequency_penalty=0.5))
    np.testing.assert_array_equal(only_frequency, [3.0, -3.0, 0.0])  # 1 − 2·0.5
    only_repeat = logits.copy()
    apply_penalties(only_repeat, np.array([0, 1]), np.array([2]), Penalties(repeat_penalty=3.0))
    np.testing.assert_array_equal(only_repeat, [1.0, -9.0, 1.0])  # 3 / 3, −3 · 3


def test_the_repeat_window_is_the_last_n_tokens_before_the_predicted_index():
    context = [10, 11, 12, 13, 14, 15]
    assert repeat_window(context, 5, 3) == [12, 13, 14]  # context[2:5]
    assert repeat_window(context, 2, 3) == [10, 11]  # start clamps at 0
    assert repeat_window(context, 4, -1) == [10, 11, 12, 13]  # −1: the whole context before 4
    assert repeat_window(context, 4, 0) == []
    assert repeat_window(context, 6, 6) == context
    assert repeat_window(tuple(context), 3, 1) == (12,)


# --- the KL budget's decision -----------------------------------------------------------------

# A lookup draft (a point mass on token 0) against a sparse target row: measurable KL.
BUDGET_DRAFT = SparseProbs(np.array([0]), np.array([1.0]), 6)
BUDGET_TARGET = SparseProbs(np.array([0, 2, 5]), np.array([0.3, 0.5, 0.2]), 6)
BUDGET_DELTA = 1.0


def _reference_position_kl() -> float:
    law = ref.law_for("cactus", delta=BUDGET_DELTA)
    out = ref.output_law(law, BUDGET_DRAFT, BUDGET_TARGET)
    return ref.kl(out, BUDGET_TARGET)


def _one_position(rule: KLBudgetRule, seed: int = 0):
    """Verify a block of one drafted token (token 0); one position is always judged."""
    targets = SparseProbs(
        np.stack([BUDGET_TARGET.token_ids, BUDGET_TARGET.token_ids]),
        np.stack([BUDGET_TARGET.probs, BUDGET_TARGET.probs]),
        6,
    )
    drafts = SparseProbs(BUDGET_DRAFT.token_ids[None], BUDGET_DRAFT.probs[None], 6)
    return rule.verify(np.array([0]), drafts, targets, np.random.default_rng(seed))


# Point-mass draft: the lossy rule accepts with h(0) = 0.3 + √(2·0.3·0.7) = 0.948074…, SpS with q(0).
LOSSY_ACCEPT = ref.cactus_raised(0.3, BUDGET_DELTA)
LOSSLESS_ACCEPT = 0.3


def test_the_budget_spends_the_reference_kl_per_lossy_position_then_falls_back_to_sps():
    kl = _reference_position_kl()
    assert kl > 0.01  # a position that costs something
    rule = KLBudgetRule(Cactus(BUDGET_DELTA), budget=2.5 * kl)
    for n_spent in (1, 2):
        verdict = _one_position(rule)
        assert verdict.acceptance_probs == pytest.approx((LOSSY_ACCEPT,), rel=1e-12)
        assert rule.position_kls == pytest.approx((kl,), rel=1e-9)
        assert rule.spent == pytest.approx(n_spent * kl, rel=1e-9)
    # 3·kl > 2.5·kl: SpS from here on, spending nothing, even for a cheaper position later.
    for _ in range(2):
        verdict = _one_position(rule)
        assert verdict.acceptance_probs == pytest.approx((LOSSLESS_ACCEPT,), rel=1e-12)
        assert rule.position_kls == (0.0,)
        assert rule.spent == pytest.approx(2 * kl, rel=1e-9)
    assert rule.exhausted


def test_a_position_that_lands_exactly_on_the_budget_is_still_lossy():
    rule = KLBudgetRule(Cactus(BUDGET_DELTA), budget=1.0)
    _one_position(rule)
    kl = rule.position_kls[0]
    exact = KLBudgetRule(Cactus(BUDGET_DELTA), budget=2 * kl)  # kl + kl == 2·kl exactly in floats
    _one_position(exact)
    verdict = _one_position(exact)
    assert verdict.acceptance_probs == pytest.approx((LOSSY_ACCEPT,), rel=1e-12)
    assert exact.spent == 2 * kl
    assert not exact.exhausted


def test_a_zero_budget_is_sps_and_spends_nothing():
    rule = KLBudgetRule(Cactus(BUDGET_DELTA), budget=0.0)
    verdict = _one_position(rule)
    assert verdict.acceptance_probs == pytest.approx((LOSSLESS_ACCEPT,), rel=1e-12)
    assert rule.position_kls == (0.0,)
    assert rule.spent == 0.0
    assert rule.exhausted


def test_an_unmeasurable_position_is_sps_for_free_and_later_positions_stay_lossy():
    kl = _reference_position_kl()
    rule = KLBudgetRule(Cactus(BUDGET_DELTA), budget=1.5 * kl)
    dense_draft = np.array([[1.0, 0, 0, 0, 0, 0]])
    dense_target = np.tile(BUDGET_TARGET.to_dense(), (2, 1))
    verdict = rule.verify(np.array([0]), dense_draft, dense_target, np.random.default_rng(0))
    assert verdict.acceptance_probs == pytest.approx((LOSSLESS_ACCEPT,), rel=1e-12)
    assert rule.position_kls == (0.0,)
    assert rule.spent == 0.0
    assert not rule.exhausted
    verdict = _one_position(rule)
    assert verdict.acceptance_probs == pytest.approx((LOSSY_ACCEPT,), rel=1e-12)
    assert rule.spent == pytest.approx(kl, rel=1e-9)


def test_a_lossless_rule_under_a_budget_never_spends():
    rule = KLBudgetRule(SpeculativeSampling(), budget=1.0)
    assert rule.lossless and rule.exhausted
    _one_position(rule)
    assert rule.spent == 0.0


@pytest.mark.parametrize("budget", [-0.1, math.nan, "1"])
def test_a_budget_must_be_a_number_at_least_zero(budget):
    with pytest.raises(ValueError, match="kl_budget"):
        KLBudgetRule(Cactus(1.0), budget)


def test_the_budget_judges_several_positions_with_their_own_kls():
    # Two positions with different targets; a budget that covers both KLs, so both are lossy.
    second_target = SparseProbs(np.array([0, 1]), np.array([0.6, 0.4]), 6)
    law = ref.law_for("cactus", delta=BUDGET_DELTA)
    kls = [
        ref.kl(ref.output_law(law, BUDGET_DRAFT, target), target) for target in (BUDGET_TARGET, second_target)
    ]
    rule = KLBudgetRule(Cactus(BUDGET_DELTA), budget=sum(kls) * 1.001)
    drafts = [BUDGET_DRAFT, BUDGET_DRAFT]
    targets = [BUDGET_TARGET, second_target, second_target]
    # Find a seed whose block accepts the first position, so both positions are judged.
    for seed in range(50):
        rule.spent, rule.exhausted = 0.0, False
        verdict = rule.verify(np.array([0, 0]), drafts, targets, np.random.default_rng(seed))
        if verdict.n_accepted >= 1:
            break
    assert verdict.n_accepted >= 1
    assert rule.position_kls == pytest.approx(tuple(kls), rel=1e-9)
    assert verdict.acceptance_probs == pytest.approx(
        (ref.cactus_raised(0.3, BUDGET_DELTA), ref.cactus_raised(0.6, BUDGET_DELTA)), rel=1e-12
    )


def test_typical_acceptance_under_a_budget_spends_its_reference_kl():
    law = ref.law_for("tas", posterior_threshold=0.09, posterior_alpha=0.3)
    draft = SparseProbs(np.array([0, 5]), np.array([0.5, 0.5]), 6)
    kl = ref.kl(ref.output_law(law, draft, BUDGET_TARGET), BUDGET_TARGET)
    assert kl > 0.01
    rule = KLBudgetRule(TypicalAcceptance(), budget=10.0)
    rule.verify(np.array([5]), [draft], [BUDGET_TARGET, BUDGET_TARGET], np.random.default_rng(0))
    assert rule.position_kls == pytest.approx((kl,), rel=1e-9)


# --- step_kl and what is measurable ---------------------------------------------------------------


def test_step_kl_is_the_mean_reference_kl_over_the_decided_positions():
    second_target = SparseProbs(np.array([0, 1]), np.array([0.6, 0.4]), 6)
    law = ref.law_for("cactus", delta=0.5)
    kls = [ref.kl(ref.output_law(law, BUDGET_DRAFT, t), t) for t in (BUDGET_TARGET, second_target)]
    drafts = [BUDGET_DRAFT, BUDGET_DRAFT, BUDGET_DRAFT]
    targets = [BUDGET_TARGET, second_target, BUDGET_TARGET, BUDGET_TARGET]
    assert step_kl(Cactus(0.5), drafts, targets, 2) == pytest.approx((kls[0] + kls[1]) / 2, rel=1e-9)
    assert step_kl(Cactus(0.5), drafts, targets, 1) == pytest.approx(kls[0], rel=1e-9)
    assert step_kl(Cactus(0.5), drafts, targets, 0) is None  # nothing decided: nothing to report
    assert step_kl(SpeculativeSampling(), drafts, targets, 2) == 0.0
    assert step_kl(Cactus(0.0), drafts, targets, 2) == 0.0  # δ = 0 is lossless
    dense = [BUDGET_TARGET.to_dense()] * 4
    assert step_kl(Cactus(0.5), drafts, dense, 2) is None  # a dense row is not measured


def test_step_kl_of_a_budget_is_the_mean_of_the_kls_it_measured():
    kl = _reference_position_kl()
    rule = KLBudgetRule(Cactus(BUDGET_DELTA), budget=10.0)
    assert step_kl(rule, [], [], 0) is None  # before any verify
    _one_position(rule)
    assert step_kl(rule, [BUDGET_DRAFT], [BUDGET_TARGET], 1) == pytest.approx(kl, rel=1e-9)


def _sparse_row(n_positive: int, n_zero: int = 0) -> SparseProbs:
    probs = np.concatenate([np.full(n_positive, 1.0 / n_positive), np.zeros(n_zero)])
    return SparseProbs(np.arange(n_positive + n_zero), probs, 1000)


def test_kl_is_measurable_up_to_max_kl_support_positive_entries_of_sparse_rows():
    assert MAX_KL_SUPPORT == 256
    small = _sparse_row(3)
    assert kl_is_measurable(_sparse_row(256), small)
    assert kl_is_measurable(small, _sparse_row(256))
    assert not kl_is_measurable(_sparse_row(257), small)
    assert not kl_is_measurable(small, _sparse_row(257))
    assert kl_is_measurable(_sparse_row(200, n_zero=300), small)  # zero padding is not support
    assert not kl_is_measurable(small.to_dense(), small)
    assert not kl_is_measurable(small, small.to_dense())


# --- rows over two vocabularies, and which processing path applies -------------------------------


def test_fit_logits_to_vocab_drops_the_ids_the_target_lacks():
    logits = np.arange(12.0).reshape(2, 6)
    np.testing.assert_array_equal(fit_logits_to_vocab(logits, 4), [[0, 1, 2, 3], [6, 7, 8, 9]])
    assert fit_logits_to_vocab(logits, 6).shape == (2, 6)
    assert fit_logits_to_vocab(logits, 9).shape == (2, 6)  # a larger target: nothing to drop
    np.testing.assert_array_equal(fit_logits_to_vocab(np.arange(5.0), 3), [0, 1, 2])


def test_widen_row_gives_the_missing_ids_probability_zero():
    np.testing.assert_array_equal(widen_row(np.array([0.25, 0.75]), 4), [0.25, 0.75, 0.0, 0.0])
    np.testing.assert_array_equal(widen_row(np.array([0.25, 0.75]), 2), [0.25, 0.75])
    sparse = SparseProbs(np.array([1, 0]), np.array([0.6, 0.4]), 3)
    wide = widen_row(sparse, 5)
    assert wide.vocab_size == 5
    np.testing.assert_array_equal(wide.to_dense(), [0.4, 0.6, 0.0, 0.0, 0.0])
    assert widen_row(sparse, 3).vocab_size == 3


@pytest.mark.parametrize(
    ("config", "vocab_size", "expected"),
    [
        (SamplingConfig(temperature=0.0, top_k=0), 10, True),  # greedy
        (SamplingConfig(top_k=5), 10, True),
        (SamplingConfig(top_k=9), 10, True),
        (SamplingConfig(top_k=10), 10, False),  # top-k keeps the whole row: off
        (SamplingConfig(top_k=0), 10, False),
    ],
)
def test_the_candidate_path_applies_when_greedy_or_top_k_cuts_the_row(config, vocab_size, expected):
    assert has_candidate_path(config, vocab_size) is expected


def test_row_prob_finds_a_token_anywhere_in_a_sparse_row():
    row = SparseProbs(np.array([7, 2, 4]), np.array([0.5, 0.3, 0.2]), 9)
    assert row_prob(row, 7) == 0.5
    assert row_prob(row, 2) == 0.3
    assert row_prob(row, 4) == 0.2
    assert row_prob(row, 3) == 0.0
    assert row_prob(np.array([0.1, 0.9]), 1) == 0.9


def test_candidates_of_a_non_finite_row_name_row_zero():
    with pytest.raises(NonFiniteLogitsError) as error:
        process_candidates(np.array([1, 3]), np.array([0.5, np.nan], dtype=np.float32), 5, SamplingConfig())
    assert error.value.row == 0


def test_candidates_keep_integer_ids():
    config = SamplingConfig(temperature=1.0, top_k=2, top_p=1.0)
    row = process_candidates(np.array([1, 3, 4]), np.array([0.0, 2.0, 1.0], dtype=np.float32), 6, config)
    assert row.token_ids.dtype == np.int64
    # softmax over the top two logits (2, 1): e / (e + 1) = 0.7310585786300049 on id 3.
    np.testing.assert_array_equal(row.token_ids, [3, 4])
    np.testing.assert_allclose(row.probs, [0.7310585786300049, 0.2689414213699951], rtol=1e-6)


# --- rule construction ---------------------------------------------------------------------------


def test_typical_acceptance_accepts_the_closed_range_zero_to_one():
    rule = TypicalAcceptance(0.0, 0.0)
    assert (rule.posterior_threshold, rule.posterior_alpha) == (0.0, 0.0)
    rule = TypicalAcceptance(1.0, 1.0)
    assert (rule.posterior_threshold, rule.posterior_alpha) == (1.0, 1.0)
    with pytest.raises(ValueError, match="posterior_threshold must be in \\[0, 1\\]"):
        TypicalAcceptance(1.5, 0.3)
    with pytest.raises(ValueError, match="posterior_alpha must be in \\[0, 1\\]"):
        TypicalAcceptance(0.09, 1.5)


def test_make_rule_passes_its_parameters_through():
    assert make_rule("cactus").delta == 1.0  # the documented default δ
    assert make_rule("cactus", delta=0.25).delta == 0.25
    tas = make_rule("tas", posterior_threshold=0.2, posterior_alpha=0.7)
    assert (tas.posterior_threshold, tas.posterior_alpha) == (0.2, 0.7)
    default_tas = make_rule("tas")
    assert (default_tas.posterior_threshold, default_tas.posterior_alpha) == (0.09, 0.3)
    assert isinstance(make_rule("sps"), SpeculativeSampling)
    assert isinstance(make_rule("exact"), ExactMatch)
    with pytest.raises(ValueError, match="method must be one of"):
        make_rule("greedy")


# --- processing: top-p, the exp, top-k by groups ----------------------------------------------------


def test_a_nucleus_wider_than_the_first_candidate_set_is_found_in_full():
    # One logit at 0 and 1,999 at −8: exp(−8) = 3.4e-4 lies below the first candidate threshold
    # (max · 1e-3), where the top token holds only 1 / (1 + 1999·e^−8) = 0.60 of the mass < top_p.
    logits = np.full(2000, -8.0)
    logits[123] = 0.0
    config = SamplingConfig(temperature=1.0, top_k=0, top_p=0.9)
    row = to_dense(process_logits(logits, config))
    expected = ref.processed_full(logits, 1.0, top_p=0.9)
    assert np.count_nonzero(expected) > 1000
    np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-12)


def test_top_p_stops_before_an_entry_whose_mass_before_equals_top_p():
    # Four equal logits: probabilities 0.25 each (exact); masses before them 0, 0.25, 0.5, 0.75.
    # top_p = 0.5 keeps the two lowest ids (mass before < 0.5), 0.5 each after renormalising.
    logits = np.zeros(4)
    for top_k in (0, 4, 3):
        row = to_dense(process_logits(logits, SamplingConfig(temperature=1.0, top_k=top_k, top_p=0.5)))
        np.testing.assert_array_equal(row, [0.5, 0.5, 0.0, 0.0])


def test_a_nucleus_cut_through_ties_keeps_the_lowest_ids():
    # 300 equal logits: top_p = 0.5 keeps the 150 lowest ids (mass before id 149 = 149/300 < 0.5).
    logits = np.zeros(300)
    row = to_dense(process_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=0.5)))
    np.testing.assert_allclose(row, ref.processed_full(logits, 1.0, top_p=0.5), rtol=1e-6)
    np.testing.assert_array_equal(np.flatnonzero(row), np.arange(150))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_large_logits_do_not_overflow_the_softmax(top_p):
    # (x − max) / T ≤ 0 before exp: logits near 100 must not overflow float32 (exp(88.7) = inf).
    logits = np.array([100.0, 99.0, 90.0, 98.5])
    row = to_dense(process_logits(logits, SamplingConfig(temperature=0.7, top_k=0, top_p=top_p)))
    # float32 scaling of x / T ≈ 143 rounds by ~1e-5 absolute: a relative error of ~1e-5 in each prob.
    np.testing.assert_allclose(row, ref.processed_full(logits, 0.7, top_p=top_p), rtol=1e-4)


def test_without_top_k_and_top_p_the_row_is_dense():
    row = process_logits(np.array([1.0, 2.0, 3.0]), SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))
    assert isinstance(row, np.ndarray)
    np.testing.assert_allclose(row, ref.processed_full([1.0, 2.0, 3.0], 1.0), rtol=1e-6)


def test_a_nucleus_of_exactly_max_sparse_nucleus_tokens_stays_sparse():
    # 2,048 equal logits and the rest far below: top_p = 0.99999 keeps all 2,048 (mass before the
    # last = 2047/2048 = 0.99951 < top_p), and a nucleus of 2,048 is still sparse.
    logits = np.full(3000, -1e4)
    logits[:2048] = 0.0
    row = process_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=0.99999))
    assert isinstance(row, SparseProbs)
    assert np.count_nonzero(row.probs) == 2048
    np.testing.assert_allclose(to_dense(row), ref.processed_full(logits, 1.0, top_p=0.99999), rtol=1e-6)


def test_top_k_around_a_tied_floor_keeps_the_largest_entries_in_order():
    # V = 1024 = 64 · 16 groups; every group's max is 0 except group 5, holding ids 5, 21, 37 at 3, 2, 1:
    # the floor (2nd largest group max) is 0 and all 16 groups reach it, so the tie path runs.
    row = np.zeros((1, 1024), dtype=np.float32)
    row[0, [5, 21, 37]] = [3.0, 2.0, 1.0]
    ids, values = top_k_logits(row, 2)
    np.testing.assert_array_equal(ids, [[5, 21]])
    np.testing.assert_array_equal(values, [[3.0, 2.0]])
    config = SamplingConfig(temperature=1.0, top_k=2, top_p=0.7)
    # softmax(3, 2) = (0.731, 0.269): top-p 0.7 keeps id 5 alone.
    np.testing.assert_array_equal(to_dense(process_logits(row[0], config))[[5, 21]], [1.0, 0.0])


def assert_top_k_as_a_full_sort(rows, k: int) -> None:
    """top_k_logits' ids and values of each row equal a stable full sort's first k (ties: lower id)."""
    ids, values = top_k_logits(rows, k)
    for row, row_ids, row_values in zip(rows, ids, values, strict=True):
        expected = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        np.testing.assert_array_equal(row_ids, expected)
        np.testing.assert_array_equal(row_values, row[expected])


def test_top_k_by_groups_on_a_vocabulary_size_seen_first_here():
    # 64 · 41 + 7 ids: 41 groups (≥ 8 · k) and a 7-id tail; the group offsets are built afresh.
    rng = np.random.default_rng(41)
    rows = rng.normal(size=(3, 64 * 41 + 7)).astype(np.float32)
    rows[1, -3] = 9.0  # a winner in the tail
    assert_top_k_as_a_full_sort(rows, 4)


def test_a_small_vocabulary_row_with_no_finite_logit_is_named():
    rows = np.array([[1.0, 2.0, 3.0], [-np.inf, -np.inf, -np.inf]], dtype=np.float32)
    with pytest.raises(NonFiniteLogitsError) as error:
        top_k_logits(rows, 2)
    assert error.value.row == 1


# --- typical acceptance's matrix form ------------------------------------------------------------


def test_typical_acceptance_kl_uses_the_entropy_of_the_target_support_only():
    # q = (0.08, 0.23, 0.23, 0.23, 0.23): H = 1.554 nats, α·e^−H = 0.3 · 0.2114 = 0.0634 < τ = 0.09,
    # so q(0) = 0.08 passes. The draft also proposes id 7, outside q's support (a zero column).
    target = SparseProbs(np.array([0, 1, 2, 3, 4]), np.array([0.08, 0.23, 0.23, 0.23, 0.23]), 8)
    draft = SparseProbs(np.array([0, 7]), np.array([0.6, 0.4]), 8)
    assert ref.tas_threshold(ref.dense(target)) == pytest.approx(0.0634, abs=1e-4)
    law = ref.law_for("tas", posterior_threshold=0.09, posterior_alpha=0.3)
    expected = ref.kl(ref.output_law(law, draft, target), target)
    assert output_kl(TypicalAcceptance(), draft, target) == pytest.approx(expected, rel=1e-9)


def test_typical_acceptance_rejects_a_token_exactly_at_the_threshold():
    # q = (0.5, 0.5), α = τ = 1: α·e^−H = e^−ln 2 = 0.5 = q(d); the test is strict (q(d) > threshold),
    # so every drafted token is rejected and argmax q (id 0) is emitted: out = (1, 0).
    target = SparseProbs(np.array([0, 1]), np.array([0.5, 0.5]), 4)
    draft = SparseProbs(np.array([0, 1]), np.array([0.5, 0.5]), 4)
    law = ref.law_for("tas", posterior_threshold=1.0, posterior_alpha=1.0)
    np.testing.assert_array_equal(ref.output_law(law, draft, target), [1.0, 0.0, 0.0, 0.0])
    expected = ref.kl([1.0, 0.0, 0.0, 0.0], target)  # ln 2
    assert expected == pytest.approx(math.log(2), rel=1e-12)
    assert output_kl(TypicalAcceptance(1.0, 1.0), draft, target) == pytest.approx(expected, rel=1e-9)


def test_the_budget_wrapper_names_itself_after_its_rule():
    rule = KLBudgetRule(Cactus(0.5), budget=0.25)
    assert rule.name == "cactus+budget"
    assert (rule.budget, rule.spent, rule.exhausted, rule.lossless) == (0.25, 0.0, False, False)
    assert isinstance(rule.lossless_rule, SpeculativeSampling)


# --- penalties: the row's edges ------------------------------------------------------------------


def test_penalties_reach_the_last_id_of_the_row_and_skip_the_id_equal_to_its_length():
    logits = np.array([2.0, -1.0, 3.0])
    penalties = Penalties(repeat_penalty=2.0, frequency_penalty=1.0)
    # Id 3 equals the row's length: one past the last entry, skipped by both penalties.
    apply_penalties(logits, np.array([0, 3]), np.array([3, 2]), penalties)
    # id 0: 2 / 2 = 1; id 1 untouched; id 2 (the last): 3 − 1·1 = 2.
    np.testing.assert_array_equal(logits, [1.0, -1.0, 2.0])


def test_the_repeat_penalty_divides_a_positive_logit_below_one():
    logits = np.array([0.5, -0.5, 0.0])
    apply_penalties(logits, np.array([0, 1, 2]), np.array([], dtype=np.int64), Penalties(repeat_penalty=2.0))
    # 0.5 > 0: 0.5 / 2 = 0.25; −0.5 · 2 = −1; 0 · 2 = 0.
    np.testing.assert_array_equal(logits, [0.25, -1.0, 0.0])


# --- rules: repr and the verdicts of TAS and exact match ---------------------------------------------


def test_a_rule_without_parameters_is_shown_by_its_class_name():
    assert repr(SpeculativeSampling()) == "SpeculativeSampling()"
    assert repr(ExactMatch()) == "ExactMatch()"


def test_typical_acceptance_ignores_zero_entries_of_a_dense_target_row():
    # q = (0.5, 0.5, 0): H over the support = ln 2, so the threshold is min(0.9, 0.3 · 0.5) = 0.15
    # and q(1) = 0.5 passes. (Counting the zero entry would make H NaN.) Bonus: q_1 is one-hot on 0.
    target = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    assert ref.tas_threshold(target[0], posterior_threshold=0.9, posterior_alpha=0.3) == pytest.approx(0.15)
    draft = np.array([[0.0, 1.0, 0.0]])
    verdict = TypicalAcceptance(0.9, 0.3).verify(np.array([1]), draft, target, np.random.default_rng(0))
    assert (verdict.n_accepted, verdict.next_token, verdict.acceptance_probs) == (1, 0, (1.0,))


def test_typical_acceptance_verify_rejects_a_token_exactly_at_the_threshold():
    # q = (0.5, 0.5), α = τ = 1: threshold = e^−ln 2 = 0.5 = q(1), and the test is strict: rejected,
    # acceptance probability 0, argmax q (id 0, the first) emitted.
    target = SparseProbs(np.array([[0, 1], [0, 1]]), np.array([[0.5, 0.5], [0.5, 0.5]]), 4)
    assert ref.tas_threshold(ref.dense(target[0]), posterior_threshold=1.0, posterior_alpha=1.0) == 0.5
    draft = SparseProbs(np.array([[0, 1]]), np.array([[0.5, 0.5]]), 4)
    verdict = TypicalAcceptance(1.0, 1.0).verify(np.array([1]), draft, target, np.random.default_rng(0))
    assert (verdict.n_accepted, verdict.next_token, verdict.acceptance_probs) == (0, 0, (0.0,))


def test_exact_match_reports_the_target_probability_of_the_drafted_token():
    # y ~ q is drawn; whatever it is, the reported acceptance probability at position 0 is q(d).
    target = SparseProbs(np.array([[0, 1], [0, 1]]), np.array([[0.25, 0.75], [0.5, 0.5]]), 2)
    draft = SparseProbs(np.array([[1]]), np.array([[1.0]]), 2)
    for seed in range(4):
        verdict = ExactMatch().verify(np.array([1]), draft, target, np.random.default_rng(seed))
        assert verdict.acceptance_probs == (0.75,)


# --- AcceptanceRule.verify: the verdict, the block checks, mixed rows --------------------------------


def test_verify_reports_the_acceptance_probability_of_each_tried_position():
    # p = (0.5, 0.5), q = (0.25, 0.75): d = 1 has a = min(1, 0.75 / 0.5) = 1 (accepted); then
    # q_1 = (0, 1) against d = 0: a = 0 (rejected), residual normalize(max(0, q − p)) = id 1.
    draft = SparseProbs(np.array([[0, 1], [0, 1]]), np.array([[0.5, 0.5], [0.5, 0.5]]), 2)
    target = SparseProbs(
        np.array([[0, 1], [0, 1], [0, 1]]), np.array([[0.25, 0.75], [0.0, 1.0], [1.0, 0.0]]), 2
    )
    rule = SpeculativeSampling()
    verdict = rule.verify(np.array([1, 0]), draft, target, np.random.default_rng(0))
    assert (verdict.n_accepted, verdict.next_token, verdict.acceptance_probs) == (1, 1, (1.0, 0.0))
    # d = 1 alone: accepted, bonus from q_1 = one-hot on 1.
    verdict = rule.verify(np.array([1]), draft[:1], target[:2], np.random.default_rng(0))
    assert (verdict.n_accepted, verdict.next_token, verdict.acceptance_probs) == (1, 1, (1.0,))


def test_verify_flattens_a_block_of_draft_tokens():
    # Tokens given as a (1, 2) block are the two positions d = (0, 1); all one-hot rows agree.
    draft = SparseProbs(np.array([[0], [1]]), np.array([[1.0], [1.0]]), 3)
    target = SparseProbs(np.array([[0], [1], [2]]), np.array([[1.0], [1.0], [1.0]]), 3)
    for rule in (SpeculativeSampling(), KLBudgetRule(Cactus(0.5), budget=1.0)):
        verdict = rule.verify(np.array([[0, 1]]), draft, target, np.random.default_rng(0))
        assert (verdict.n_accepted, verdict.next_token, verdict.acceptance_probs) == (2, 2, (1.0, 1.0))


def test_verify_recovers_a_token_from_a_sparse_draft_and_a_dense_target():
    # q(1) = 0: d = 1 is rejected; the residual normalize(max(0, q − p)) = (0.5, 0, 0.5) needs the
    # sparse draft spread over V = 3.
    draft = [SparseProbs(np.array([1]), np.array([1.0]), 3)]
    target = np.array([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    for seed in range(4):
        verdict = SpeculativeSampling().verify(np.array([1]), draft, target, np.random.default_rng(seed))
        assert verdict.n_accepted == 0 and verdict.next_token in (0, 2)
        assert verdict.acceptance_probs == (0.0,)


class _FixedDraws:
    """An rng whose every uniform draw is ``u`` (0.0 is the lowest value random() can return)."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def test_a_draw_of_zero_does_not_accept_a_token_with_acceptance_probability_zero():
    # a = q(1) / p(1) = 0: accepted iff u < 0, never; the residual (1, 0) gives token 0.
    draft = SparseProbs(np.array([[0, 1]]), np.array([[0.5, 0.5]]), 2)
    target = SparseProbs(np.array([[0], [0]]), np.array([[1.0], [1.0]]), 2)
    verdict = SpeculativeSampling().verify(np.array([1]), draft, target, _FixedDraws(0.0))
    assert (verdict.n_accepted, verdict.next_token, verdict.acceptance_probs) == (0, 0, (0.0,))


def test_verify_checks_the_vocabulary_sizes_and_the_token_range():
    rng = np.random.default_rng(0)
    rule = SpeculativeSampling()
    with pytest.raises(ValueError, match="disagree on the vocabulary size: 3 vs 4"):
        rule.verify(np.array([0]), np.full((1, 3), 1 / 3), np.full((2, 4), 0.25), rng)
    for token in (3, -1):  # one past the last id; negative
        with pytest.raises(ValueError, match="draft_tokens must be token ids in \\[0, 3\\)"):
            rule.verify(np.array([token]), np.full((1, 3), 1 / 3), np.full((2, 3), 1 / 3), rng)


# --- the KL budget's verify ----------------------------------------------------------------------


def test_a_budget_starts_with_no_position_kls():
    assert KLBudgetRule(Cactus(0.5), budget=0.25).position_kls == ()


def test_the_budget_verdict_counts_the_accepted_prefix_and_emits_the_recovered_token():
    # Point-mass drafts on 0 then 1; q_0 is one-hot on 0 (accepted with probability 1: h = q when
    # q(d) = 1), q_1 is one-hot on 0 (h(1) = 0: rejected with certainty, residual = q_1 → token 0).
    draft = [SparseProbs(np.array([0]), np.array([1.0]), 3), SparseProbs(np.array([1]), np.array([1.0]), 3)]
    one_hot_0 = SparseProbs(np.array([0]), np.array([1.0]), 3)
    target = [one_hot_0, one_hot_0, SparseProbs(np.array([2]), np.array([1.0]), 3)]
    rule = KLBudgetRule(Cactus(0.5), budget=1.0)
    verdict = rule.verify(np.array([0, 1]), draft, target, np.random.default_rng(0))
    assert (verdict.n_accepted, verdict.next_token, verdict.acceptance_probs) == (1, 0, (1.0, 0.0))
    # All accepted: the bonus is drawn from q_1, one-hot on 2.
    verdict = rule.verify(np.array([0]), draft[:1], [one_hot_0, target[2]], np.random.default_rng(0))
    assert (verdict.n_accepted, verdict.next_token, verdict.acceptance_probs) == (1, 2, (1.0,))


def test_the_budget_recovers_a_token_from_a_sparse_draft_and_a_dense_target():
    # A dense target row is not measurable: SpS judges. q(1) = 0, so d = 1 is rejected and the
    # residual normalize(max(0, q − p)) = (0.5, 0, 0.5) is built over V = 3 for the sparse draft.
    draft = [SparseProbs(np.array([1]), np.array([1.0]), 3)]
    target = np.array([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    for seed in range(4):
        verdict = KLBudgetRule(Cactus(0.5), budget=1.0).verify(
            np.array([1]), draft, target, np.random.default_rng(seed)
        )
        assert verdict.n_accepted == 0 and verdict.next_token in (0, 2)
        assert verdict.acceptance_probs == (0.0,)


def test_the_budget_refuses_a_draft_token_with_zero_draft_probability():
    draft = [SparseProbs(np.array([0]), np.array([1.0]), 3)]
    target = [SparseProbs(np.array([1]), np.array([1.0]), 3)] * 2
    with pytest.raises(ValueError, match="draft token 1 at position 0 has zero draft probability"):
        KLBudgetRule(Cactus(0.5), budget=1.0).verify(np.array([1]), draft, target, np.random.default_rng(0))


# --- step_kl, acceptance_rate, kl_divergence, output_kl ------------------------------------------


def test_step_kl_refuses_more_decided_positions_than_draft_rows():
    row = SparseProbs(np.array([0, 1]), np.array([0.5, 0.5]), 3)
    with pytest.raises(ValueError):
        step_kl(Cactus(0.5), [row], [row, row, row], 2)


def test_kl_divergence_is_infinite_where_b_lacks_mass_and_mixes_sparse_and_dense_rows():
    assert ref.kl([0.5, 0.5], [1.0, 0.0]) == math.inf
    assert kl_divergence(np.array([0.5, 0.5]), np.array([1.0, 0.0])) == math.inf
    # Σ a · ln(a / b) = 2 · 0.5 · ln(0.5 / 0.25) = ln 2, with a sparse and b dense (V = 3).
    sparse = SparseProbs(np.array([0, 1]), np.array([0.5, 0.5]), 3)
    assert kl_divergence(sparse, np.array([0.25, 0.25, 0.5])) == pytest.approx(math.log(2), rel=1e-12)
    wide = SparseProbs(np.array([0, 1, 2]), np.array([0.25, 0.25, 0.5]), 3)
    assert kl_divergence(np.array([0.5, 0.5, 0.0]), wide) == pytest.approx(math.log(2), rel=1e-12)


def test_output_kls_of_dense_rows_use_the_per_token_oracle():
    drafts = [np.array([0.6, 0.3, 0.1, 0.0]), np.array([0.1, 0.1, 0.4, 0.4])]
    targets = [np.array([0.2, 0.3, 0.4, 0.1]), np.array([0.5, 0.2, 0.2, 0.1])]
    law = ref.law_for("cactus", delta=0.5)
    expected = [ref.kl(ref.output_law(law, d, t), t) for d, t in zip(drafts, targets, strict=True)]
    assert min(expected) > 1e-3
    np.testing.assert_allclose(output_kls(Cactus(0.5), drafts, targets), expected, rtol=1e-9)
    assert output_kl(Cactus(0.5), drafts[0], targets[0]) == pytest.approx(expected[0], rel=1e-9)


class _HalfAccept(AcceptanceRule):
    """A lossy rule with no vectorized law: accepts with probability 1/2, emits q on rejection."""

    def acceptance_prob(self, token, draft, target):
        return 0.5

    def rejection_dist(self, token, draft, target, vocab_size):
        return target


def test_output_kl_of_a_rule_without_a_vectorized_law_uses_the_per_token_oracle():
    # out = ½ p + ½ q = (0.5, 0.5, 0) for p = (1, 0, 0), q = (0, 1, 0):
    # KL(out ‖ q) = inf (out has mass on id 0, q has none). With q = (0.5, 0.5, 0):
    # out = (0.75, 0.25, 0), KL = 0.75 ln 1.5 + 0.25 ln 0.5.
    draft = SparseProbs(np.array([0]), np.array([1.0]), 3)
    target = SparseProbs(np.array([0, 1]), np.array([0.5, 0.5]), 3)
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert output_kl(_HalfAccept(), draft, target) == pytest.approx(expected, rel=1e-12)


def test_cactus_kl_with_a_drafted_token_whose_target_probability_rounds_to_one():
    # q = (1.0, 1e-17) (a top-k row with a large logit gap: 1 + 1e-17 rounds to 1). For d = 0,
    # q(d) = 1: h = q, nothing to move (the matrix form must not divide by 1 − q(d) = 0). For d = 1,
    # h(1) = 1e-17 + sqrt(1e-17) ≈ 3.2e-9: out(1) = 0.5 · h(1)/0.5 ≈ 3.2e-9 on a column q holds,
    # KL ≈ 3.2e-9 · ln(3.2e8) ≈ 6e-8 > 0.
    draft = SparseProbs(np.array([0, 1]), np.array([0.5, 0.5]), 3)
    target = SparseProbs(np.array([0, 1]), np.array([1.0, 1e-17]), 3)
    expected = ref.kl(ref.output_law(ref.law_for("cactus", delta=0.5), draft, target), target)
    assert 5e-8 < expected < 7e-8
    assert output_kl(Cactus(0.5), draft, target) == pytest.approx(expected, rel=1e-6)


# --- processing: the dense support, top-k of 1 and of V, top-p and min-p edges -----------------------


def test_row_support_of_a_dense_row_is_its_positive_entries():
    ids, probs = row_support(np.array([0.0, 0.25, 0.0, 0.75]))
    np.testing.assert_array_equal(ids, [1, 3])
    np.testing.assert_array_equal(probs, [0.25, 0.75])


def test_top_k_of_one_keeps_the_largest_logit_at_any_temperature():
    config = SamplingConfig(temperature=1.0, top_k=1, top_p=1.0)
    assert has_candidate_path(config, 3)
    row = process_logits(np.array([1.0, 3.0, 2.0], dtype=np.float32), config)
    np.testing.assert_array_equal(to_dense(row), [0.0, 1.0, 0.0])


def test_top_k_equal_to_the_vocabulary_is_off_and_the_row_is_dense():
    logits = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    row = process_logits(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=1.0))
    assert isinstance(row, np.ndarray)
    np.testing.assert_allclose(row, ref.processed_full(logits, 1.0), rtol=1e-6)


def test_top_k_probabilities_subtract_the_largest_logit_before_exp():
    # Logits 500 and 499: exp(1000) overflows float64, exp(0) and exp(−1) do not.
    logits = np.array([500.0, 499.0, 0.0, -1.0], dtype=np.float32)
    row = to_dense(process_logits(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=1.0)))
    # (1, e^−1) / (1 + e^−1) = (0.7310585786300049, 0.2689414213699951)
    np.testing.assert_allclose(row, [0.7310585786300049, 0.2689414213699951, 0.0, 0.0], rtol=1e-12)


def test_candidates_padded_with_the_lowest_ids_keep_integer_ids():
    # Two finite candidates for top_k = 4: padded with ids 0 and 1 at −inf (probability 0).
    config = SamplingConfig(temperature=1.0, top_k=4, top_p=1.0)
    row = process_candidates(np.array([2, 5]), np.array([1.0, 0.0], dtype=np.float32), 8, config)
    assert row.token_ids.dtype == np.int64
    np.testing.assert_array_equal(row.token_ids, [2, 5, 0, 1])
    full = np.full(8, -np.inf)
    full[[2, 5]] = [1.0, 0.0]
    np.testing.assert_allclose(to_dense(row), ref.processed_full(full, 1.0, top_k=4), rtol=1e-12)


def test_top_k_by_sorting_breaks_ties_by_the_lower_id():
    # 40 ids (fewer than 8 · k groups of 64: the small-vocabulary sort): ids 1, 2, 4 and the multiples
    # of 3 hold 0, the others −1. The top 10 are the 10 lowest ids at 0: 0, 1, 2, 3, 4, 6, 9, 12, 15, 18
    # (an unstable sort mixes ties once a row has 17 entries or more).
    row = np.where(np.arange(40) % 3 == 0, 0.0, -1.0).astype(np.float32)[None, :]
    row[0, [1, 2, 4]] = 0.0
    ids, _ = top_k_logits(row, 10)
    np.testing.assert_array_equal(ids, [np.flatnonzero(row[0] == 0.0)[:10]])


def test_top_k_by_groups_builds_its_group_offsets_on_an_empty_cache(monkeypatch):
    # The offsets are cached per vocabulary size; another test may have filled the cache first.
    import cactus_edge.rules.sampling as sampling

    monkeypatch.setattr(sampling, "_offsets", {})
    rng = np.random.default_rng(17)
    rows = rng.normal(size=(2, 64 * 20 + 3)).astype(np.float32)  # 20 groups ≥ 8 · 2, a 3-id tail
    assert_top_k_as_a_full_sort(rows, 2)


def test_the_nucleus_measures_its_mass_against_a_float64_total():
    # exp(ln 5e-8) = w ≈ 5e-8 for six ids, 1 for id 0: the total is 1 + 6w ≈ 1 + 3e-7 (a float32
    # sum would round it to 1: w < 2^−24). Id 0 holds 1/(1 + 6w) ≈ 1 − 3e-7 < top_p = 1 − 2.8e-7,
    # so id 1 (mass before it ≈ 1 − 3e-7) joins; id 2 (mass before ≈ 1 − 2.5e-7 ≥ top_p) does not.
    logits = np.array([0.0] + [math.log(5e-8)] * 6, dtype=np.float32)
    row = process_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=1 - 2.8e-7))
    np.testing.assert_array_equal(np.flatnonzero(to_dense(row)), [0, 1])
    np.testing.assert_allclose(to_dense(row), ref.processed_full(logits, 1.0, top_p=1 - 2.8e-7), rtol=1e-6)


def test_top_p_of_one_keeps_a_tiny_top_k_entry():
    # softmax(0, 0, −50) = (0.5, 0.5, e^−50 / 2): the third entry's mass before it rounds to 1.0,
    # yet top_p = 1 keeps every top-k entry.
    logits = np.array([0.0, 0.0, -50.0, -60.0], dtype=np.float32)
    row = to_dense(process_logits(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=1.0)))
    assert row[2] > 0.0
    np.testing.assert_allclose(row, ref.processed_full(logits, 1.0, top_k=3), rtol=1e-12)


def test_top_k_then_top_p_stops_before_an_entry_whose_mass_before_equals_top_p():
    # Top 4 of (1, 1, 1, 1, 0): 0.25 each (exact); masses before 0, 0.25, 0.5, 0.75: top_p = 0.5
    # keeps ids 0 and 1 (mass before < 0.5), 0.5 each.
    logits = np.array([1.0, 1.0, 1.0, 1.0, 0.0], dtype=np.float32)
    row = to_dense(process_logits(logits, SamplingConfig(temperature=1.0, top_k=4, top_p=0.5)))
    np.testing.assert_array_equal(row, [0.5, 0.5, 0.0, 0.0, 0.0])


def test_min_p_keeps_an_entry_exactly_at_its_threshold():
    # float32 exp of the float32 logit −0.6931472 is exactly 0.5: probabilities ∝ (1, 0.5, e^−5), and
    # min_p = 0.5 puts the threshold at 0.5 · p(0) = p(1) exactly: kept (≥). Renormalised: (2/3, 1/3, 0).
    logits = np.array([0.0, -0.6931472, -5.0], dtype=np.float32)
    assert np.exp(logits[1]) == np.float32(0.5)
    row = to_dense(process_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5)))
    np.testing.assert_allclose(row, [2 / 3, 1 / 3, 0.0], rtol=1e-12)


def test_the_nucleus_search_sums_its_candidates_in_float64():
    # Weights exp(0) = 1, w1 = exp(−0.699965) ≈ 0.4966 (≥ 1e-3: a first-round candidate) and
    # w2 = exp(−11) ≈ 1.7e-5 (below 1e-3: not one). 1 + w1 is a float32 tie that rounds up by 2^−24,
    # so a float32 sum would see the first two reach top_p = (1 + w1 + 2^−25) / total. They hold
    # (1 + w1) / total < top_p, so the nucleus must take id 2 as well.
    logits = np.array([0.0, -0.6999650001525879, -11.0], dtype=np.float32)
    weights = np.exp(logits)  # the float32 exp the dense path takes (max logit 0, T = 1)
    total = weights.sum(dtype=np.float64)
    top_p = (1.0 + float(weights[1]) + 2.0**-25) / total
    assert (1.0 + float(weights[1])) / total < top_p < 1.0
    row = process_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=top_p))
    np.testing.assert_array_equal(np.flatnonzero(to_dense(row)), [0, 1, 2])


@pytest.mark.timeout(30)
def test_a_dense_top_p_row_whose_probabilities_sum_just_below_top_p_ends():
    # 2,051 equal logits: the nucleus is wider than MAX_SPARSE_NUCLEUS, so top-p runs on the dense
    # row, where 2051 · fl(1/2051) sums to 1 − 2^−52 < top_p = 1 − 2^−53. No candidate set ever
    # reaches top_p: the search must stop once its threshold reaches 0 and keep every entry.
    top_p = 1.0 - 2.0**-53
    assert np.full(2051, 1 / 2051).sum() < top_p
    logits = np.zeros(2051, dtype=np.float32)
    row = process_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=top_p))
    assert isinstance(row, np.ndarray)
    np.testing.assert_allclose(row, ref.processed_full(logits, 1.0, top_p=top_p), rtol=1e-12)


def test_a_long_row_is_sampled_at_the_inverse_cdf_of_the_draw():
    # 5,000 equal weights (past 4 · 1024: searched block by block): u = 0.5001 puts u · total =
    # 2500.5 inside entry 2500 (entries 0..2499 hold 2500), in block 2 (ids 2048..3071).
    row = np.ones(5000)
    assert sample_token(row, _FixedDraws(0.5001)) == 2500
    # u = 0.9 · 5000 = 4500 → entry 4500, in the last, partial block (ids 4096..4999).
    assert sample_token(row, _FixedDraws(0.90001)) == 4500


def test_a_draw_of_zero_never_picks_a_zero_weight_entry():
    # The inverse CDF of u = 0 is the first entry with positive weight: id 1, not id 0 (weight 0).
    assert sample_token(np.array([0.0, 1.0, 1.0]), _FixedDraws(0.0)) == 1
    # u = 0.5 of (1, 0, 1): u · total = 1 equals the mass of id 0 alone; the next positive id is 2.
    assert sample_token(np.array([1.0, 0.0, 1.0]), _FixedDraws(0.5)) == 2


def test_output_distribution_of_float32_dense_rows_is_computed_in_float64():
    # Rows given in float32 are read as their exact float64 values and the law is evaluated in
    # float64: the reference on the same values agrees to 1e-12 (float32 arithmetic would not: ~1e-8).
    # d = 0 (p 0.7, q 0.1, h ≈ 0.23) is often rejected: the residual carries most of the output.
    draft = np.array([0.7, 0.2, 0.1], dtype=np.float32)
    target = np.array([0.1, 0.3, 0.6], dtype=np.float32)
    law = ref.law_for("cactus", delta=0.1)
    expected = ref.output_law(law, draft.astype(np.float64), target.astype(np.float64))
    np.testing.assert_allclose(output_distribution(Cactus(0.1), draft, target), expected, rtol=1e-12)
