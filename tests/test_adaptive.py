"""The draft-length policy and the prompt-lookup matcher, as pure functions."""

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.drafters import DraftPlanner
from cactus_edge.engine.lookup import NgramIndex, point_mass_rows
from cactus_edge.rules.draft_length import (
    MIN_PROBE_INTERVAL,
    AcceptanceTracker,
    CostModel,
    best_probe_length,
    choose_draft_length,
    could_pay,
    expected_run,
    expected_tokens,
)


def test_expected_tokens_is_one_plus_the_expected_accepted_prefix():
    rates = np.array([0.8, 0.5, 0.5])
    assert expected_tokens(rates, 0) == 1.0
    assert expected_tokens(rates, 1) == pytest.approx(1.8)
    assert expected_tokens(rates, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_chosen_k_is_the_argmax_of_expected_tokens_per_ms():
    rates = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])

    def verify_ms(n):
        return 60.0 + 12.0 * n

    chosen = choose_draft_length(rates, lambda k: 15.0 * k, verify_ms, 6)
    throughput = [1 / verify_ms(1)] + [
        expected_tokens(rates, k) / (k * 15.0 + verify_ms(k + 1)) for k in range(1, 7)
    ]
    assert chosen == int(np.argmax(throughput))
    assert 0 < chosen < 6


def test_when_every_draft_loses_k_is_zero():
    # Compute-bound CPU: verifying n tokens costs n times one (as on a 2-core CPU), draft not free.
    assert choose_draft_length(np.full(8, 0.6), lambda k: 37.0 * k, lambda n: 80.0 * n, 8) == 0


def test_near_free_verification_takes_the_longest_block():
    # Verification and drafting nearly free (a GPU, or the lookup drafter): draft all you may.
    assert choose_draft_length(np.full(12, 0.8), lambda k: 0.01 * k, lambda n: 20.0 + 0.01 * n, 12) == 12


def test_cost_model_interpolates_measured_sizes():
    costs = CostModel()
    assert not costs.ready
    costs.record_verify(1, 80.0)
    assert costs.verify_ms(4) == pytest.approx(80.0)  # one size known: flat (optimistic, so tried)
    costs.record_verify(5, 200.0)
    costs.record_draft(1, 30.0)
    assert costs.ready
    assert costs.verify_ms(3) == pytest.approx(140.0)  # a line through (1, 80) and (5, 200)
    costs.record_verify(1, 100.0)
    assert costs.verify_ms(1) == pytest.approx(84.0)  # moving average, weight 0.2 on the new value
    costs.record_verify(4, 90.0)
    assert costs.verify_ms(4) == pytest.approx(90.0)  # a measured size is used as measured


def test_model_draft_cost_counts_catch_up_and_batches_a_guess():
    costs = CostModel()
    costs.record_draft(1, 40.0)
    costs.record_draft(5, 80.0)  # line: 30 + 10 n
    assert costs.model_draft_ms(3) == pytest.approx(120.0)  # unguided: one decode per draft
    # 6 committed tokens unseen: the first decode is a 7-token batch, then two singles.
    assert costs.model_draft_ms(3, n_catch_up=6) == pytest.approx(100.0 + 80.0)
    # A 5-token guess: 3 drafts come from one 3-token batch (last token + 2 guessed).
    assert costs.model_draft_ms(3, n_guided=5) == pytest.approx(60.0)
    # Drafting past the guess falls back to single decodes.
    assert costs.model_draft_ms(4, n_guided=1) == pytest.approx(50.0 + 2 * 40.0)


def test_a_guess_makes_model_drafting_pay_where_single_decodes_lose():
    # Costs shaped like this 2-core machine: a draft batch is 35 ms + 10 ms per token, a verify of
    # n tokens 60 + 25 n ms; 80% of draft tokens accepted.
    costs = CostModel()
    costs.record_draft(1, 45.0)
    costs.record_draft(5, 85.0)
    rates = np.full(4, 0.8)
    verify = lambda n: 60.0 + 25.0 * n  # noqa: E731
    unguided = choose_draft_length(rates, lambda k: costs.model_draft_ms(k), verify, 4)
    guided = choose_draft_length(rates, lambda k: costs.model_draft_ms(k, n_guided=4), verify, 4)
    assert unguided == 0 and guided == 3
    # …unless the draft first has to catch up on 30 tokens it skipped…
    behind = choose_draft_length(rates, lambda k: costs.model_draft_ms(k, 30, 4), verify, 4)
    assert behind == 0


