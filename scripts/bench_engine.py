#!/usr/bin/env python3
"""Speed and acceptance of every method on a model pair, interleaved with plain decoding.

For each prompt, every method runs once with the same seed (method A, B, C on prompt 1, then
prompt 2, …) after a warm-up, so ratios to `none` survive a noisy machine. Prints a Markdown table
and writes every raw number to JSON.

    .venv/bin/python scripts/bench_engine.py --pair default --n-draft 4 --max-tokens 96 --out bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys

from cactus_edge.engine import Engine, GenerationConfig

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Rewrite this function with a list comprehension:\n\ndef squares(xs):\n    out = []\n"
    "    for x in xs:\n        out.append(x * x)\n    return out",
    "Explain what a hash map is in two sentences.",
    "A shop sells pens at 3 dollars each. Tom buys 7 pens and pays with a 50 dollar note. "
    "How much change does he get? Answer step by step.",
]
METHODS = [("none", 0.0), ("exact", 0.0), ("sps", 0.0), ("tas", 0.0), ("cactus", 0.5), ("cactus", 1.0)]


def label(method: str, delta: float) -> str:
    return f"cactus δ={delta:g}" if method == "cactus" else method


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", default="default")
    parser.add_argument("--n-draft", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="How many bundled prompts.")
    parser.add_argument("--out", default=None, help="Write raw results as JSON here.")
    args = parser.parse_args()

    engine = Engine.from_pair(args.pair, n_ctx=args.n_ctx)
    settings = dict(temperature=0.6, top_p=0.95, top_k=20, max_tokens=args.max_tokens, n_draft=args.n_draft)
    engine.chat(
        [{"role": "user", "content": "Hi"}], GenerationConfig(method="sps", **{**settings, "max_tokens": 8})
    )
    rows: dict[str, list[dict]] = {label(m, d): [] for m, d in METHODS}
    for index, prompt in enumerate(PROMPTS[: args.prompts]):
        for method, delta in METHODS:
            config = GenerationConfig(method=method, delta=delta or 1.0, seed=index, **settings)
            result = engine.chat([{"role": "user", "content": prompt}], config)
            rows[label(method, delta)].append({"prompt": index, **result.stats.summary()})
            print(
                f"prompt {index} {label(method, delta):<12} {result.stats.tokens_per_second:6.2f} tok/s "
                f"AL {result.stats.acceptance_length:.2f}",
                file=sys.stderr,
            )

    baseline = [r["tokens_per_second"] for r in rows["none"]]
    print(
        f"\n{args.pair} pair, n_draft {args.n_draft}, temperature 0.6, top-p 0.95, top-k 20, "
        f"{args.max_tokens} tokens x {args.prompts} prompts, {platform.machine()} {platform.system()}"
    )
    print(
        "| method | AL (drafts accepted / verifier call) | tokens / verifier call | tok/s | "
        "speedup vs none (median, min-max) | draft ms/step | verify ms/step | overhead ms/step | mean KL |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for name, runs in rows.items():
        calls = sum(r["n_verifier_calls"] for r in runs)
        tokens = sum(r["n_tokens"] for r in runs)
        accepted = sum(r["n_accepted"] for r in runs)
        speedups = [r["tokens_per_second"] / b for r, b in zip(runs, baseline, strict=True)]
        kls = [r["kl_mean"] for r in runs if r["kl_mean"] is not None]
        entry = {
            "acceptance_length": accepted / calls,
            "tokens_per_verifier_call": tokens / calls,
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
            "speedup_median": statistics.median(speedups),
            "speedup_min": min(speedups),
            "speedup_max": max(speedups),
            "draft_ms_per_step": sum(r["draft_ms"] for r in runs) / calls,
            "verify_ms_per_step": sum(r["verify_ms"] for r in runs) / calls,
            "overhead_ms_per_step": sum(r["overhead_ms"] for r in runs) / calls,
            "kl_mean": statistics.mean(kls) if kls else None,
        }
        summary[name] = entry
        kl = f"{entry['kl_mean']:.4f}" if entry["kl_mean"] is not None else "0"
        print(
            f"| {name} | {entry['acceptance_length']:.2f} | {entry['tokens_per_verifier_call']:.2f} | "
            f"{entry['tokens_per_second']:.2f} | {entry['speedup_median']:.2f} "
            f"({entry['speedup_min']:.2f}-{entry['speedup_max']:.2f}) | {entry['draft_ms_per_step']:.0f} | "
            f"{entry['verify_ms_per_step']:.0f} | {entry['overhead_ms_per_step']:.1f} | {kl} |"
        )
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
        1024**2 if sys.platform == "darwin" else 1024
    )
    print(f"\npeak RSS: {peak_rss_mb:.0f} MB (n_ctx {args.n_ctx})")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(
                {"args": vars(args), "summary": summary, "runs": rows, "peak_rss_mb": peak_rss_mb},
                handle,
                indent=2,
            )


if __name__ == "__main__":
    main()
