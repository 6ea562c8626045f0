"""Single-token target decodes inside real generations: plain decoding against the defaults, the
first 6 structured prompts constrained to their schemas, each prompt run by both in turn from empty
caches. Median and mean ms inside llama_decode (prefill left out), and the mean context."""

import collections
import json

import numpy as np

from cactus_edge import Engine, GenerationConfig
from cactus_edge.bench import load_structured

engine = Engine.from_pair("default", n_ctx=4096)
target = engine.target
decodes: list[tuple[int, float, int]] = []  # (batch size, ms, cache length after)
decode = target.decode


def logged(tokens, *args, **kwargs):
    result = decode(tokens, *args, **kwargs)
    decodes.append((len(tokens), target.last_decode_ms, target.n_past))
    return result


target.decode = logged
single_ms: dict[str, list[float]] = collections.defaultdict(list)
context: dict[str, list[int]] = collections.defaultdict(list)
for entry in load_structured()[:6]:
    for method in ("none", "cactus"):
        engine.clear_caches()
        decodes.clear()
        config = GenerationConfig(
            method=method, max_tokens=256, seed=0, json_schema=json.dumps(entry["json_schema"])
        )
        engine.chat([{"role": "user", "content": entry["prompt"]}], config)
        for n_tokens, ms, n_past in decodes[1:]:
            if n_tokens == 1:
                single_ms[method].append(ms)
                context[method].append(n_past)
for method, values in single_ms.items():
    print(
        method,
        f"single-token decodes {len(values)}, median {np.median(values):.2f} ms,"
        f" mean {np.mean(values):.2f} ms,"
        f" mean context {np.mean(context[method]):.0f}",
    )