def test_a_margin_keeps_break_even_drafting_off():
    rates = np.full(2, 0.14)
    verify = lambda n: 90.0 + 10.0 * n  # noqa: E731
    draft = lambda k: 1.0 * k  # noqa: E731
    # k = 1: 1.14 tokens / 111 ms, 2.7% above plain decoding's 1 / 100 ms.
    assert choose_draft_length(rates, draft, verify, 2) == 1
    assert choose_draft_length(rates, draft, verify, 2, margin=0.05) == 0


def test_acceptance_tracker_moves_towards_observed_probabilities():
    tracker = AcceptanceTracker(4)
    for _ in range(50):
        tracker.record((1.0, 0.1))
    assert tracker.rates[0] > 0.99 and tracker.rates[1] < 0.11
    assert tracker.rates[2] == pytest.approx(0.6)  # never observed: the prior


def lookup_continuation(context, max_tokens, *, max_ngram=4, min_ngram=2):
    """The full scan NgramIndex replaced: every n-gram window of the context compared with its
    last n tokens, longest n first, the most recent match with a token after it. Slow and
    obviously right."""
    tokens = np.asarray(context, dtype=np.int64)
    if max_tokens <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            begin = int(starts[-1]) + n
            return tokens[begin : begin + max_tokens].tolist()
    return []


@pytest.mark.parametrize(
    ("context", "n", "expected"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # trigram match
        ([9, 1, 2, 7, 8, 3, 1, 2], 2, [7, 8]),  # bigram match
        ([4, 5, 6, 7, 5], 4, []),  # a lone unigram match is not used by default
        ([1, 2, 3, 1, 2, 3, 4, 1, 2, 3], 2, [4, 1]),  # the most recent occurrence wins
        ([5, 6, 7], 3, []),  # nothing recurs
        ([1, 2, 1], 0, []),
    ],
)
def test_lookup_matcher_on_crafted_contexts(context, n, expected):
    assert NgramIndex().continuation(context, n) == expected
    assert lookup_continuation(context, n) == expected  # the reference agrees


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], ([4, 5], 3)),  # the trigram, preceded by nothing to extend it
        ([7, 1, 2, 3, 9, 8, 7, 1, 2, 3], ([9, 8], 4)),  # extended back by the 7 before both
        ([5, 6, 7], ([], 0)),
        # Overlapping: the 4-gram [1,1,1,1] recurs one token earlier; the match runs back to the start.
        ([1] * 10, ([1], 9)),
    ],
)
def test_lookup_match_length_extends_the_ngram_backwards(context, expected):
    assert NgramIndex().match(context, 2) == expected


def test_a_long_copy_is_its_own_match_class():
    from cactus_edge.engine.lookup import MAX_MATCH_LENGTH, match_bucket

    code = list(range(100, 140))
    tokens, length = NgramIndex().match(code + [1, 2] + code[:30], 4)
    assert tokens == code[30:34] and length == 30
    assert [match_bucket(n) for n in (0, 2, 3, 4, 7, 8, 15, 16, 30)] == [
        "0", "2", "3", "4+", "4+", "8+", "8+", "16+", "16+",
    ]  # fmt: skip
    assert NgramIndex().match(code * 3, 1)[1] == MAX_MATCH_LENGTH


def test_unigram_matches_on_request():
    assert NgramIndex(min_ngram=1).continuation([4, 5, 6, 7, 5], 4) == [6, 7, 5]


@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(2, 4), (1, 3), (3, 3)])
def test_ngram_index_answers_as_the_full_scan_at_every_length(min_ngram, max_ngram):
    # A 5-token vocabulary makes n-grams recur often; the context grows by 1–3 tokens per call,
    # as committed text does, and every answer must equal a scan of the whole context.
    rng = np.random.default_rng(min_ngram * 10 + max_ngram)
    index = NgramIndex(min_ngram=min_ngram, max_ngram=max_ngram)
    context: list[int] = []
    n_found = 0
    while len(context) < 400:
        context.extend(rng.integers(0, 5, size=int(rng.integers(1, 4))).tolist())
        max_tokens = int(rng.integers(0, 6))
        expected = lookup_continuation(context, max_tokens, min_ngram=min_ngram, max_ngram=max_ngram)
        assert index.continuation(context, max_tokens) == expected, len(context)
        n_found += bool(expected)
    assert n_found > 100


