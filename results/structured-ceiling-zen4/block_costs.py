"""What a block of n tokens costs the default target against one token, with logits for every row
or for the last only (the cheapest a block can be: rows the grammar fixes need none). Median of 6,
ms inside llama_decode. n * t(1) / t(n) is the most any drafter could gain with blocks of n, every
draft free and accepted. An argument gives the number of times the code is repeated in the
context (3 by default, about 100 tokens; 12 is about 400)."""

import sys

import numpy as np

from cactus_edge import Engine

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)

engine = Engine.from_pair("default")
target = engine.target
tokens = target.tokenize(CODE * (int(sys.argv[1]) if len(sys.argv) > 1 else 3))
print("context", len(tokens), "tokens")
target.decode(tokens, output_rows=[-1])
base = target.n_past
times: dict[tuple[int, str], list[float]] = {(n, rows): [] for n in SIZES for rows in ("all", "last")}
for _ in range(6):
    for n, rows in times:
        target.decode(tokens[:n], output_rows=list(range(n)) if rows == "all" else [n - 1], copy=False)
        times[n, rows].append(target.last_decode_ms)
        target.truncate(base)
one = float(np.median(times[1, "all"]))
for rows in ("all", "last"):
    cells = []
    for n in SIZES:
        ms = float(np.median(times[n, rows]))
        cells.append(f"{n}: {ms:.0f} ms ({n * one / ms:.2f}x)")
    print(f"logits for {rows} rows:", ", ".join(cells))
