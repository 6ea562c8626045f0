"""The most forced tokens can give against plain decoding under the same grammar, on this CPU.

Plain constrained decoding decodes every token one at a time, and needs no logits row where the
grammar forces the next token (the row is fixed): 578 such decodes and 732 with a row, for the
replies of forced_runs.py. Speculation at best verifies each forced run in one block with the
free token before it, logits for the block's last row only, and decodes every other free token
alone (566 of them). This measures, in one run, a single-token decode with and without its logits
row and blocks of 2–9 tokens with one row (median of 8, ~230 tokens of context, ms inside
llama_decode), and prints the ratio of the two totals."""

import numpy as np

from cactus_edge import Engine

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
RUNS = {1: 23, 2: 8, 3: 67, 4: 33, 5: 18, 6: 6, 7: 8, 8: 3}  # forced_runs.txt: run length → count
N_FORCED, N_FREE = 578, 732

engine = Engine.from_pair("default")
target = engine.target
tokens = target.tokenize(CODE * 8)
target.decode(tokens[:230], output_rows=[-1])
base = target.n_past
shapes = [(1, 0), (1, 1), *[(n, 1) for n in range(2, 10)]]
times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
for _ in range(8):
    for n_tokens, n_rows in shapes:
        target.decode(tokens[230 : 230 + n_tokens], output_rows=[n_tokens - 1] if n_rows else [], copy=False)
        times[n_tokens, n_rows].append(target.last_decode_ms)
        target.truncate(base)
cost = {shape: float(np.median(values)) for shape, values in times.items()}
print("ms:", ", ".join(f"{n} tokens {rows} rows {ms:.1f}" for (n, rows), ms in cost.items()))
plain = N_FORCED * cost[1, 0] + N_FREE * cost[1, 1]
blocks = sum(count * cost[length + 1, 1] for length, count in RUNS.items())
speculative = blocks + (N_FREE - sum(RUNS.values())) * cost[1, 1]
print(
    f"plain {plain / 1000:.1f} s, forced runs in blocks {speculative / 1000:.1f} s:",
    f"ceiling {plain / speculative:.3f}x",
)
print(
    f"(against plain decoding that computed every row: {(N_FORCED + N_FREE) * cost[1, 1] / speculative:.3f}x)"
)