def test_ngram_index_starts_over_for_a_context_that_does_not_extend_it():
    index = NgramIndex()
    assert index.continuation([1, 2, 3, 9, 1, 2], 2) == [3, 9]
    other = [7, 8, 5, 7, 8]  # shorter: indexed from scratch
    assert index.continuation(other, 2) == lookup_continuation(other, 2) == [5, 7]
    diverged = [7, 8, 5, 6, 6, 7, 8]  # longer, another token where the indexed text ended
    assert index.continuation(diverged, 3) == lookup_continuation(diverged, 3) == [5, 6, 6]


def test_lookup_proposals_are_point_masses():
    rows = point_mass_rows([7, 9], vocab_size=20)
    assert [r.token_ids.tolist() for r in rows] == [[7], [9]]
    assert all(r.probs.tolist() == [1.0] and r.shape == (20,) for r in rows)


def test_failed_probes_back_off_and_a_paying_probe_resets():
    tracker = AcceptanceTracker(4)
    due = [tracker.should_probe() for _ in range(32)]
    assert due.count(True) == 2 and due[15] and due[31]
    tracker.record_probe(paid=False)
    tracker.record_probe(paid=False)
    assert tracker.probe_every == 64
    for _ in range(10):
        tracker.record_probe(paid=False)
    assert tracker.probe_every == 256
    tracker.record_probe(paid=True)
    assert tracker.probe_every == 16


def test_a_probe_is_skipped_when_even_full_acceptance_would_lose():
    costs = CostModel()
    costs.record_draft(1, 45.0)
    costs.record_draft(5, 85.0)
    verify = lambda n: 60.0 + 25.0 * n  # noqa: E731
    # In sync, 3 drafts all accepted: 4 tokens in 65 + 160 ms beat plain decoding's 1 per 85 ms.
    assert could_pay(3, lambda k: costs.model_draft_ms(k, 0, 4), verify)
    # 40 tokens behind, the catch-up alone costs more than the 3 tokens speculation could save.
    assert not could_pay(3, lambda k: costs.model_draft_ms(k, 40, 4), verify)


def test_lookup_outcomes_move_only_the_first_position():
    tracker = AcceptanceTracker(4)
    for _ in range(30):
        tracker.record_lookup_outcome(followed=True)
    assert tracker.rates[0] > 0.99 and tracker.rates[1:] == pytest.approx(0.6)
    for _ in range(30):
        tracker.record_lookup_outcome(followed=False)
    assert tracker.rates[0] < 0.01


def test_catch_up_is_spread_over_the_expected_run():
    costs = CostModel()
    costs.record_draft(1, 40.0)
    costs.record_draft(5, 80.0)  # line: 30 + 10 n
    # 3 drafts from a guess, 20 tokens behind: a 23-token batch, 260 ms = 60 in sync + 200 catch-up.
    assert costs.model_draft_ms(3, 20, 5) == pytest.approx(260.0)
    assert costs.model_draft_ms(3, 20, 5, run_tokens=2.0) == pytest.approx(260.0)  # < one step
    assert costs.model_draft_ms(3, 20, 5, run_tokens=40.0) == pytest.approx(60.0 + 200.0 / 10)


def test_expected_run_is_geometric_in_the_first_acceptance():
    assert expected_run(0.5) == pytest.approx(1.0)
    assert expected_run(0.9) == pytest.approx(9.0)
    assert expected_run(1.0) == pytest.approx(99.0)  # capped
    assert expected_run(0.0) == 0.0


def test_a_long_expected_copy_lets_drafting_resume_behind():
    costs = CostModel()
    costs.record_draft(1, 45.0)
    costs.record_draft(5, 85.0)
    verify = lambda n: 60.0 + 25.0 * n  # noqa: E731
    rates = np.array([0.98, 0.9, 0.9, 0.9])
    prose = choose_draft_length(rates, lambda k: costs.model_draft_ms(k, 30, 4, expected_run(0.7)), verify, 4)
    copy = choose_draft_length(rates, lambda k: costs.model_draft_ms(k, 30, 4, expected_run(0.98)), verify, 4)
    assert prose == 0 and copy > 0


