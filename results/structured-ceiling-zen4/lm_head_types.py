"""What the output projection's quantization type costs a decode: the default target as shipped
(output.weight Q6_K, which llama.cpp's CPU repack has no kernel for) against a copy re-quantized by
llama.cpp to Q4_K_M with output.weight Q4_K (every tensor re-quantized: quality not measured here).
Single-token decodes with and without their logits row, median of 12, ~230 tokens of context."""

import ctypes
import os

import gguf
import llama_cpp
import numpy as np

from cactus_edge.backend import LlamaModel, ensure_backend

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
SOURCE = "models/qwen2.5-coder-1.5b-instruct.gguf"
COPY = "/tmp/target-output-q4k.gguf"
GGML_TYPE_Q4_K = 12

ensure_backend()
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, True, 2
params.output_tensor_type = GGML_TYPE_Q4_K
assert llama_cpp.llama_model_quantize(os.fsencode(SOURCE), os.fsencode(COPY), ctypes.byref(params)) == 0
variants = {"as shipped": SOURCE, "output Q4_K": COPY}
for name, path in variants.items():
    output_type = next(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    print(f"{name}: output.weight {output_type}, {os.path.getsize(path) // 2**20} MiB")
models = {name: LlamaModel(path, n_ctx=1024) for name, path in variants.items()}
tokens = models["as shipped"].tokenize(CODE * 8)
for model in models.values():
    model.decode(tokens[:230], output_rows=[-1])
times: dict[tuple[str, int], list[float]] = {(name, rows): [] for name in models for rows in (0, 1)}
for _ in range(12):
    for name, model in models.items():
        for rows in (0, 1):
            model.decode([tokens[230]], output_rows=[0] if rows else [], copy=False)
            times[name, rows].append(model.last_decode_ms)
            model.truncate(230)
for (name, rows), values in times.items():
    print(f"{name}, {rows} logits rows: median {np.median(values):.1f} ms")
os.remove(COPY)
