#!/usr/bin/env python3
"""Side-by-side server benchmark: `cactus-edge serve` with its defaults against llama-cpp-python's
own server (`python -m llama_cpp.server`, same target GGUF, plain decoding), in one run, on three
categories of requests: mixed prompts (code, explanations, chat, math: the bundled set, --per-category
of each), code editing (the bundled code-editing prompts: pasted code to change) and the bundled
multi-turn coding conversations (each turn sent with the conversation so far, the server's own
earlier replies included, so both servers can reuse their cached prefix).

C concurrent clients x R requests each, through the `openai` client, streaming. Reports per category
and server: time to first token (p50/p95), per-request decode tokens/s (after the first token),
aggregate tokens/s (all tokens / wall time), and ours / theirs: the aggregate ratio and the median
per-request ratio of end-to-end tokens/s (the same request, turn and seed on both). Categories run
one after the other, each server in turn (ours, theirs) so drift hits both alike; a server idles
while the other runs (two llama.cpp processes computing at once on 2 cores slow each other far more
than 2x). With --direct it also times the requests on an in-process Engine (one client), which
bounds our server's own overhead.

Needs llama-cpp-python's server extra (pip install 'llama-cpp-python[server]'). Timing run: run it
on an otherwise idle machine and name the CPU with the numbers, e.g.

    .venv/bin/python scripts/bench_server.py --pair default --clients 1 --max-tokens 192
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from script_args import (
    engine_from_args,
    free_port,
    log_tail,
    model_flags,
    model_paths,
    script_parser,
    wait_ready,
)

from cactus_edge.catalog.resolve import resolve_model_path

CATEGORIES = ("mixed", "code-editing", "conversations")


def workload(category: str, per_category: int) -> list[list[str]]:
    """The requests of a category, each a list of user turns (one for a single prompt)."""
    from cactus_edge.cli.bench import load_conversations, load_prompts
    from cactus_edge.cli.bench import per_category as first_of_each

    if category == "conversations":
        return [c["turns"] for c in load_conversations()]
    if category == "code-editing":
        return [[p["prompt"]] for p in load_prompts(None, ["code-editing"])]
    mixed = [p for p in load_prompts() if p["category"] != "code-editing"]
    return [[p["prompt"]] for p in first_of_each(mixed, per_category)]


def _popen(command: list[str], stdout, name: str) -> subprocess.Popen:
    """Start a server with its stderr in a file: an undrained pipe fills up (llama.cpp logs a
    lot) and blocks the server mid-benchmark."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", prefix=f"bench-server-{name}-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, stdout=stdout, stderr=log, text=True)  # the child keeps its fd
    process.log_path = log.name
    return process


def start_ours(args) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "cactus_edge.cli.main",
        "serve",
        "--port",
        "0",
        "--json",
        *model_flags(args),
    ]
    for flag in ("method", "n_draft", "drafter"):  # none given: the server's defaults
        if getattr(args, flag):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return start_and_read_url(command, "cactus-edge")


def start_and_read_url(command: list[str], name: str, timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """Start a server whose first stdout line is a JSON ready line with its url."""
    process = _popen(command, subprocess.PIPE, name)
    lines: queue.Queue = queue.Queue()
    # None after the last line: a server that exits before its ready line is reported at once.
    threading.Thread(target=lambda: [*map(lines.put, process.stdout), lines.put(None)], daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        line = None
    if line is None:
        process.kill()
        raise SystemExit(f"{name} did not print its ready line: {log_tail(process)}")
    return process, json.loads(line)["url"]


def start_theirs(args, target_path: str) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's server, plain decoding (it reuses the longest cached prompt prefix too)."""
    port = free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", target_path, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--n_ctx", str(args.n_ctx)]
    if args.threads:
        command += ["--n_threads", str(args.threads)]
    process = _popen(command, subprocess.DEVNULL, "llama_cpp")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process)
    return process, url


