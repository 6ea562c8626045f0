"""No draft work before the first token (issue 21): the first token comes from the target's
prefill alone; the draft model is fed only when a step drafts with it, catching up on the prompt
(or a conversation's new turn) then, and reusing its cached prefix as the target does."""

from __future__ import annotations

import contextlib
import re

import pytest
from click.testing import CliRunner

from cactus_edge.cli.main import main
from cactus_edge.engine.engine import GenerationConfig
from cactus_edge.llama.model import LlamaModel

PROMPT = "the water is hot and"
FIXED = {"method": "sps", "drafter": "model", "n_draft": 3, "temperature": 0.0}


@pytest.fixture
def decodes(engine, monkeypatch):
    """Every llama_decode in order: ("target" | "draft", tokens fed)."""
    log: list[tuple[str, int]] = []
    real_chunk = LlamaModel._decode_chunk

    def logged(self, chunk, rows):
        log.append(("draft" if self is engine.draft else "target", len(chunk)))
        real_chunk(self, chunk, rows)

    monkeypatch.setattr(LlamaModel, "_decode_chunk", logged)
    engine.clear_caches()
    return log


@pytest.mark.parametrize("settings", [FIXED, {"n_draft": "auto"}], ids=["fixed k", "auto"])
def test_a_request_that_never_drafts_leaves_the_draft_cache_empty(engine, decodes, settings):
    result = engine.generate(PROMPT, GenerationConfig(**{**settings, "max_tokens": 1, "seed": 0}))
    assert len(result.tokens) == 1
    assert engine.draft.n_past == 0 and engine.draft.cache_range() == (-1, -1)
    assert [model for model, _ in decodes] == ["target"]  # one forward pass: the prompt's
    assert engine.check_caches(engine.tokenize_prompt(PROMPT) + result.tokens) == []


@pytest.mark.parametrize("settings", [FIXED, {"n_draft": "auto", "seed": 0}], ids=["fixed k", "auto"])
def test_the_first_token_precedes_any_draft_decode(engine, decodes, settings):
    n_prompt = len(engine.tokenize_prompt(PROMPT))
    config = GenerationConfig(**{**settings, "max_tokens": 24})
    with contextlib.closing(engine.stream(PROMPT, config)) as stream:
        first = next(stream)
        assert first.token is not None
        assert decodes == [("target", n_prompt)]  # the whole prompt in one decode, nothing else
        rest = list(stream)
    assert rest[-1].finish_reason == "length"
    if settings is FIXED:  # a fixed length drafts every step after the first
        steps = rest[-1].stats.steps
        assert steps[0].n_draft == 0 and steps[1].n_draft == FIXED["n_draft"]
        # The draft's first decode catches up on prompt + first token (+ a lookup guess, if any).
        first_draft = next(n for model, n in decodes if model == "draft")
        assert n_prompt + 1 <= first_draft <= n_prompt + FIXED["n_draft"]


def test_prefix_reuse_across_turns_with_a_lazy_draft(engine, decodes):
    messages = [{"role": "user", "content": "the code is"}]
    first = engine.chat(messages, GenerationConfig(**FIXED, max_tokens=12))
    turn_one = engine.tokenize_chat(messages) + first.tokens
    assert engine.draft.tokens == turn_one[: engine.draft.n_past] and engine.draft.n_past > 0
    cached = engine.draft.n_past
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and then"}]
    turn_two = engine.tokenize_chat(messages)
    reusable = next(i for i, (a, b) in enumerate(zip(turn_one, turn_two, strict=False)) if a != b)
    decodes.clear()
    second = engine.chat(messages, GenerationConfig(**FIXED, max_tokens=12))
    target_fed = [n for model, n in decodes if model == "target"]
    draft_fed = [n for model, n in decodes if model == "draft"]
    # Each model decodes only what it lacks: the target at the first step, the draft at its
    # catch-up (the new turn and the first reply token), never the shared prefix again.
    assert target_fed[0] == len(turn_two) - min(reusable, len(turn_two) - 1)
    catch_up = len(turn_two) + 1 - min(reusable, cached)
    assert catch_up <= draft_fed[0] <= catch_up + FIXED["n_draft"] - 1  # + a lookup guess, if any
    assert second.stats.n_prompt_decoded == target_fed[0]
    assert engine.check_caches(turn_two + second.tokens) == []


