"""End-to-end distribution checks: the first token a generation emits, over many seeds."""

import numpy as np

from cactus_edge.config import GenerationConfig


def first_token_counts(engine, prompt_tokens, n_runs=3000, **settings):
    """(counts of the first emitted token per id over n_runs seeds, how many runs accepted a
    draft as that token). settings: GenerationConfig fields; max_tokens defaults to 3."""
    settings = {"max_tokens": 3, **settings}
    counts = np.zeros(engine.target.vocab_size, dtype=np.int64)
    accepted_first = 0
    for seed in range(n_runs):
        result = engine.generate(prompt_tokens, GenerationConfig(seed=seed, **settings))
        counts[result.tokens[0]] += 1
        accepted_first += result.stats.steps[0].n_accepted > 0
    return counts, accepted_first
