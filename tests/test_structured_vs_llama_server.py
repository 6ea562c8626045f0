"""scripts/structured_vs_llama_server.py without servers: the variants it starts and its table."""

from types import SimpleNamespace

import pytest

from .conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("structured_vs_llama_server")


def test_llama_servers_draft_model_is_switched_on_explicitly(script):
    """With -md alone today's llama-server loads the draft and never drafts: the variant must ask
    for draft-simple speculation, with the draft length given."""
    args = SimpleNamespace(llama_server="llama-server", threads=2, k=3)
    commands = script.variants(args, "draft.gguf", "target.gguf")
    speculative = commands["llama-server, -md k = 3"]
    assert speculative[speculative.index("-md") + 1] == "draft.gguf"
    assert speculative[speculative.index("--spec-type") + 1] == "draft-simple"
    assert speculative[speculative.index("--spec-draft-n-max") + 1] == "3"
    assert "--method" not in commands["cactus-edge, defaults"]
    assert commands["cactus-edge, plain"][-2:] == ["--method", "none"]


def test_the_table_gives_per_prompt_ratios_to_the_same_servers_plain_run(script):
    def rows(*rates, drafted=None):
        return [
            {"decode_tps": r, "valid_json": True, "draft_n": drafted, "draft_n_accepted": drafted and 1,
             "wall_s": 1.0}
            for r in rates
        ]  # fmt: skip

    results = {
        "llama-server, plain": rows(20.0, 10.0),
        "llama-server, -md k = 3": rows(10.0, 10.0, drafted=4),
        "cactus-edge, plain": rows(30.0, 20.0),
        "cactus-edge, defaults": rows(33.0, 24.0),
    }
    lines = script.table(results).splitlines()
    assert "| llama-server, -md k = 3 | 10.00 | 0.75× (0.50–1.00) | 2/2 | 2/8 | 2 |" in lines
    assert "| cactus-edge, defaults | 28.50 | 1.15× (1.10–1.20) | 2/2 | – | 2 |" in lines
