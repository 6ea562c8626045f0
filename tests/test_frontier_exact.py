"""scripts/frontier_exact.py on the tiny pair: every rule judged on the same reference positions,
with exact acceptance rates and KL per position."""

import numpy as np
import pytest

from cactus_edge.engine import Engine
from cactus_edge.sampling import process_logits, to_dense

from .conftest import load_script


@pytest.fixture(scope="module")
def frontier():
    return load_script("frontier_exact")


def test_block_acceptance_multiplies_the_rates_along_the_block(frontier):
    rates = np.array([0.5, 1.0, 0.2, 0.0])
    # k = 2 from positions 0, 1, 2: 0.5 + 0.5·1, 1 + 1·0.2, 0.2 + 0.2·0
    np.testing.assert_allclose(frontier.block_acceptance(rates, 2), [1.0, 1.2, 0.2])
    assert frontier.block_acceptance(rates, 5).size == 0


def test_every_rule_is_judged_on_the_same_reference_positions(frontier, tiny_pair, tmp_path):
    prompts = [{"prompt": "Hello there", "category": "chat"}, {"prompt": "Tell me more", "category": "chat"}]
    rules = frontier.make_rules([0.25, 1.0], [0.09])
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512) as engine:
        per_prompt = frontier.run(engine, prompts, rules, 10, tmp_path)
        again = frontier.run(engine, prompts, rules, 10, tmp_path)  # references come from the cache
        # Position 3 of reply 0, computed on its own: the rows predicting reply token 3. Decoded
        # here in another batch shape than the whole reply, so llama.cpp's rounding differs in
        # the 6th digit: a tolerance of 1e-4 holds on every CPU, and position 3 must be
        # the only one that close (a shifted position would match a neighbour instead).
        reference = frontier.reference_replies(engine, prompts, 10, tmp_path / "references.jsonl")[0]
        context = reference["prompt_tokens"] + reference["reply_tokens"][:3]
        rows = []
        for model in (engine.draft, engine.target):
            model.reset()
            rows.append(process_logits(model.decode(context)[0], frontier.SAMPLING))
            model.reset()
    own_rate = np.minimum(to_dense(rows[0]), to_dense(rows[1])).sum()
    close = np.flatnonzero(np.isclose(per_prompt[0]["sps"][:, 0], own_rate, rtol=1e-4, atol=0))
    assert close.tolist() == [3], (per_prompt[0]["sps"][:, 0], own_rate)
    assert (tmp_path / "references.jsonl").read_text().count("\n") == 2
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512) as engine:
        frontier.reference_replies(engine, prompts, 6, tmp_path / "references.jsonl")  # other limit
    assert (tmp_path / "references.jsonl").read_text().count("\n") == 4  # not reused: generated anew
    for first, second in zip(per_prompt, again, strict=True):
        np.testing.assert_array_equal(first["sps"], second["sps"])
    for measured in per_prompt:
        assert {len(values) for values in measured.values()} == {10}
        assert np.all((measured["sps"][:, 0] >= 0) & (measured["sps"][:, 0] <= 1 + 1e-12))
        assert np.all(measured["sps"][:, 1] == 0)  # lossless: no divergence
        # Cactus raises the target's probability of the drafted token: it accepts at least as
        # often as SpS at every position, more with a larger delta, and pays KL for it.
        assert np.all(measured["cactus δ=0.25"][:, 0] >= measured["sps"][:, 0] - 1e-12)
        assert np.all(measured["cactus δ=1"][:, 0] >= measured["cactus δ=0.25"][:, 0] - 1e-12)
        assert measured["cactus δ=1"][:, 1].sum() > 0
    summary = frontier.summarize(per_prompt, 4, np.random.default_rng(0))
    entry = summary["cactus δ=1"]["al_k4"]
    assert entry["low"] <= entry["mean"] <= entry["high"] <= 4
    assert "| tas τ=0.09 |" in frontier.table(summary, 4)
    ((tas, cactus, point, low, high),) = frontier.paired_differences(
        per_prompt, summary, np.random.default_rng(0)
    )
    assert tas == "tas τ=0.09" and cactus in ("cactus δ=0.25", "cactus δ=1")
    pooled = np.concatenate([p[cactus] - p[tas] for p in per_prompt]).mean(axis=0)
    np.testing.assert_allclose(point, pooled)  # the difference on the same positions
    assert np.all(low <= point) and np.all(point <= high)
