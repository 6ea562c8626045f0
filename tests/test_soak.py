"""scripts/soak.py on the tiny pair: a short soak runs every exit path and finds no inconsistency."""

import pytest

from cactus_edge.engine.engine import Engine

from .conftest import TEST_THREADS, load_script


@pytest.fixture(scope="module")
def soak_module():
    return load_script("soak")


def test_a_short_soak_on_the_tiny_pair_is_consistent(soak_module, tiny_pair):
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=256, n_threads=TEST_THREADS) as engine:
        result = soak_module.soak(engine, turns=21, max_tokens=24)
    assert result["problems"] == []
    assert {"cancelled", "closed"} <= set(result["finishes"])
    assert result["dropped_exchanges"] > 0  # the context filled and old exchanges were dropped
    assert [s["turn"] for s in result["samples"]] == [0, 10, 20]
