"""End-to-end distribution checks of the first drafted step, over many seeds.

A generation's first token comes from the target's prefill alone (a plain step); its second step
is the first that drafts. So the checks count the pair (t1, t2) of the first two emitted tokens
and compare t2, given t1, with the target's own processed row after prompt + [t1]: the expected
count of cell (t1, t2) is n(t1) · q(t2 | t1).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
from scipy import stats as scipy_stats

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.rules.sampling import SamplingConfig, process_logits, to_dense

MIN_EXPECTED = 5.0  # chi-square cells expecting fewer runs are pooled


@dataclass
class FirstDraftedSteps:
    """What n_runs seeded generations did in their first two steps."""

    pair_counts: np.ndarray  # (V, V): runs whose first two emitted tokens were (t1, t2)
    n_runs: int
    n_second_step_accepted: int = 0  # runs whose second step accepted at least one draft
    n_first_step_drafts: int = 0  # drafts proposed by first steps, over all runs (should be 0)
    second_step_drafters: Counter = field(default_factory=Counter)  # label -> runs
    second_step_drafted_after: Counter = field(default_factory=Counter)  # t1 -> runs whose step 2 drafted

    @property
    def first_token_counts(self) -> np.ndarray:
        """(V,): runs per first token t1."""
        return self.pair_counts.sum(axis=1)


def sample_first_drafted_steps(engine, prompt_tokens, n_runs: int, **settings) -> FirstDraftedSteps:
    """Generate from prompt_tokens with seeds 0..n_runs-1 and record the first two emitted tokens
    and the second step's drafting. settings: GenerationConfig fields; max_tokens defaults to
    n_draft + 2, so that the second step's block is not cut by the budget. End-of-generation
    tokens do not end these generations (every run needs a t2, also after a t1 that would)."""
    settings = {"max_tokens": int(settings.get("n_draft", 3)) + 2, **settings}
    vocab_size = engine.target.vocab_size
    sample = FirstDraftedSteps(np.zeros((vocab_size, vocab_size), dtype=np.int64), n_runs)
    with mock.patch.object(engine.target, "is_end_of_generation", lambda token: False):
        for seed in range(n_runs):
            result = engine.generate(prompt_tokens, GenerationConfig(seed=seed, **settings))
            first_step, second_step = result.stats.steps[:2]
            t1, t2 = result.tokens[:2]
            sample.pair_counts[t1, t2] += 1
            sample.n_first_step_drafts += first_step.n_draft
            sample.n_second_step_accepted += second_step.n_accepted > 0
            sample.second_step_drafters[second_step.drafter] += 1
            if second_step.n_draft:
                sample.second_step_drafted_after[t1] += 1
    return sample


def target_row(target_alone, tokens, sampling: SamplingConfig) -> np.ndarray:
    """The target's own processed distribution of the token after ``tokens`` (V,), from a fresh
    cache."""
    target_alone.reset()
    return to_dense(process_logits(target_alone.decode(list(tokens))[0], sampling))


def expected_pair_counts(
    target_alone, prompt_tokens, first_token_counts, sampling: SamplingConfig
) -> np.ndarray:
    """(V, V): n(t1) · q(t2 | t1) for every observed t1, q the target's own processed row after
    prompt + [t1]; rows of unobserved t1 are 0."""
    vocab_size = first_token_counts.size
    expected = np.zeros((vocab_size, vocab_size))
    for t1 in np.flatnonzero(first_token_counts):
        expected[t1] = first_token_counts[t1] * target_row(target_alone, [*prompt_tokens, int(t1)], sampling)
    return expected


def pooled_chisquare_pvalue(observed, expected, groups=None) -> float:
    """Chi-square p-value over the cells with expected > 0, after pooling, within each group, the
    cells expecting fewer than MIN_EXPECTED runs into one cell (with the next-smallest cells when
    the pool itself would expect fewer). groups: labels of observed's shape (default: one group),
    so that pooling never mixes cells a test wants to see apart."""
    observed, expected = np.asarray(observed, dtype=float).ravel(), np.asarray(expected, dtype=float).ravel()
    labels = np.zeros(observed.size, dtype=int) if groups is None else np.asarray(groups).ravel()
    cells_observed, cells_expected = [], []
    for label in np.unique(labels[expected > 0]):
        cells = np.flatnonzero((labels == label) & (expected > 0))
        cells = cells[np.argsort(expected[cells], kind="stable")]
        n_pooled = int(np.searchsorted(expected[cells], MIN_EXPECTED))
        while 0 < n_pooled < cells.size and expected[cells[:n_pooled]].sum() < MIN_EXPECTED:
            n_pooled += 1
        if n_pooled:
            cells_observed.append(observed[cells[:n_pooled]].sum())
            cells_expected.append(expected[cells[:n_pooled]].sum())
        cells_observed += list(observed[cells[n_pooled:]])
        cells_expected += list(expected[cells[n_pooled:]])
    # The expected counts are rescaled to the observed total (tiny float differences aside, they
    # already sum to it); scipy refuses sums that differ in the 8th digit.
    cells_expected = np.array(cells_expected) * (sum(cells_observed) / sum(cells_expected))
    return float(scipy_stats.chisquare(cells_observed, cells_expected).pvalue)


def assert_first_drafted_steps_follow_the_target(target_alone, prompt_tokens, steps, sampling, groups=None):
    """The first token stays in the target's support after the prompt; the second, the first a
    step may draft, follows the target's own processed row after prompt + [t1]: nothing outside
    its support, and chi-square over the (t1, t2) cells against n(t1) · q(t2 | t1), p > 0.001
    (groups: as for :func:`pooled_chisquare_pvalue`)."""
    first_support = target_row(target_alone, prompt_tokens, sampling) > 0
    outside = steps.first_token_counts[~first_support].sum()
    assert outside == 0, f"{outside} first tokens outside the target's support"
    expected = expected_pair_counts(target_alone, prompt_tokens, steps.first_token_counts, sampling)
    outside = steps.pair_counts[expected == 0].sum()
    assert outside == 0, f"{outside} second tokens outside the target's support after prompt + [t1]"
    pvalue = pooled_chisquare_pvalue(steps.pair_counts, expected, groups)
    assert pvalue > 1e-3, f"(t1, t2) counts vs n(t1) q(t2 | t1): chi-square p = {pvalue:.3g}"
