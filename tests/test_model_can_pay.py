"""The defaults (model+lookup, auto) draft by lookup alone where the measured costs say the draft
model cannot beat plain decoding at any draft length, even with every draft accepted; where it
can pay they keep it. Costs are faked both ways."""

import pytest

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.drafters import DraftPlanner, DraftSourceChooser, LookupDrafter
from cactus_edge.engine.stats import StepProfiler
from cactus_edge.rules.draft_length import CostModel

# A 2-core CPU with a Q4_K_M pair: a draft token costs 0.6 of a target token and a batch of n
# costs nearly n times one, so no draft length can pay.
CANNOT_PAY = {
    "verify": {n: 100.0 * n**0.95 for n in range(1, 10)},
    "draft": {n: 60.0 * n for n in range(1, 6)},
}
# A GPU: verifying a few tokens costs about one, and a draft token a tenth of it.
CAN_PAY = {
    "verify": {n: 20.0 + 0.5 * n for n in range(1, 10)},
    "draft": {n: 2.0 + 0.1 * n for n in range(1, 6)},
}

# Verifying is free up to the longest block, but a draft decode has a large fixed cost: one draft
# token cannot pay, four can.
PAYS_ONLY_LONGER = {
    "verify": {n: 100.0 for n in range(1, 10)},
    "draft": {n: 100.0 + n for n in range(1, 6)},
}


def calibrated(table: dict) -> CostModel:
    costs = CostModel()
    for n_tokens, ms in table["verify"].items():
        costs.record_verify(n_tokens, ms)
    for n_tokens, ms in table["draft"].items():
        costs.record_draft(n_tokens, ms)
    costs.calibrated.update({"target", "draft"})
    return costs


def test_the_planner_says_whether_the_model_can_pay():
    auto = GenerationConfig(n_draft="auto")
    assert not DraftPlanner(auto, calibrated(CANNOT_PAY), {}).model_can_pay()
    assert DraftPlanner(auto, calibrated(CAN_PAY), {}).model_can_pay()
    assert DraftPlanner(auto, CostModel(), {}).model_can_pay()  # nothing measured yet: try it
    fixed = GenerationConfig(n_draft=4)  # asked for: drafted whatever it costs
    assert DraftPlanner(fixed, calibrated(CANNOT_PAY), {}).model_can_pay()


class NoModel:
    """A draft model that must not be asked."""

    def catch_up_length(self, committed):
        raise AssertionError("the draft model was used")

    propose = catch_up_length


class CountingModel(NoModel):
    def __init__(self):
        self.asked = 0

    def catch_up_length(self, committed):
        return 0

    def propose(self, committed, n_draft, guess, source):
        from cactus_edge.engine.drafters import Proposal

        self.asked += 1
        return Proposal()


@pytest.mark.parametrize("table, model_off", [(CANNOT_PAY, True), (CAN_PAY, False)])
def test_the_defaults_switch_the_model_off_only_where_it_cannot_pay(table, model_off):
    planner = DraftPlanner(GenerationConfig(n_draft="auto"), calibrated(table), {})
    model = NoModel() if model_off else CountingModel()
    chooser = DraftSourceChooser("model+lookup", planner, model, LookupDrafter(50), StepProfiler())
    for step in range(20):
        chooser.propose(list(range(30 + step)), room=8)
    assert chooser.model_off == model_off
    assert model_off or model.asked == 20


def test_an_explicit_model_drafter_is_kept_even_where_it_cannot_pay():
    planner = DraftPlanner(GenerationConfig(n_draft="auto", drafter="model"), calibrated(CANNOT_PAY), {})
    model = CountingModel()
    chooser = DraftSourceChooser("model", planner, model, LookupDrafter(50), StepProfiler())
    chooser.propose(list(range(30)), room=8)
    assert not chooser.model_off and model.asked == 1


@pytest.mark.parametrize("table, model_off", [(CANNOT_PAY, True), (CAN_PAY, False)])
def test_a_generation_says_when_it_drafted_by_lookup_alone(engine, table, model_off):
    engine.reset_estimates()
    engine.use_estimates(calibrated(table), {})
    engine.clear_caches()
    stats = engine.generate("the water is", GenerationConfig(max_tokens=24, seed=1)).stats
    assert stats.draft_model_off == model_off
    assert ("lookup alone (the draft model cannot pay" in stats.summary_line()) == model_off
    used_model = any(step.drafter.startswith("model") for step in stats.steps)
    assert used_model != model_off
    if model_off:
        assert engine.draft.n_past == 0  # never fed: no catch-up spent on it
    engine.reset_estimates()


def test_a_short_room_at_one_step_does_not_switch_the_model_off():
    """Whether the model can pay is the machine's answer, not one step's: a step with room for one
    draft token (the end of the reply, or forced tokens before it) keeps the model for the rest."""
    planner = DraftPlanner(GenerationConfig(n_draft="auto"), calibrated(PAYS_ONLY_LONGER), {})
    model = CountingModel()
    chooser = DraftSourceChooser("model+lookup", planner, model, LookupDrafter(50), StepProfiler())
    chooser.propose(list(range(30)), room=1)
    chooser.propose(list(range(31)), room=8)
    assert not chooser.model_off and model.asked == 2
