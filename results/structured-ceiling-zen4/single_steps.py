"""Single-token target decodes inside real generations, by variant: plain decoding, the defaults
with k = 0 (no drafting at all), lookup drafting only, and the defaults; the first 6 structured
prompts constrained to their schemas, each prompt run by every variant in turn from empty caches.
Median and mean ms inside llama_decode (prefill left out). An argument "two" runs plain decoding
and the defaults only (the first three runs in single_steps.txt)."""

import collections
import json
import sys

import numpy as np

from cactus_edge import Engine, GenerationConfig
from cactus_edge.bench import load_structured

VARIANTS = {
    "none": dict(method="none"),
    "cactus k=0": dict(n_draft=0),
    "cactus lookup": dict(drafter="lookup"),
    "cactus": dict(),
}
if sys.argv[1:] == ["two"]:
    VARIANTS = {"none": VARIANTS["none"], "cactus": VARIANTS["cactus"]}

engine = Engine.from_pair("default", n_ctx=4096)
target = engine.target
decodes: list[tuple[int, float]] = []
decode = target.decode


def logged(tokens, *args, **kwargs):
    result = decode(tokens, *args, **kwargs)
    decodes.append((len(tokens), target.last_decode_ms))
    return result


target.decode = logged
single_ms: dict[str, list[float]] = collections.defaultdict(list)
for entry in load_structured()[:6]:
    for name, settings in VARIANTS.items():
        engine.clear_caches()
        decodes.clear()
        config = GenerationConfig(
            max_tokens=256, seed=0, json_schema=json.dumps(entry["json_schema"]), **settings
        )
        engine.chat([{"role": "user", "content": entry["prompt"]}], config)
        single_ms[name] += [ms for n_tokens, ms in decodes[1:] if n_tokens == 1]
for name, values in single_ms.items():
    summary = f"median {np.median(values):.2f} ms, mean {np.mean(values):.2f} ms"
    print(f"{name:14s} single-token decodes {len(values):4d}, {summary}")