def one_request(url: str, model: str, messages: list[dict], args, seed: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    begin = time.perf_counter()
    first = None
    pieces, text = 0, []
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
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
            text.append(chunk.choices[0].delta.content)
            if first is None:
                first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    # llama_cpp.server sends no usage in streams: count content chunks (one per token) instead.
    tokens = usage.completion_tokens if usage else pieces
    first = first or end
    return {
        "ttft": first - begin, "tokens": tokens, "decode_s": end - first, "total_s": end - begin,
        "text": "".join(text),
    }  # fmt: skip


def run_conversation(url: str, model: str, turns: list[str], args, seed: int) -> list[dict]:
    """One request per user turn, each with the conversation so far (this server's replies)."""
    messages, results = [], []
    for turn, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        result = one_request(url, model, messages, args, seed + turn)
        messages.append({"role": "assistant", "content": result["text"]})
        results.append({**result, "request": f"{seed}.{turn}"})
    return results


def run_phase(url: str, model: str, args, clients: int, requests: list[list[str]], round_index: int) -> dict:
    """Every request of a category, spread over ``clients`` concurrent clients."""
    jobs = [(turns, 1000 * round_index + 10 * index) for index, turns in enumerate(requests)]

    def client_run(c: int) -> list[dict]:
        return [
            r for turns, seed in jobs[c::clients] for r in run_conversation(url, model, turns, args, seed)
        ]

    begin = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client_run, range(clients)) for r in rs]
    wall = time.perf_counter() - begin
    return {"results": results, "wall_s": wall}


def run_direct(args, requests: list[list[str]], round_index: int) -> dict:
    """The same requests on an in-process Engine with the same defaults (one client)."""
    from cactus_edge.cli.bench import converse
    from cactus_edge.engine.config import GenerationConfig

    settings = {k: getattr(args, k) for k in ("method", "n_draft", "drafter") if getattr(args, k)}
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    results = []
    with engine_from_args(args) as engine:
        engine.warm_up()
        for index, turns in enumerate(requests):
            seed = 1000 * round_index + 10 * index

            def config_of_turn(turn, seed=seed):
                return GenerationConfig(**sampling, **settings, max_tokens=args.max_tokens, seed=seed + turn)

            for turn, run in enumerate(converse(engine, turns, config_of_turn)):
                results.append({
                    "ttft": run.ttft_ms / 1000, "tokens": run.stats.n_tokens, "total_s": run.total_ms / 1000,
                    "decode_s": (run.total_ms - run.ttft_ms) / 1000, "request": f"{index}.{turn}",
                })  # fmt: skip
    return {"results": results, "wall_s": sum(r["total_s"] for r in results)}


def summarize(phases: list[dict]) -> dict:
    results = [r for phase in phases for r in phase["results"]]
    ttfts = sorted(r["ttft"] for r in results)
    rates = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["decode_s"] > 0 and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in results)
    wall = sum(phase["wall_s"] for phase in phases)
    p95 = ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]
    return {
        "requests": len(results),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p95_ms": 1000 * p95,
        "decode_tok_s": statistics.median(rates) if rates else 0.0,
        "aggregate_tok_s": tokens / wall if wall else 0.0,
    }


def per_request_ratio(ours: list[dict], theirs: list[dict]) -> float:
    """Median over requests seen by both of ours / theirs end-to-end tokens/s."""

    def rate(r):
        return r["tokens"] / r["total_s"] if r["total_s"] > 0 else 0.0

    theirs_by = {r["request"]: r for r in theirs}
    ratios = [rate(r) / rate(theirs_by[r["request"]]) for r in ours if rate(theirs_by.get(r["request"], r))]
    return statistics.median(ratios) if ratios else float("nan")


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the server is still there after 30 s."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def require_their_server() -> None:
    """SystemExit naming the install command when llama-cpp-python's server extra is missing
    (before anything loads: `python -m llama_cpp.server` would only fail once ours is up)."""
    try:
        import llama_cpp.server.app  # noqa: F401  (what `python -m llama_cpp.server` imports)
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"bench_server.py runs llama-cpp-python's server, whose extra is not installed ({error}): "
            "pip install 'llama-cpp-python[server]'"
        ) from None


