#!/usr/bin/env python3
"""The bundled `structured` prompts (replies constrained to a JSON schema) through llama.cpp's own
`llama-server` and through `cactus-edge serve`, each plain and with its speculation, one server at
a time (two llama.cpp processes computing at once on 2 cores slow each other far more than 2x).

Each request is a non-streamed chat completion with `response_format: {"type": "json_schema", …}`,
the paper's sampling settings and a per-prompt seed. Decode tokens/s comes from each server's
llama-server-style `timings` block (`predicted_per_second`: tokens after the prompt over their
decode time); the table gives its median per variant, the median of per-prompt ratios to the same
server's plain run, whether each reply parses as JSON, and the drafts llama-server reports.

llama-server is not shipped with llama-cpp-python: build it from the llama.cpp that llama-cpp-python
vendors (its sdist's vendor/llama.cpp), e.g.

    cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON && cmake --build build --target llama-server -j2
    .venv/bin/python scripts/structured_vs_llama_server.py --llama-server build/bin/llama-server

Its draft model needs `--spec-type draft-simple`: with `-md` alone, today's llama-server loads the
draft and never drafts (its timings then have no draft_n). Run it on an otherwise idle machine and
name the CPU with the numbers.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cactus_edge.bench import load_structured
from cactus_edge.machine import cpu_model_name
from cactus_edge.registry import resolve_model_path, resolve_pair
from cactus_edge.script_args import free_port, wait_ready

START_TIMEOUT = 300  # s for a server to load and warm up
REQUEST_TIMEOUT = 600


def variants(args, draft: str, target: str) -> dict[str, list[str]]:
    """Variant name → the server command line without its port."""
    ours = [sys.executable, "-m", "cactus_edge.cli", "serve", "--draft", draft, "--target", target]
    ours += ["--threads", str(args.threads)]
    theirs = [args.llama_server, "-m", target, "--jinja", "-t", str(args.threads), "-c", "4096", "-np", "1"]
    theirs += ["--host", "127.0.0.1"]
    return {
        "llama-server, plain": theirs,
        f"llama-server, -md k = {args.k}": theirs
        + ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.k)]
        + ["-td", str(args.threads)],
        "cactus-edge, plain": [*ours, "--method", "none"],
        "cactus-edge, defaults": ours,
    }


def request_body(index: int, entry: dict, args) -> dict:
    schema = {"name": entry["id"], "schema": entry["json_schema"], "strict": True}
    return {
        "messages": [{"role": "user", "content": entry["prompt"]}],
        "response_format": {"type": "json_schema", "json_schema": schema},
        "max_tokens": args.max_tokens,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "seed": index,
    }


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def run_variant(name: str, command: list[str], prompts: list[dict], args) -> list[dict]:
    port = free_port()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    log_path = Path(args.out).with_suffix(f".{slug}.log")
    log = log_path.open("w")
    process = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    process.log_path = log_path  # for wait_ready's message if it exits
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait_ready(url, process, path="/health", timeout=START_TIMEOUT)  # /v1/models answers while loading
        for index, entry in enumerate(prompts):
            start = time.perf_counter()
            response = httpx.post(f"{url}/v1/chat/completions", json=request_body(index, entry, args),
                                  timeout=REQUEST_TIMEOUT)  # fmt: skip
            if response.status_code != 200:
                raise SystemExit(
                    f"{name}: {entry['id']} answered {response.status_code}: {response.text[:300]}"
                )
            body = response.json()
            choice, timings = body["choices"][0], body.get("timings", {})
            if timings.get("predicted_per_second") is None:
                raise SystemExit(f"{name}: no timings.predicted_per_second in the response")
            rows.append({
                "prompt": entry["id"], "finish_reason": choice["finish_reason"],
                "valid_json": parses(choice["message"]["content"] or ""),
                "tokens": body["usage"]["completion_tokens"],
                "decode_tps": timings.get("predicted_per_second"),
                "draft_n": timings.get("draft_n"), "draft_n_accepted": timings.get("draft_n_accepted"),
                "wall_s": time.perf_counter() - start,
            })  # fmt: skip
            print(f"{name:28} {entry['id']:18} {rows[-1]['decode_tps']:6.2f} tok/s", file=sys.stderr)
    finally:
        process.terminate()
        process.wait(30)
        log.close()
    return rows


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| variant | decode tok/s (median) | vs the same server's plain: median (min–max) | valid JSON "
        "| drafts accepted | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        plain = results[name.split(",")[0] + ", plain"]
        ratios = [row["decode_tps"] / base["decode_tps"] for row, base in zip(rows, plain, strict=True)]
        drafted = sum(row["draft_n"] or 0 for row in rows)
        accepted = sum(row["draft_n_accepted"] or 0 for row in rows)
        lines.append(
            f"| {name} | {statistics.median(row['decode_tps'] for row in rows):.2f} | "
            f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}) | "
            f"{sum(row['valid_json'] for row in rows)}/{len(rows)} | "
            f"{f'{accepted}/{drafted}' if drafted else '–'} | {sum(row['wall_s'] for row in rows):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True, help="Path to a llama-server binary.")
    parser.add_argument("--pair", default=None, help="Registered pair (default: 'default').")
    parser.add_argument("--k", type=int, default=3, help="llama-server's draft length with -md.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", default="bench-out/structured-vs-llama-server.json")
    args = parser.parse_args()
    draft, target = (str(resolve_model_path(name)) for name in resolve_pair(args.pair))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    prompts = load_structured()
    results: dict[str, list[dict]] = {}
    for name, command in variants(args, draft, target).items():
        results[name] = run_variant(name, command, prompts, args)
        # Written after each variant: a failure later keeps what was measured.
        Path(args.out).write_text(json.dumps({"cpu": cpu_model_name(), "results": results}, indent=1))
    print(f"{len(prompts)} structured prompts, {args.max_tokens} tokens, {cpu_model_name()}\n")
    print(table(results))


if __name__ == "__main__":
    main()