def test_generate_compare_runs_plain_then_the_settings_and_prints_the_ratio(tiny_pair):
    args = ["generate", "the water is", "--draft", str(tiny_pair[0]), "--target", str(tiny_pair[1])]
    flags = ["--n-ctx", "512", "--max-tokens", "12", "--seed", "3", "--compare"]
    result = CliRunner().invoke(main, [*args, *flags])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("[models] draft tiny-draft.gguf -> target tiny-target.gguf")
    assert re.match(r"plain: \[none\] \d+ tokens, .*, first token \d+ ms$", lines[1])
    assert re.match(r"these settings: \[cactus\] \d+ tokens, .*, first token \d+ ms$", lines[2])
    ratio = r"\d+\.\d\dx tokens/s, first token \d+\.\d\dx, end to end \d+\.\d\dx faster"
    ratio_line, verdict = result.stdout.strip().splitlines()
    compared = r"over the first (\d+) tokens of each reply \(plain wrote (\d+), these settings (\d+)\)"
    match = re.fullmatch(f"these settings vs plain {compared}: {ratio}", ratio_line)
    assert match, ratio_line
    n_compared, n_plain, n_ours = map(int, match.groups())
    assert n_compared == min(n_plain, n_ours) >= 2  # equal work: the tokens both replies wrote
    said = r"speculation (paid here|did not pay here \(\d+\.\d\dx; .*\)): \d+% of the reply"
    assert re.match(said, verdict)


def test_the_comparison_says_why_speculation_did_not_pay():
    from cactus_edge.cli.bench import comparison_verdict
    from cactus_edge.engine.stats import GenerationStats
    from cactus_edge.rules.draft_length import CostModel

    stats = GenerationStats(method="cactus", n_tokens=100, n_accepted=25)
    costs = CostModel()
    for n_tokens, ms in ((1, 40.0), (2, 70.0)):
        costs.record_verify(n_tokens, ms)
    costs.record_draft(1, 24.0)
    slow = comparison_verdict(0.98, stats, costs)
    assert slow.startswith("speculation did not pay here (0.98x") and "25% of the reply" in slow
    assert "a batch of 2 tokens costs 1.75x one and a draft token 0.60x one" in slow
    stats.draft_model_off = True
    assert "drafted by lookup alone" in comparison_verdict(1.01, stats, costs)
    paid = "speculation paid here: 25% of the reply came from accepted drafts."
    assert comparison_verdict(1.2, stats, costs) == paid


def test_auto_learns_lookup_acceptance_per_match_class(engine):
    """A long copy and a stray 2-gram are different evidence: `auto` keeps one curve per class."""
    engine.reset_estimates()
    text = "the water is hot and the code is fast " * 6
    result = engine.generate(text, GenerationConfig(drafter="lookup", temperature=0.0, max_tokens=30, seed=0))
    sources = {key[0] for key in engine.acceptance}
    classes = {f"lookup/{name}" for name in ("2", "3", "4+", "8+", "16+")}
    assert sources and sources <= classes, sources
    assert {step.drafter for step in result.stats.steps} <= {"lookup", "none"}
    engine.reset_estimates()


def test_measure_costs_holds_the_engine_and_leaves_the_caches_as_they_were(engine):
    from cactus_edge.errors import EngineBusy

    result = engine.generate(PROMPT, GenerationConfig(**FIXED, max_tokens=6))
    held = (list(engine.target.tokens), list(engine.draft.tokens))
    costs = engine.measure_costs(sizes=[1, 2, 3], repeats=2)
    assert set(costs["verify_ms"]) == {1, 2, 3} and min(costs["verify_ms"].values()) > 0
    assert costs["draft_ms"] > 0
    assert (engine.target.tokens, engine.draft.tokens) == held
    assert engine.check_caches(engine.tokenize_prompt(PROMPT) + result.tokens) == []
    with contextlib.closing(engine.stream(PROMPT, GenerationConfig(**FIXED, max_tokens=6))) as stream:
        next(stream)  # this thread holds the engine: measuring now would race the generation
        with pytest.raises(EngineBusy):
            engine.measure_costs(sizes=[1])
