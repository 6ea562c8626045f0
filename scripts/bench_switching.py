#!/usr/bin/env python3
"""Returning to a conversation, through the servers: `cactus-edge serve` with its defaults and,
with --llama-server PATH, llama.cpp's llama-server with its defaults (same target GGUF), one
server at a time. Each gets the same long coding conversations asked in turn (A B C A B C …, the
openings of `cactus-edge bench --workload switching`), streaming, temperature 0, each turn sent
with the conversation so far (that server's own replies). Reports per server the time to the first
token of the first round (each conversation's first, cold, request) and of the later rounds (the
returns), their ratio, and the prompt tokens each server said it reused.

Timing run: an otherwise idle machine, the CPU named with the numbers, e.g.

    .venv/bin/python scripts/bench_switching.py --pair default \
        --llama-server ~/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from bench_server import _popen, start_and_read_url, stop_server
from script_args import free_port, model_flags, model_paths, script_parser, wait_ready


def start_ours(args):
    """`cactus-edge serve` with its defaults and the models of the flags."""
    command = [sys.executable, "-m", "cactus_edge.cli.main", "serve", "--port", "0", "--json"]
    return start_and_read_url([*command, *model_flags(args)], "cactus-edge")


def start_llama_server(args, target_path: str):
    """llama-server with its defaults, the context ours has, the same threads."""
    port = free_port()
    command = [args.llama_server, "-m", target_path, "--host", "127.0.0.1", "--port", str(port)]
    command += ["-c", str(args.n_ctx)] + (["-t", str(args.threads)] if args.threads else [])
    process = _popen(command, None, "llama-server")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, path="/health")
    return process, url


def ask(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: time to the first content, the reply, and the reused prompt
    tokens the server reported (usage.prompt_tokens_details.cached_tokens, or timings.cache_n)."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    begin, first, text, cached, prompt_tokens = time.perf_counter(), None, [], None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url} answered {response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
            usage, timings = chunk.get("usage") or {}, chunk.get("timings") or {}
            if usage.get("prompt_tokens_details"):
                cached = usage["prompt_tokens_details"].get("cached_tokens", cached)
            prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
            if "cache_n" in timings:
                cached = timings["cache_n"]
                prompt_tokens = timings.get("prompt_n", 0) + timings["cache_n"]
    end = time.perf_counter()
    return {"ttft_ms": ((first or end) - begin) * 1000, "text": "".join(text), "cached": cached,
            "prompt_tokens": prompt_tokens}  # fmt: skip


def run_server(url: str, model: str, openings: list[str], rounds: int, max_tokens: int, name: str) -> list:
    from cactus_edge.cli.switching import asked_in_turn

    records = []
    for round_index, index, messages in asked_in_turn(openings, rounds):
        answer = ask(url, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": answer.pop("text")})
        records.append({"server": name, "round": round_index, "conversation": index, **answer})
        said = f"first token {answer['ttft_ms']:.0f} ms, {answer['cached']} of {answer['prompt_tokens']}"
        where = f"{name} round {round_index} conversation {index}"
        print(f"{where}: {said} prompt tokens reused", file=sys.stderr)
    return records


def table(records: list[dict]) -> str:
    lines = [
        "| server | first round: first token (median) | later rounds: first token (median, min–max) | "
        "later / first | prompt tokens reused in later rounds (median) |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["server"] for r in records):
        cold = [r["ttft_ms"] for r in records if r["server"] == name and r["round"] == 0]
        warm = [r for r in records if r["server"] == name and r["round"] > 0]
        warm_ms = [r["ttft_ms"] for r in warm]
        reused = [r["cached"] / r["prompt_tokens"] for r in warm if r["cached"] is not None]
        share = f"{statistics.median(reused):.0%}" if reused else "not reported"
        lines.append(
            f"| {name} | {statistics.median(cold):.0f} ms | {statistics.median(warm_ms):.0f} ms "
            f"({min(warm_ms):.0f}–{max(warm_ms):.0f}) | "
            f"{statistics.median(warm_ms) / statistics.median(cold):.3f} | {share} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    from cactus_edge.cli.switching import openings

    parser = script_parser(__doc__)
    parser.add_argument("--llama-server", default=None, help="Path to llama-server, run beside ours.")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="Write the records and the table here (a folder).")
    args = parser.parse_args()
    texts = openings(args.conversations)
    records = []
    process, url = start_ours(args)
    try:
        records += run_server(url, "cactus-edge", texts, args.rounds, args.max_tokens, "cactus-edge serve")
    finally:
        stop_server(process)
    if args.llama_server:
        from cactus_edge.catalog.resolve import resolve_model_path

        process, url = start_llama_server(args, str(resolve_model_path(model_paths(args)[1])))
        try:
            records += run_server(url, "any", texts, args.rounds, args.max_tokens, "llama-server")
        finally:
            stop_server(process)
    result = table(records)
    print(result)
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "switching-servers.json").write_text(json.dumps(records, indent=2))
        (folder / "switching-servers.md").write_text(result)


if __name__ == "__main__":
    main()
