"""A KL budget for a whole response: lossy verification while the running sum of exact per-token
KL(out ‖ target) stays within the budget, SpS afterwards."""

import math

import numpy as np
import pytest

from cactus_edge.engine.engine import GenerationConfig
from cactus_edge.errors import InvalidSettingError
from cactus_edge.rules.acceptance import (
    Cactus,
    KLBudgetRule,
    TypicalAcceptance,
    output_distribution,
    output_kl,
)
from cactus_edge.rules.sampling import to_dense

from .test_acceptance import ALPHA, N_TRIALS, chi_square_pvalue, emitted_first_tokens, random_pair

PROMPT = "the water is hot and"
LOSSY = {"method": "cactus", "delta": 1.0, "n_draft": 4, "temperature": 1.0, "top_k": 6, "top_p": 1.0}


@pytest.mark.statistical
@pytest.mark.parametrize("lossy", [Cactus(1.0), TypicalAcceptance()], ids=repr)
def test_a_zero_budget_rule_reproduces_the_target(lossy):
    draft_row, target_row = random_pair(np.random.default_rng(11), sparse=True, vocab_size=12)
    counts = emitted_first_tokens(KLBudgetRule(lossy, 0.0), draft_row, target_row, N_TRIALS, seed=4)
    assert chi_square_pvalue(counts, to_dense(target_row)) > ALPHA
    # The same test has the power to see the lossy rule's own distribution.
    unbudgeted = emitted_first_tokens(lossy, draft_row, target_row, N_TRIALS, seed=4)
    assert chi_square_pvalue(unbudgeted, to_dense(target_row)) < ALPHA
    assert chi_square_pvalue(unbudgeted, to_dense(output_distribution(lossy, draft_row, target_row))) > ALPHA


# End to end, at drafted positions: tests/test_engine_laws.py (budget 0 is SpS; a budget bounds the
# realised KL on every path).


@pytest.mark.parametrize("budget", [0.05, 1.0, 4.0])
def test_the_realised_kl_never_exceeds_the_budget(engine, budget):
    totals = []
    for seed in range(12):
        result = engine.generate(
            PROMPT, GenerationConfig(**LOSSY, max_tokens=60, seed=seed, kl_budget=budget)
        )
        step_kls = [s.kl * s.n_decided for s in result.stats.steps if s.kl is not None]
        assert result.stats.kl_total <= budget + 1e-12
        assert result.stats.kl_total == pytest.approx(sum(step_kls))
        totals.append(result.stats.kl_total)
    if budget >= 1.0:  # larger than one position's KL here (0.1–0.6 nats): the lossy rule is used
        assert max(totals) > 0


def test_once_spent_the_rest_of_the_response_is_lossless(engine):
    result = engine.generate(PROMPT, GenerationConfig(**LOSSY, max_tokens=80, seed=3, kl_budget=0.05))
    kls = [s.kl for s in result.stats.steps if s.n_draft]
    first_zero = next(i for i, kl in enumerate(kls) if kl == 0.0)
    assert all(kl == 0.0 for kl in kls[first_zero + 1 :])
    assert result.stats.kl_budget == 0.05


def test_an_unlimited_budget_changes_nothing(engine):
    plain = engine.generate(PROMPT, GenerationConfig(**LOSSY, max_tokens=60, seed=5))
    huge = engine.generate(PROMPT, GenerationConfig(**LOSSY, max_tokens=60, seed=5, kl_budget=1e9))
    infinite = engine.generate(PROMPT, GenerationConfig(**LOSSY, max_tokens=60, seed=5, kl_budget=math.inf))
    assert plain.tokens == huge.tokens == infinite.tokens
    assert plain.stats.kl_total == pytest.approx(huge.stats.kl_total)
    assert plain.stats.kl_total > 0


@pytest.mark.parametrize("budget", [-0.1, float("nan"), "1", True])
def test_invalid_budgets_are_refused_by_name(budget):
    with pytest.raises(InvalidSettingError, match="kl_budget"):
        GenerationConfig(kl_budget=budget)


