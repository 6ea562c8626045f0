"""Single-token target decodes inside real generations, by variant: plain decoding, the defaults
with k = 0 (no drafting at all), lookup drafting only, and the defaults; the first 6 structured
prompts constrained to their schemas, each prompt run by every variant in turn from empty caches.
Median and mean ms inside llama_decode (prefill left out), by logits rows: a token after which the
grammar forces the next one is decoded with none (its row is fixed), which plain decoding does
one token at a time and speculation inside blocks. An argument "two" runs plain decoding and the
defaults only."""

import collections
import json
import sys

import numpy as np
from common import log_decodes

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
decodes = log_decodes(target)  # (tokens, logits rows, ms)
single_ms: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
for entry in load_structured()[:6]:
    for name, settings in VARIANTS.items():
        engine.clear_caches()
        decodes.clear()
        config = GenerationConfig(
            max_tokens=256, seed=0, json_schema=json.dumps(entry["json_schema"]), **settings
        )
        engine.chat([{"role": "user", "content": entry["prompt"]}], config)
        for n_tokens, n_rows, ms in decodes[1:]:
            if n_tokens == 1:
                single_ms[name, n_rows].append(ms)
for (name, n_rows), values in sorted(single_ms.items()):
    summary = f"median {np.median(values):.2f} ms, mean {np.mean(values):.2f} ms"
    print(f"{name:14s} single-token decodes with {n_rows} logits rows {len(values):4d}, {summary}")
