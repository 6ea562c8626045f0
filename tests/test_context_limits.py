"""Prompts around every context boundary never reach a native assert (issue 23): llama.cpp rounds a
small requested context up (128 → 256) while capping its batch at the requested size, and a batch
sized for the rounded context aborted the process (GGML_ASSERT n_tokens_all <= n_batch). Each
requested size runs in a subprocess, so an abort fails its test instead of killing pytest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .tiny_gguf import write_tiny_llama

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny pair with a 4,096-token trained context (the default n_ctx)."""
    folder = tmp_path_factory.mktemp("long-context")
    draft = write_tiny_llama(folder / "draft.gguf", seed=1, n_ctx_train=4096)
    target = write_tiny_llama(folder / "target.gguf", seed=2, base_seed=1, noise=0.2, n_ctx_train=4096)
    return draft, target


def _probe(pair, n_ctx: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.context_probe", str(pair[0]), str(pair[1]), str(n_ctx)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n_ctx", [100, 128, 300, 512, 4096])
def test_prompts_around_the_context_end_in_a_finish_or_a_typed_error(long_pair, n_ctx):
    report = _probe(long_pair, n_ctx)
    allocated = report["n_ctx"]
    assert allocated >= n_ctx
    for label, length, outcome in report["outcomes"]:
        if length >= allocated:  # no room for one generated token
            assert outcome == "ContextLengthError", (label, length, outcome)
        else:
            assert outcome in ("stop", "length"), (label, length, outcome)
    # A conversation that grows past the context ends with a typed error, never an abort.
    assert report["conversation"][-1] == "ContextLengthError", report["conversation"]
    assert set(report["conversation"][:-1]) <= {"stop", "length"}
