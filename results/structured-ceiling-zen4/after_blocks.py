"""Whether blocks leave the target's cache slower for the single-token decodes after them: three
contexts of the default target reach 150 tokens by single tokens, by blocks of 5 (one logits row)
kept whole, or by blocks of 5 of which 2 are kept (rollbacks, as rejections leave them); then
single-token decodes on the three in turn. Median and mean ms inside llama_decode, 45 each."""

import numpy as np

from cactus_edge.backend import LlamaModel

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
PATH = "models/qwen2.5-coder-1.5b-instruct.gguf"

models = [LlamaModel(PATH, n_ctx=4096) for _ in range(3)]
tokens = models[0].tokenize(CODE * 12)
for model in models:
    model.decode(tokens[:100], output_rows=[-1])
singles, kept, rolled_back = models
while singles.n_past < 150:
    singles.decode([tokens[singles.n_past]], output_rows=[0], copy=False)
while kept.n_past < 150:
    kept.decode(tokens[kept.n_past : kept.n_past + 5], output_rows=[4], copy=False)
while rolled_back.n_past < 150:
    start = rolled_back.n_past
    rolled_back.decode(tokens[start : start + 5], output_rows=[4], copy=False)
    rolled_back.truncate(min(start + 2, 150))
times: list[list[float]] = [[], [], []]
for index in range(45):
    for which in ((index + shift) % 3 for shift in range(3)):
        model = models[which]
        model.decode([tokens[model.n_past]], output_rows=[0], copy=False)
        times[which].append(model.last_decode_ms)
for name, values in zip(
    ("singles only", "after kept blocks", "after blocks with rollbacks"), times, strict=True
):
    print(f"{name:28s} median {np.median(values):.2f} ms, mean {np.mean(values):.2f} ms")
