"""Whether single-token decodes slow down while blocks run among them (as in speculation), over
phases of ~15 s: singles only, then one 5-token block (decoded, then cut from the cache) every
third step, alternating, 3 times each. Median ms inside llama_decode of the singles per phase."""

import time

import numpy as np

from cactus_edge.backend import LlamaModel

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"

model = LlamaModel("models/qwen2.5-coder-1.5b-instruct.gguf", n_ctx=4096)
tokens = model.tokenize(CODE * 12)
model.decode(tokens[:150], output_rows=[-1])
base = model.n_past
for repeat in range(3):
    for with_blocks in (False, True):
        singles: list[float] = []
        end = time.monotonic() + 15
        step = 0
        while time.monotonic() < end:
            if model.n_past > 300:
                model.truncate(base)
            if with_blocks and step % 3 == 2:
                start = model.n_past
                model.decode(tokens[start : start + 5], output_rows=[4], copy=False)
                model.truncate(start)
            model.decode([tokens[model.n_past]], output_rows=[0], copy=False)
            singles.append(model.last_decode_ms)
            step += 1
        label = "with blocks" if with_blocks else "singles only"
        print(
            f"repeat {repeat}, {label:12s}: {len(singles)} singles, median {np.median(singles):.2f} ms",
            flush=True,
        )