# Measured on a 2-core AMD EPYC (scripts/batch_costs.py): the Q4_0 target verifies 4 or 5 tokens in
# about the time of 3, and the Q4_0 draft decodes one token in 33 ms.
Q4_0_VERIFY = {1: 84.3, 2: 131.2, 3: 188.2, 4: 167.8, 5: 189.2, 6: 290.0, 7: 350.0, 8: 398.6, 9: 435.1}


def test_a_probe_tries_the_cheapest_block_per_token_not_the_shortest():
    draft = lambda k: 33.0 * k  # noqa: E731
    assert best_probe_length(draft, Q4_0_VERIFY.__getitem__, 8) == 4  # a 5-token batch, 189 ms
    linear = lambda n: 80.0 + 10.0 * n  # noqa: E731
    assert best_probe_length(lambda k: 5.0 * k, linear, 8) == 8  # nearly free drafts: the longest
    assert best_probe_length(lambda k: 500.0 * k, linear, 8) == 1  # costly drafts: the shortest


def test_the_planner_probes_at_the_cheap_batch_size():
    costs = CostModel()
    for n_tokens, ms in Q4_0_VERIFY.items():
        costs.record_verify(n_tokens, ms)
    costs.record_draft(1, 33.0)
    planner = DraftPlanner(GenerationConfig(n_draft="auto"), costs, {})
    chosen = [planner.plan(8, "model") for _ in range(MIN_PROBE_INTERVAL)]
    # The prior acceptance makes drafting lose here, so k = 0 until the probe is due, which
    # drafts 4 (a 5-token verify batch, 189 ms), not max(k + 1, 2) = 2 (a 3-token batch, 188 ms).
    assert chosen[:-1] == [0] * (MIN_PROBE_INTERVAL - 1) and chosen[-1] == 4


def test_a_lazy_prompt_catch_up_is_spread_over_the_horizon_it_buys():
    """The draft is fed the prompt only when the model first drafts: charged to one step, a
    200-token catch-up would keep `auto` from ever drafting; spread over the 64 tokens the reply
    may still draft for, it is paid when the acceptance makes drafting worth it."""
    costs = CostModel()
    costs.record_draft(1, 10.0)
    costs.record_draft(5, 14.0)  # line: 9 + 1 n; a 200-token catch-up costs about 200 ms
    for n_tokens in range(1, 10):
        costs.record_verify(n_tokens, 40.0 + 10.0 * n_tokens)
    trackers: dict = {}
    planner = DraftPlanner(GenerationConfig(n_draft="auto"), costs, trackers)
    planner.tracker("model").rates[:] = 0.9
    planner.tracker("model").probe_every = 10**9  # no probe: the plan alone
    assert planner.plan(8, "model", n_catch_up=200) == 0
    assert planner.plan(8, "model", n_catch_up=200, horizon=64) > 0
    assert planner.plan(8, "model", n_catch_up=5000, horizon=64) == 0  # a long prompt does not pay


def test_a_plain_step_teaches_the_lookup_class_whether_the_target_followed_its_guess():
    """While `auto` keeps k = 0 a lookup class would never learn; the target's own token on a plain
    step says whether the guess's first token was right, at no cost."""
    from cactus_edge.engine.drafters import Proposal

    planner = DraftPlanner(GenerationConfig(n_draft="auto"), CostModel(), {})
    prior = planner.tracker("lookup/16+").rates[0]
    for _ in range(10):
        planner.learn(Proposal(guess=[5, 6], lookup_source="lookup/16+"), (), emitted_first=5)
    assert planner.tracker("lookup/16+").rates[0] > 0.95 > prior
    for _ in range(10):
        planner.learn(Proposal(guess=[5, 6], lookup_source="lookup/2"), (), emitted_first=7)
    assert planner.tracker("lookup/2").rates[0] < 0.1
    assert planner.tracker("lookup/16+").rates[1] == prior  # later positions learn from drafts only