def build_parser():
    parser = script_parser(__doc__)
    parser.add_argument("--method", default=None, help="Ours: default, the server's default.")
    parser.add_argument("--n-draft", default=None, help="Ours: default, the server's default.")
    parser.add_argument("--drafter", default=None, help="Ours: default, the server's default.")
    parser.add_argument("--categories", default=",".join(CATEGORIES), help=f"Comma-separated: {CATEGORIES}.")
    parser.add_argument("--per-category", type=int, default=2, help="Mixed prompts: this many of each kind.")
    parser.add_argument("--clients", default="1", help="comma-separated concurrency levels C")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--direct", action="store_true", help="also time an in-process Engine (C = 1)")
    parser.add_argument("--out", default="bench-out/server.json")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    require_their_server()

    target_path = str(resolve_model_path(model_paths(args)[1]))
    categories = [c for c in args.categories.split(",") if c]
    requests = {c: workload(c, args.per_category) for c in categories}
    levels = [int(c) for c in args.clients.split(",") if c]
    runs = {name: {(c, n): [] for c in categories for n in levels} for name in SERVERS}
    ours, theirs = start_ours(args), None
    try:
        theirs = start_theirs(args, target_path)
        models = {
            "cactus-edge": Path(target_path).name.removesuffix(".gguf"),
            "llama_cpp.server": target_path,
        }
        urls = {"cactus-edge": ours[1], "llama_cpp.server": theirs[1]}
        for round_index in range(args.rounds):
            for category in categories:
                for clients in levels:
                    for name in SERVERS:
                        print(f"round {round_index + 1}, {category}, C={clients}: {name}", file=sys.stderr)
                        phase = run_phase(
                            urls[name], models[name], args, clients, requests[category], round_index
                        )
                        runs[name][(category, clients)].append(phase)
    finally:
        for process in (ours[0], theirs[0] if theirs else None):
            if process is not None:
                stop_server(process)
    direct = {}
    if args.direct:  # after both servers are gone: nothing else computes meanwhile
        for category in categories:
            direct[category] = summarize(
                [run_direct(args, requests[category], r) for r in range(args.rounds)]
            )
    print(report(args, categories, levels, runs, direct, args.out))


SERVERS = ("cactus-edge", "llama_cpp.server")


def report(args, categories, levels, runs, direct, out_path) -> str:
    """The Markdown table (and bench-out JSON) of a run."""
    from cactus_edge.machine import cpu_model_name

    rows, summary = [], {}
    for category in categories:
        for clients in levels:
            phases = {name: runs[name][(category, clients)] for name in SERVERS}
            mine, other = (summarize(phases[name]) for name in SERVERS)
            ratio = (
                mine["aggregate_tok_s"] / other["aggregate_tok_s"]
                if other["aggregate_tok_s"]
                else float("nan")
            )
            per_request = per_request_ratio(
                *([r for p in phases[name] for r in p["results"]] for name in SERVERS)
            )
            summary[f"{category} C={clients}"] = {
                "cactus-edge": mine, "llama_cpp.server": other, "aggregate_ratio": ratio,
                "per_request_ratio_median": per_request,
            }  # fmt: skip
            for name, s in (("cactus-edge", mine), ("llama_cpp.server", other)):
                ours_cells = f"{ratio:.2f}x | {per_request:.2f}x" if name == "cactus-edge" else " | "
                rows.append(
                    f"| {category} | {clients} | {name} | {s['requests']} | {s['ttft_p50_ms']:.0f} | "
                    f"{s['ttft_p95_ms']:.0f} | {s['decode_tok_s']:.1f} | {s['aggregate_tok_s']:.1f} | "
                    f"{ours_cells} |"
                )
    ours_label = ", ".join(
        f"{k} {getattr(args, k)}" for k in ("method", "n_draft", "drafter") if getattr(args, k)
    )
    header = (
        f"{cpu_model_name()} · {os.cpu_count()} cores · ours: {ours_label or 'its defaults'}, "
        f"theirs: plain · {args.max_tokens} tokens · temperature {args.temperature}, "
        f"top-p {args.top_p}, top-k {args.top_k} · "
        f"{args.rounds} round(s)\n\n"
        "| category | C | server | requests | TTFT p50 ms | TTFT p95 ms | decode tok/s | aggregate tok/s | "
        "aggregate ours/theirs | per-request ours/theirs (median) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    table = header + "\n".join(rows) + "\n"
    for category, d in direct.items():
        table += (
            f"\nIn-process Engine, {category} (C = 1): TTFT p50 {d['ttft_p50_ms']:.0f} ms, "
            f"{d['decode_tok_s']:.1f} decode tok/s, {d['aggregate_tok_s']:.1f} aggregate tok/s.\n"
        )
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "summary": summary, "direct": direct}, indent=2))
    (out.with_suffix(".md")).write_text(table)
    return table


if __name__ == "__main__":
    main()
