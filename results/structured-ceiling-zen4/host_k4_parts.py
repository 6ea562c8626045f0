"""Where the host work of a constrained step at k = 4 goes: the functions that process rows and
follow the grammar, each timed inside the engine (calls and ms per step, µs per call; nested
functions count in their callers too). The first 3 structured prompts, 160 tokens, the draft model."""

import collections
import json
import time

import cactus_edge.constraints as constraints
import cactus_edge.drafters as drafters
import cactus_edge.engine as engine_module
import cactus_edge.grammar as grammar
from cactus_edge import Engine, GenerationConfig
from cactus_edge.bench import load_structured

seconds: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()


def timed(owner, name: str, label: str) -> None:
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


for module, name in [
    (drafters, "process_decoded"),
    (drafters, "process_candidates"),
    (engine_module, "merge_rows"),
    (engine_module, "fixed_rows"),
    (engine_module, "step_kl"),
    (constraints, "top_k_logits"),
]:
    timed(module, name, f"{module.__name__.split('.')[-1]}.{name}")
for cls, name in [
    (grammar.GrammarMatcher, "mask"),
    (grammar.GrammarMatcher, "consume"),
    (grammar.GrammarMatcher, "forced"),
    (grammar.TokenMask, "sole_id"),
    (grammar.TokenMask, "allowed_ids"),
    (constraints.LogitShaper, "candidates"),
    (constraints.LogitShaper, "take_forced"),
    (constraints.LogitShaper, "advance"),
]:
    timed(cls, name, f"{cls.__name__}.{name}")

engine = Engine.from_pair("default", n_ctx=4096)
n_steps = 0
for entry in load_structured()[:3]:
    config = GenerationConfig(
        n_draft=4, drafter="model", max_tokens=160, seed=0, json_schema=json.dumps(entry["json_schema"])
    )
    engine.clear_caches()
    n_steps += engine.chat([{"role": "user", "content": entry["prompt"]}], config).stats.n_verifier_calls
print("steps", n_steps)
for label in sorted(seconds, key=lambda label: -seconds[label]):
    per_call = seconds[label] * 1e6 / calls[label]
    per_step = seconds[label] * 1000 / n_steps
    print(
        f"{label:30s} per step {calls[label] / n_steps:5.2f} ms/step {per_step:6.3f} µs/call {per_call:6.1f}"
    )
