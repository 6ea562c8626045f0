#!/usr/bin/env python3
"""Side-by-side server benchmark: `cactus-edge serve` against llama-cpp-python's own server
(`python -m llama_cpp.server`, same target GGUF, same prompts and sampling settings), in one run.

C concurrent clients x R requests each, through the `openai` client, streaming. Reports time to
first token (p50/p95), per-request decode tokens/s and aggregate tokens/s, and ours / theirs as a
ratio. Rounds alternate between the servers (ours, theirs, ours, ...) so drift hits both alike; a
server idles while the other runs (two llama.cpp processes computing at once on 2 cores slow each
other far more than 2x: see SPEC, "Hardware facts"). With --direct it also times the same requests
on an in-process Engine (one client), which bounds our server's own overhead.

Needs llama-cpp-python's server extra (pip install 'llama-cpp-python[server]'). Timing run: run it
on an otherwise idle machine and name the CPU with the numbers, e.g.

    .venv/bin/python scripts/bench_server.py --pair default --clients 1,4 --requests 4 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in three sentences what a hash map is.",
    "Write a bash one-liner that counts the lines of every .py file in a directory tree.",
    "Summarize the rules of tic-tac-toe.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "What is the difference between a process and a thread?",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}: {_log_tail(process)}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become ready within {timeout} s")


def _popen(command: list[str], stdout, name: str) -> subprocess.Popen:
    """Start a server with its stderr in a file: an undrained pipe fills up (llama.cpp logs a
    lot) and blocks the server mid-benchmark."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", prefix=f"bench-server-{name}-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, stdout=stdout, stderr=log, text=True)  # the child keeps its fd
    process.log_path = log.name
    return process


def _log_tail(process: subprocess.Popen, n_chars: int = 2000) -> str:
    return Path(process.log_path).read_text()[-n_chars:]


def start_ours(args) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "cactus_edge.cli", "serve", "--port", "0", "--json"]
    command += ["--n-ctx", str(args.n_ctx), "--method", args.method, "--n-draft", args.n_draft]
    command += ["--draft", args.draft, "--target", args.target] if args.target else ["--pair", args.pair]
    if args.threads:
        command += ["--threads", str(args.threads)]
    process = _popen(command, subprocess.PIPE, "cactus-edge")
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        ready = json.loads(lines.get(timeout=600))
    except queue.Empty:
        process.kill()
        raise SystemExit("cactus-edge serve did not print its ready line") from None
    return process, ready["url"]


def start_theirs(args, target_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", target_path, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--n_ctx", str(args.n_ctx)]
    if args.threads:
        command += ["--n_threads", str(args.threads)]
    process = _popen(command, subprocess.DEVNULL, "llama_cpp")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process)
    return process, url


def one_request(url: str, model: str, prompt: str, args, seed: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    begin = time.perf_counter()
    first = None
    pieces = 0
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": args.top_k},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            if first is None:
                first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    # llama_cpp.server sends no usage in streams: count content chunks (one per token) instead.
    tokens = usage.completion_tokens if usage else pieces
    first = first or end
    return {"ttft": first - begin, "tokens": tokens, "decode_s": end - first, "total_s": end - begin}


def run_phase(url: str, model: str, args, clients: int, round_index: int) -> dict:
    jobs = [
        (PROMPTS[(c * args.requests + r) % len(PROMPTS)], 1000 * round_index + c * args.requests + r)
        for c in range(clients)
        for r in range(args.requests)
    ]

    def client_run(c: int) -> list[dict]:
        mine = jobs[c * args.requests : (c + 1) * args.requests]
        return [one_request(url, model, prompt, args, seed) for prompt, seed in mine]

    begin = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client_run, range(clients)) for r in rs]
    wall = time.perf_counter() - begin
    return {"results": results, "wall_s": wall}


def run_direct(args, round_index: int) -> dict:
    from cactus_edge.engine import Engine, GenerationConfig

    n_draft = args.n_draft if args.n_draft == "auto" else int(args.n_draft)
    if args.target:
        engine = Engine.load(args.draft, args.target, n_ctx=args.n_ctx, n_threads=args.threads)
    else:
        engine = Engine.from_pair(args.pair, n_ctx=args.n_ctx, n_threads=args.threads)
    results = []
    with engine:
        for r in range(args.requests):
            config = GenerationConfig(
                method=args.method,
                n_draft=n_draft,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                max_tokens=args.max_tokens,
                seed=1000 * round_index + r,
            )
            begin = time.perf_counter()
            first = None
            for event in engine.stream_chat([{"role": "user", "content": PROMPTS[r % len(PROMPTS)]}], config):
                if event.text and first is None:
                    first = time.perf_counter()
                if event.finish_reason is not None:
                    tokens = event.stats.n_tokens
            end = time.perf_counter()
            first = first or end
            results.append(
                {"ttft": first - begin, "tokens": tokens, "decode_s": end - first, "total_s": end - begin}
            )
    return {"results": results, "wall_s": sum(r["total_s"] for r in results)}


