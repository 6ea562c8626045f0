#!/usr/bin/env python3
"""Peak RSS of loading a pair and generating, at two context sizes, each in a fresh process.

If anything allocated n_ctx × n_vocab logits (llama.cpp's logits_all), going from n_ctx 512 to
4096 would add 3584 × 151,936 × 4 B ≈ 2.2 GB on the Qwen pair; the KV caches alone add ~0.1 GB.

    .venv/bin/python scripts/measure_memory.py --pair default
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, sys
from cactus_edge.bench import peak_rss_mb
from cactus_edge.engine import Engine, GenerationConfig
engine = Engine.from_pair(sys.argv[1], n_ctx=int(sys.argv[2]))
engine.chat([{"role": "user", "content": "Write a haiku about memory."}],
            GenerationConfig(method="cactus", n_draft=4, max_tokens=48, seed=0))
print(json.dumps({"n_ctx": int(sys.argv[2]), "peak_rss_mb": peak_rss_mb()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", default="default")
    parser.add_argument("--n-ctx", type=int, nargs="+", default=[512, 4096])
    args = parser.parse_args()
    results = []
    for n_ctx in args.n_ctx:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, args.pair, str(n_ctx)], check=True, capture_output=True, text=True
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"n_ctx {n_ctx:>6}: peak RSS {results[-1]['peak_rss_mb']:.0f} MB")
    if len(results) >= 2:
        grow = results[-1]["peak_rss_mb"] - results[0]["peak_rss_mb"]
        print(f"growth from n_ctx {results[0]['n_ctx']} to {results[-1]['n_ctx']}: {grow:.0f} MB")


if __name__ == "__main__":
    main()
