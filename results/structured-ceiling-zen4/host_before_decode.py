"""Whether what the host does between two decodes changes the next decode: single-token decodes
of the default target (150–300 tokens of context), each preceded in turn by nothing, a 2 ms
sleep, 2 ms of busy Python, the top-k of 8 fresh 152k-entry rows (what processing rows touches),
or a pass over 32 MB. Median ms inside llama_decode, 24 decodes each, interleaved."""

import time

import numpy as np

from cactus_edge.backend import LlamaModel
from cactus_edge.sampling import top_k_logits

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"

model = LlamaModel("models/qwen2.5-coder-1.5b-instruct.gguf", n_ctx=4096)
tokens = model.tokenize(CODE * 12)
model.decode(tokens[:150], output_rows=[-1])
base = model.n_past
rows = np.random.default_rng(0).standard_normal((8, 151936)).astype(np.float32)


def nothing() -> None:
    pass


def sleep_2ms() -> None:
    time.sleep(0.002)


def busy_2ms() -> None:
    end = time.perf_counter() + 0.002
    while time.perf_counter() < end:
        pass


def top_k_of_8_rows() -> None:
    for row in rows:
        top_k_logits(row[None], 20)


def pass_over_32mb() -> None:
    np.ones(8 * 2**20, dtype=np.float32).sum()


kinds = [nothing, sleep_2ms, busy_2ms, top_k_of_8_rows, pass_over_32mb]
times: dict[str, list[float]] = {kind.__name__: [] for kind in kinds}
for index in range(24 * len(kinds)):
    kind = kinds[index % len(kinds)]
    if model.n_past > 300:
        model.truncate(base)
    kind()
    model.decode([tokens[model.n_past % 300]], output_rows=[0], copy=False)
    times[kind.__name__].append(model.last_decode_ms)
for name, values in times.items():
    print(f"{name:16s} median {np.median(values):.2f} ms")