def summarize(phases: list[dict]) -> dict:
    results = [r for phase in phases for r in phase["results"]]
    ttfts = sorted(r["ttft"] for r in results)
    rates = [r["tokens"] / r["decode_s"] for r in results if r["decode_s"] > 0]
    tokens = sum(r["tokens"] for r in results)
    wall = sum(phase["wall_s"] for phase in phases)
    p95 = ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]
    return {
        "requests": len(results),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p95_ms": 1000 * p95,
        "decode_tok_s": statistics.mean(rates) if rates else 0.0,
        "aggregate_tok_s": tokens / wall if wall else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", default="default")
    parser.add_argument("--draft")
    parser.add_argument("--target")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--method", default="cactus")
    parser.add_argument("--n-draft", default="auto")
    parser.add_argument("--clients", default="1,4", help="comma-separated concurrency levels C")
    parser.add_argument("--requests", type=int, default=4, help="requests per client R")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--direct", action="store_true", help="also time an in-process Engine (C = 1)")
    parser.add_argument("--out", default="bench-out/server.json")
    args = parser.parse_args()

    if args.target:
        target_path = args.target
    else:
        from cactus_edge.registry import load_registry, resolve_model_path

        target_path = str(resolve_model_path(load_registry().pair(args.pair).target))
    levels = [int(c) for c in args.clients.split(",") if c]
    ours, ours_url = start_ours(args)
    theirs = None
    try:
        theirs, theirs_url = start_theirs(args, target_path)
        ours_model = Path(target_path).name.removesuffix(".gguf")
        runs: dict[str, dict[int, list]] = {"cactus-edge": {c: [] for c in levels}, "llama_cpp.server": {}}
        runs["llama_cpp.server"] = {c: [] for c in levels}
        for round_index in range(args.rounds):
            for clients in levels:
                print(f"round {round_index + 1}/{args.rounds}, C={clients}: cactus-edge", file=sys.stderr)
                runs["cactus-edge"][clients].append(
                    run_phase(ours_url, ours_model, args, clients, round_index)
                )
                print(
                    f"round {round_index + 1}/{args.rounds}, C={clients}: llama_cpp.server", file=sys.stderr
                )
                runs["llama_cpp.server"][clients].append(
                    run_phase(theirs_url, target_path, args, clients, round_index)
                )
    finally:
        for process in (ours, theirs):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
    direct = None
    if args.direct:  # after both servers are gone: nothing else computes meanwhile
        direct = summarize([run_direct(args, r) for r in range(args.rounds)])

    rows, summary = [], {}
    for clients in levels:
        mine = summarize(runs["cactus-edge"][clients])
        other = summarize(runs["llama_cpp.server"][clients])
        summary[clients] = {"cactus-edge": mine, "llama_cpp.server": other}
        ratio = (
            mine["aggregate_tok_s"] / other["aggregate_tok_s"] if other["aggregate_tok_s"] else float("nan")
        )
        for name, s in (("cactus-edge", mine), ("llama_cpp.server", other)):
            rows.append(
                f"| {clients} | {name} | {s['ttft_p50_ms']:.0f} | {s['ttft_p95_ms']:.0f} | "
                f"{s['decode_tok_s']:.1f} | {s['aggregate_tok_s']:.1f} | "
                f"{f'{ratio:.2f}x' if name == 'cactus-edge' else ''} |"
            )
    header = (
        f"{platform.processor() or platform.machine()} · {os.cpu_count()} cores · {args.method} · "
        f"{args.max_tokens} tokens · temperature {args.temperature}, top-p {args.top_p}, "
        f"top-k {args.top_k} · "
        f"R = {args.requests} · {args.rounds} rounds\n\n"
        "| C | server | TTFT p50 ms | TTFT p95 ms | decode tok/s | aggregate tok/s | ours/theirs |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    table = header + "\n".join(rows) + "\n"
    if direct is not None:
        table += f"\nIn-process Engine (C = 1): {direct['decode_tok_s']:.1f} decode tok/s, TTFT p50 "
        table += (
            f"{direct['ttft_p50_ms']:.0f} ms; compare with cactus-edge at C = 1 for the server's overhead.\n"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "summary": summary, "direct": direct}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
