"""Every target decode of the defaults on the first 5 structured prompts (constrained, 256 tokens):
(tokens in the batch, logits rows) → how many, median ms inside llama_decode (prefill left out)."""

import collections
import json

import numpy as np
from common import log_decodes

from cactus_edge import Engine, GenerationConfig
from cactus_edge.bench import load_structured

engine = Engine.from_pair("default", n_ctx=4096)
target = engine.target
decodes = log_decodes(target)  # (tokens, logits rows, ms)
by_shape: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
for entry in load_structured()[:5]:
    engine.clear_caches()
    decodes.clear()
    config = GenerationConfig(max_tokens=256, seed=0, json_schema=json.dumps(entry["json_schema"]))
    engine.chat([{"role": "user", "content": entry["prompt"]}], config)
    for n_tokens, n_rows, ms in decodes[1:]:
        by_shape[n_tokens, n_rows].append(ms)
for (n_tokens, n_rows), times in sorted(by_shape.items()):
    print(f"{n_tokens} tokens, {n_rows} logits rows: {len(times)} decodes, median {np.median(times):.1f} ms")
