"""The host-overhead work of the engine (logits read in place, top-k by groups, numpy batch
filling, the matrix form of the per-step KL) must not change a single output token: fixed-k
generations on the tiny pair equal, token for token and seed for seed, those of the reference
implementations they replaced, patched back in."""

import numpy as np
import pytest

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.llama import model as backend
from cactus_edge.rules import acceptance, sampling

PROMPT = "the water is hot and the water is hot and"


def reference_top_k(rows: np.ndarray, n_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """Full sort of every row: slow and obviously right."""
    ids = np.argsort(-rows, axis=-1, kind="stable")[:, :n_keep].astype(np.int64)
    return ids, np.take_along_axis(rows, ids, axis=-1)


def per_token_fill(self, ids, position, output_rows):
    """How the batch was filled before: five ctypes writes per token."""
    for i, token in enumerate(ids):
        self.batch.token[i] = int(token)
        self.batch.pos[i] = position + i
        self.batch.n_seq_id[i] = 1
        self.batch.seq_id[i][0] = 0
        self.batch.logits[i] = 1 if i in list(output_rows) else 0


def use_reference_paths(monkeypatch) -> None:
    decode = backend.LlamaModel.decode
    monkeypatch.setattr(backend.LlamaModel, "decode", lambda self, *a, copy=True, **k: decode(self, *a, **k))
    monkeypatch.setattr(sampling, "top_k_logits", reference_top_k)
    monkeypatch.setattr(backend._BatchArrays, "fill", per_token_fill)
    monkeypatch.delattr(acceptance.SpeculativeSampling, "output_on_columns")
    monkeypatch.delattr(acceptance.TypicalAcceptance, "output_on_columns")


CASES = {
    "sps k4 paper": {"method": "sps", "n_draft": 4},
    "cactus k4 paper": {"method": "cactus", "delta": 1.0, "n_draft": 4},
    "tas k3": {"method": "tas", "n_draft": 3},
    "exact k2": {"method": "exact", "n_draft": 2},
    "cactus k3 budget": {"method": "cactus", "n_draft": 3, "kl_budget": 0.5},
    "sps k4 dense": {"method": "sps", "n_draft": 4, "top_k": 0, "top_p": 1.0, "temperature": 1.0},
    "cactus k3 top-p": {"method": "cactus", "n_draft": 3, "top_k": 0, "top_p": 0.9},
    "cactus k4 model+lookup": {"method": "cactus", "n_draft": 4, "drafter": "model+lookup"},
    "sps k4 greedy": {"method": "sps", "n_draft": 4, "temperature": 0.0},
}


def generate_fresh(engine, config):
    """From empty caches: every compared run decodes the prompt in the same batch shapes (a reused
    prefix would change llama.cpp's rounding, and a sample can follow)."""
    engine.clear_caches()
    return engine.generate(PROMPT, config)


@pytest.mark.parametrize("settings", CASES.values(), ids=CASES.keys())
def test_fast_paths_change_no_token(engine, monkeypatch, settings):
    # Groups of 4 ids, so that the tiny vocabulary (642 ids) takes the grouped top-k path too.
    monkeypatch.setattr(sampling, "_GROUP_SIZE", 4)
    results = {}
    for path in ("fast", "reference"):
        if path == "reference":
            use_reference_paths(monkeypatch)
        configs = [GenerationConfig(max_tokens=48, seed=seed, **settings) for seed in (0, 1, 2)]
        results[path] = [generate_fresh(engine, config) for config in configs]
    assert sum(r.stats.n_accepted for r in results["fast"]) > 0  # drafts were really verified
    for fast, reference in zip(results["fast"], results["reference"], strict=True):
        assert fast.tokens == reference.tokens
        assert fast.stats.accepted_by_position == reference.stats.accepted_by_position
        assert fast.stats.kl_total == pytest.approx(reference.stats.kl_total, abs=1e-9)
