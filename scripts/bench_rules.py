#!/usr/bin/env python3
"""Time logit processing + verification per speculative step (numpy only, no model).

One step = process k draft rows and k+1 target rows (V = 151,936, the Qwen vocabulary), then
rule.verify, then (lossy rules) the per-step KL the engine reports. Logits are synthetic but
LLM-shaped: a heavy head over a Gaussian body.

    .venv/bin/python scripts/bench_rules.py [--k 8] [--repeats 50] [--max-sparse-nucleus 0]

`--max-sparse-nucleus 0` keeps top-p-only rows dense (what the code did before they became their
sparse nucleus), for before/after comparisons in one checkout.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cactus_edge import sampling
from cactus_edge.acceptance import Cactus, ExactMatch, SpeculativeSampling, TypicalAcceptance, step_kl
from cactus_edge.sampling import SamplingConfig, process_logits, sample_token

VOCAB = 151_936


def llm_like_logits(rng: np.random.Generator, n_rows: int) -> np.ndarray:
    logits = rng.standard_normal((n_rows, VOCAB)).astype(np.float32) * 2.0
    head = rng.integers(0, VOCAB, size=(n_rows, 40))
    np.put_along_axis(logits, head, rng.uniform(8, 16, size=(n_rows, 40)).astype(np.float32), axis=1)
    return logits


def time_step(rule, config, k, repeats, rng):
    draft_logits = llm_like_logits(rng, k)
    # The target mostly agrees with the draft: perturb the same logits.
    target_logits = np.concatenate([draft_logits, llm_like_logits(rng, 1)])
    target_logits += rng.standard_normal(target_logits.shape).astype(np.float32) * 0.5
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        draft_rows = [process_logits(row, config) for row in draft_logits]
        tokens = np.array([sample_token(row, rng) for row in draft_rows])
        target_rows = process_logits(target_logits, config)
        verdict = rule.verify(tokens, draft_rows, target_rows, rng)  # as the engine: no stacking copy
        step_kl(rule, draft_rows, target_rows, len(verdict.acceptance_probs))
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--max-sparse-nucleus", type=int, default=sampling.MAX_SPARSE_NUCLEUS)
    args = parser.parse_args()
    sampling.MAX_SPARSE_NUCLEUS = args.max_sparse_nucleus
    rng = np.random.default_rng(0)
    settings = {
        "top-k 20, top-p 0.95": SamplingConfig(temperature=0.6, top_k=20, top_p=0.95),
        "no top-k, top-p 0.95": SamplingConfig(temperature=0.6, top_k=0, top_p=0.95),
        "no top-k, no top-p": SamplingConfig(temperature=0.6, top_k=0, top_p=1.0),
    }
    rules = [SpeculativeSampling(), Cactus(1.0), TypicalAcceptance(), ExactMatch()]
    print(f"k = {args.k}, V = {VOCAB:,}; median ms per step (process {2 * args.k + 1} rows + verify + KL)")
    print(f"| rule | {' | '.join(settings)} |")
    print(f"|---|{'---|' * len(settings)}")
    for rule in rules:
        cells = [f"{time_step(rule, cfg, args.k, args.repeats, rng):.2f}" for cfg in settings.values()]
        print(f"| {rule!r} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
