"""Predicted Outputs (OpenAI's ``prediction``): a client's predicted reply becomes the draft source
the drafter tries first. The reply stays the target's; only how many verifier calls it takes
changes, and usage reports the prediction's drafts the target accepted and rejected."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cactus_edge.cli.bench import make_variants, predicted_output
from cactus_edge.cli.main import main
from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.engine.lookup import PredictionIndex
from cactus_edge.errors import InvalidSettingError
from cactus_edge.openai_api import create_chat_completion, parse_request

from .conftest import TEST_THREADS

MESSAGES = [{"role": "user", "content": "the water is hot and"}]
FIXED = {"temperature": 0, "seed": 0, "max_tokens": 40, "method": "sps", "n_draft": 4}


# --- where the reply is in the prediction ------------------------------------------------------


def test_an_empty_reply_starts_at_the_predictions_start():
    index = PredictionIndex([5, 6, 7, 8])
    assert index.match([], 3) == ([5, 6, 7], 0)


def test_the_reply_walks_through_the_prediction_in_order():
    prediction = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 5]
    index = PredictionIndex(prediction)
    assert index.match([1, 2], 1) == ([3], 2)  # the first "1 2"
    assert index.match([1, 2, 3, 9, 1, 2], 1) == ([4], 6)  # the longest suffix that occurs
    assert index.match([7, 9, 1, 2], 1) == ([5], 3)  # "9 1 2" again: the occurrence ahead of us
    assert index.match([8, 8], 2) == ([], 0)  # not in the prediction


def test_one_token_is_a_match_only_as_the_predictions_first():
    index = PredictionIndex([4, 5, 6, 7, 8])
    assert index.match([4], 2) == ([5, 6], 1)  # the reply began as predicted
    assert index.match([6], 1) == ([], 0)  # one token elsewhere says little
    assert index.match([9, 6, 7], 1) == ([8], 2)


# --- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_pair):
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS) as engine:
        yield engine


@pytest.mark.parametrize("prediction", ["", "the water is hot and cold", "python code word people were"])
def test_a_prediction_never_changes_the_reply(engine, prediction):
    prompt = engine.tokenize_chat(MESSAGES)
    engine.clear_caches()
    plain = engine.generate(prompt, GenerationConfig(**FIXED))
    engine.clear_caches()
    predicted = engine.generate(prompt, GenerationConfig(**FIXED, prediction=prediction or None))
    assert predicted.tokens == plain.tokens
    accepted, rejected = predicted.stats.prediction_tokens
    steps = [s for s in predicted.stats.steps if s.drafter == "prediction"]
    assert accepted + rejected == sum(s.n_draft for s in steps)


@pytest.fixture
def reply_as_prediction(engine):
    """The greedy reply's tokens, and a prediction text that stands for them: the tiny vocabulary
    does not give its tokens back from their text, so the target's tokenizer hands the index the
    tokens themselves for it."""
    prompt = engine.tokenize_chat(MESSAGES)
    engine.clear_caches()
    plain = engine.generate(prompt, GenerationConfig(**FIXED))
    engine.clear_caches()
    original = engine.target.tokenize
    engine.target.tokenize = lambda text, **kw: (
        list(plain.tokens) if text == "REPLY" else original(text, **kw)
    )
    try:
        yield prompt, plain
    finally:
        engine.target.tokenize = original


def test_a_prediction_of_the_reply_itself_is_drafted_from(engine, reply_as_prediction):
    prompt, plain = reply_as_prediction
    predicted = engine.generate(prompt, GenerationConfig(**FIXED, prediction="REPLY"))
    assert predicted.tokens == plain.tokens
    accepted, rejected = predicted.stats.prediction_tokens
    assert accepted >= len(plain.tokens) // 2 and accepted > rejected
    assert predicted.stats.n_verifier_calls < plain.stats.n_verifier_calls


# --- the API ----------------------------------------------------------------------------------


def test_the_prediction_field_is_read_and_checked():
    content = parse_request({"prediction": {"type": "content", "content": "def f(): pass"}})
    assert content.config.prediction == "def f(): pass" and content.ignored == ()
    parts = parse_request({"prediction": {"type": "content", "content": [{"type": "text", "text": "a"}]}})
    assert parts.config.prediction == "a"
    for bad in ({"type": "file"}, "text", {"type": "content", "content": 5}):
        with pytest.raises(InvalidSettingError) as raised:
            parse_request({"prediction": bad})
        assert raised.value.param.startswith("prediction")


def test_usage_reports_the_predictions_accepted_and_rejected_tokens(engine, reply_as_prediction):
    settings = {k: v for k, v in FIXED.items() if k not in ("method", "n_draft")}
    answer = create_chat_completion(
        engine, MESSAGES, prediction={"type": "content", "content": "REPLY"}, **settings,
        speculative={"method": "sps", "n_draft": 4},
    )  # fmt: skip
    details = answer["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= answer["usage"]["completion_tokens"] // 2
    plain = create_chat_completion(engine, MESSAGES, **settings, speculative={"method": "sps", "n_draft": 4})
    assert plain["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0


# --- the bench ----------------------------------------------------------------------------------


def test_the_bench_runs_each_speculative_variant_with_and_without_the_prediction(tiny_args, tmp_path):
    variants = [v.label for v in make_variants(["none", "sps"], [1.0], [4], ["lookup"], prediction=True)]
    assert variants == ["none", "sps k=4 [lookup]", "sps k=4 [lookup] +prediction"]
    assert predicted_output("Fix it:\n\n```python\nx = 1\n```\nthanks") == "```python\nx = 1\n```"
    assert predicted_output("no code here") is None
    prompts = tmp_path / "edit.jsonl"
    prompts.write_text(
        json.dumps({"category": "code-editing", "prompt": "Fix:\n```\nthe water is\n```"}) + "\n"
    )
    out = tmp_path / "out"
    flags = ["--methods", "none,sps", "--n-draft", "4", "--prompts", str(prompts), "--max-tokens", "8"]
    result = CliRunner().invoke(main, ["bench", *tiny_args, *flags, "--prediction", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    assert [r["variant"] for r in data["runs"]] == [
        "none", "sps k=4 [model+lookup]", "sps k=4 [model+lookup] +prediction"
    ]  # fmt: skip
    with_prediction = data["summary"]["sps k=4 [model+lookup] +prediction"]
    assert with_prediction["prediction"] and with_prediction["prediction_accepted"] >= 0
    assert (
        "| sps k=4 [model+lookup] +prediction |"
        in (out / "bench.md").read_text().split("Predicted outputs")[1]
    )


@pytest.mark.slow
def test_a_real_models_reply_predicted_from_its_text_comes_faster_and_the_same(smollm2_path):
    """SmolLM2 (a BPE vocabulary gives its tokens back from their text): the previous reply's
    text as the prediction, as an editor sends the file it asks to change."""
    # No code in the prompt: prompt lookup has little to find, the prediction does the drafting.
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    settings = {
        "temperature": 0,
        "seed": 0,
        "max_tokens": 60,
        "method": "sps",
        "n_draft": 6,
        "drafter": "lookup",
    }
    with Engine.load(str(smollm2_path), str(smollm2_path), n_ctx=1024, n_threads=TEST_THREADS) as engine:
        prompt = engine.tokenize_chat(messages)
        engine.clear_caches()
        plain = engine.generate(prompt, GenerationConfig(**settings))
        engine.clear_caches()
        predicted = engine.generate(prompt, GenerationConfig(**settings, prediction=plain.text))
    assert predicted.text == plain.text
    accepted, rejected = predicted.stats.prediction_tokens
    assert accepted >= 0.8 * len(plain.tokens), (accepted, rejected, len(plain.tokens))
    assert predicted.stats.n_verifier_calls < plain.stats.n_verifier_calls


def test_auto_plans_a_prediction_as_free_as_a_lookup():
    """A prediction's drafts are point masses: no decode, so `auto` must not charge them the
    draft model's cost (it then never drafted from them on the default pair)."""
    from cactus_edge.engine.drafters import DraftPlanner, decodes_nothing
    from cactus_edge.rules.draft_length import CostModel

    assert decodes_nothing("prediction/4+") and decodes_nothing("lookup/2") and not decodes_nothing("model")
    costs = CostModel()
    for n_tokens, ms in ((1, 70.0), (2, 100.0), (4, 110.0), (8, 200.0)):
        costs.record_verify(n_tokens, ms)
    costs.record_draft(1, 30.0)
    planner = DraftPlanner(GenerationConfig(), costs, {})
    assert planner.draft_cost("prediction/8+", 0, 900, 0.0)(8) == 0.0
    assert planner.plan(8, "prediction/8+") == planner.plan(8, "lookup/8+") > 0
