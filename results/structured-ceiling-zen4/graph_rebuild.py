"""What rebuilding llama.cpp's compute graph costs a single-token decode of the default target:
plain decoding of one prompt, unconstrained (every decode one token with one logits row, so each
reuses the previous graph), run with graph reuse on and with LLAMA_GRAPH_REUSE_DISABLE=1 (each
decode rebuilds it), alternating. Median ms inside llama_decode (prefill left out)."""

import json
import os
import subprocess
import sys

import numpy as np

CHILD = """
import json
from cactus_edge import Engine, GenerationConfig
engine = Engine.from_pair("default")
target = engine.target
times = []
decode = target.decode
def logged(tokens, *args, **kwargs):
    result = decode(tokens, *args, **kwargs)
    times.append((len(tokens), target.last_decode_ms))
    return result
target.decode = logged
engine.chat([{"role": "user", "content": "Write a Python function that merges two sorted lists."}],
            GenerationConfig(method="none", max_tokens=128, seed=0))
print(json.dumps([ms for n, ms in times[1:] if n == 1]))
"""

results: dict[str, list[float]] = {"reuse on": [], "reuse off": []}
for _ in range(4):
    for label in results:
        env = dict(os.environ)
        if label == "reuse off":
            env["LLAMA_GRAPH_REUSE_DISABLE"] = "1"
        output = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
        )
        times = json.loads(output.stdout.strip().splitlines()[-1])
        results[label].append(float(np.median(times)))
        print(label, f"median {results[label][-1]:.2f} ms over {len(times)} decodes", flush=True)
