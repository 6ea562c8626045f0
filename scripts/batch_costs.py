#!/usr/bin/env python3
"""Verify cost by batch size, measured through the project's own backend (cactus_edge.backend).

    .venv/bin/python scripts/batch_costs.py MODEL [MODEL ...] [--sizes 1,2,3,4,5,8,9,16] \\
        [--repeats 5] [--context 256] [--threads N] [--json PATH]

For each model (registered name or GGUF path; one loaded at a time, n_ctx 2048 or its trained
context if smaller): decode a context of --context tokens (a fixed English + code text, repeated to
length), then for each batch size n take the median of --repeats decodes of n tokens with logits
for every row (as a verifier call does), timed inside llama_decode and cut back after: the one
measurement `auto` calibrates with and `bench` reports (engine.measure_batch_costs).
Reported: the median ms per batch size, as a Markdown table with the CPU model and thread count
above it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cactus_edge.backend import LlamaModel, physical_cores
from cactus_edge.engine import measure_batch_costs
from cactus_edge.errors import CactusEdgeError
from cactus_edge.gguf_info import read_gguf
from cactus_edge.machine import cpu_model_name
from cactus_edge.registry import resolve_model_path

N_CTX = 2048
CONTEXT_TEXT = (
    "Speculative decoding lets a small draft model propose a few tokens that a larger target model "
    "then checks in a single forward pass, so the output keeps the target's quality.\n\n"
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    merged, i, j = [], 0, 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            merged.append(left[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            merged.append(right[j])\n"
    "            j += 1\n"
    "    return merged + left[i:] + right[j:]\n\n"
)


def text_tokens(model: LlamaModel, n_tokens: int) -> list[int]:
    """``n_tokens`` ids of CONTEXT_TEXT repeated (BOS first if the model wants one)."""
    once = model.tokenize(CONTEXT_TEXT, add_special=False)
    repeated = once * (n_tokens // len(once) + 1)
    head = [model.bos_token] if model.add_bos and model.bos_token >= 0 else []
    return (head + repeated)[:n_tokens]


def measure_model(path: Path, sizes: list[int], repeats: int, n_context: int, threads: int | None) -> dict:
    """Median ms per batch size for one model, loaded for this call only."""
    trained = read_gguf(path).context_length
    with LlamaModel(path, n_ctx=min(N_CTX, trained or N_CTX), n_threads=threads) as model:
        if n_context + max(sizes) > model.n_ctx:
            raise SystemExit(f"error: --context + the largest size exceed {path.name}'s n_ctx {model.n_ctx}")
        context = text_tokens(model, n_context)
        model.decode(context, output_rows=())
        median_ms = measure_batch_costs(model, sizes, context[-1], repeats)
        n_threads = model.n_threads
    return {
        "model": path.name,
        "path": str(path),
        "file_bytes": path.stat().st_size,
        "threads": n_threads,
        "median_ms": median_ms,
    }


def markdown_table(results: list[dict], sizes: list[int]) -> str:
    columns = [f"{n} token{'s' if n > 1 else ''}" for n in sizes]
    lines = [f"| model | file size | {' | '.join(columns)} |", f"|---|---|{'---|' * len(sizes)}"]
    for result in results:
        cells = [f"{result['median_ms'][n]:.1f}" for n in sizes]
        lines.append(f"| {result['model']} | {result['file_bytes'] / 1e6:,.1f} MB | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def parse_sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive integers, got {text!r}")
    return sizes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+", metavar="MODEL", help="Registered name or GGUF path.")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1,2,3,4,5,8,9,16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=256, help="Tokens in the cache before each batch.")
    parser.add_argument("--threads", type=int, default=None, help="Default: physical cores.")
    parser.add_argument("--json", type=Path, default=None, help="Also save the results here.")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    paths = [resolve_model_path(name) for name in args.models]  # fail before any timing
    threads = args.threads or physical_cores()
    title = (
        f"{cpu_model_name()} · {threads} thread{'s' if threads != 1 else ''} · median ms of "
        f"{args.repeats} decodes after {args.context} context tokens, logits for every row"
    )
    print(title, flush=True)
    results = []
    for path in paths:
        results.append(measure_model(path, args.sizes, args.repeats, args.context, threads))
        print(f"measured {path.name}", flush=True)
    table = markdown_table(results, args.sizes)
    print(f"\n{title}\n\n{table}")
    if args.json:
        settings = {"sizes": args.sizes, "repeats": args.repeats, "context": args.context, "threads": threads}
        report = {"title": title, "cpu": cpu_model_name(), "settings": settings, "models": results}
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    try:
        main()
    except CactusEdgeError as error:  # unknown model, missing file, context too small, …
        raise SystemExit(f"error: {error}") from None
