"""What a verify's logits rows cost: the default target alone, a batch of 5 tokens with 5, 1 or 0
logits rows, and one token, 8 repeats each (median ms inside llama_decode)."""

import numpy as np

from cactus_edge import Engine

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
VARIANTS = {"5 tok, 5 rows": (5, [0, 1, 2, 3, 4]), "5 tok, 1 row": (5, [4]), "5 tok, 0 rows": (5, []),
            "1 tok, 1 row": (1, [0])}

engine = Engine.from_pair("default")
target = engine.target
tokens = target.tokenize(CODE * 3)
target.decode(tokens, output_rows=[-1])
base = target.n_past
times: dict[str, list[float]] = {label: [] for label in VARIANTS}
for _ in range(8):
    for label, (n_tokens, rows) in VARIANTS.items():
        target.decode(tokens[:n_tokens], output_rows=rows, copy=False)
        times[label].append(target.last_decode_ms)
        target.truncate(base)
for label, values in times.items():
    print(label, "median ms", round(float(np.median(values)), 1))