def test_the_cli_and_the_openai_layer_take_the_budget(tiny_args):
    import json

    from click.testing import CliRunner

    from cactus_edge.cli.main import main
    from cactus_edge.openai_api import parse_request

    args = ["generate", "hi", *tiny_args, "--kl-budget", "0.5", "--n-draft", "4", "--json", "--seed", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kl_budget"] == 0.5 and data["kl_total"] <= 0.5
    parsed = parse_request({"messages": [], "speculative": {"kl_budget": 2}})
    assert parsed.config.kl_budget == 2


def test_typical_acceptance_parameters_reach_the_rule(engine):
    """A zero threshold accepts every draft the target allows; threshold and alpha 1 accept only
    drafts above e^−H(q): the parameters really change verification."""
    settings = {"method": "tas", "n_draft": 4, "temperature": 1.0, "top_k": 6, "top_p": 1.0, "max_tokens": 40}
    lenient = engine.generate(PROMPT, GenerationConfig(**settings, seed=2, posterior_threshold=0.0))
    strict = engine.generate(
        PROMPT, GenerationConfig(**settings, seed=2, posterior_threshold=1.0, posterior_alpha=1.0)
    )
    assert lenient.stats.acceptance_length > strict.stats.acceptance_length
    with pytest.raises(InvalidSettingError, match="posterior_alpha"):
        GenerationConfig(method="tas", posterior_alpha=2.0)


def test_top_p_without_top_k_is_judged_by_the_lossy_rule_within_its_budget(engine):
    """A top-p-only row is its (sparse) nucleus, so Cactus judges it and its KL is measured and
    budgeted; before, such rows were dense: their KL went unmeasured and a budget judged them by SpS."""
    top_p_only = {**LOSSY, "top_k": 0, "top_p": 0.9}
    free = engine.generate(PROMPT, GenerationConfig(**top_p_only, max_tokens=60, seed=2))
    assert free.stats.kl_total > 0
    budgeted = engine.generate(PROMPT, GenerationConfig(**top_p_only, max_tokens=60, seed=2, kl_budget=2.0))
    assert 0 < budgeted.stats.kl_total <= 2.0 + 1e-12


def test_an_unmeasurable_position_is_judged_by_sps_without_ending_the_budget():
    """A dense row (or one wider than MAX_KL_SUPPORT) costs too much to measure: that position
    is judged by SpS and spends nothing, and the next measurable position is lossy again."""
    from cactus_edge.rules.acceptance import MAX_KL_SUPPORT, kl_is_measurable
    from cactus_edge.rules.sampling import SparseProbs

    draft_row, target_row = random_pair(np.random.default_rng(3), sparse=True, vocab_size=12)
    dense_draft = to_dense(draft_row)
    wide = SparseProbs(
        np.arange(MAX_KL_SUPPORT + 1), np.full(MAX_KL_SUPPORT + 1, 1 / (MAX_KL_SUPPORT + 1)), 1000
    )
    assert kl_is_measurable(draft_row, target_row)
    assert not kl_is_measurable(dense_draft, target_row) and not kl_is_measurable(wide, wide)
    rule = KLBudgetRule(Cactus(1.0), budget=10.0)
    token = int(draft_row.token_ids[np.argmax(draft_row.probs)])
    rng = np.random.default_rng(0)
    rule.verify(np.array([token]), [dense_draft], [target_row, target_row], rng)
    assert rule.position_kls == (0.0,) and rule.spent == 0.0 and not rule.exhausted
    rule.verify(np.array([token]), [draft_row], [target_row, target_row], rng)
    assert rule.position_kls[0] > 0 and rule.spent == rule.position_kls[0]
    # Both kinds in one block: the first position (a dense copy of the target, so always
    # accepted) spends nothing, the second spends exactly its own KL.
    same_as_target = to_dense(target_row)
    first = int(target_row.token_ids[np.argmax(target_row.probs)])
    spent_before = rule.spent
    rule.verify(np.array([first, token]), [same_as_target, draft_row], [target_row] * 3, rng)
    assert rule.position_kls == (0.0, pytest.approx(output_kl(Cactus(1.0), draft_row, target_row)))
    assert rule.spent == pytest.approx(spent_before + rule.position_kls[1])
    from cactus_edge.rules.acceptance import step_kl

    assert step_kl(Cactus(1.0), [dense_draft], [target_row], 1) is None  # unmeasured, not slow
    assert step_kl(Cactus(1.0), [draft_row], [target_row], 1) > 0
