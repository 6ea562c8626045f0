#!/usr/bin/env python3
"""Server soak: N requests over loopback against a `cactus-edge serve` this script starts itself,
then a SIGTERM; exits non-zero on any violation.

    .venv/bin/python scripts/soak_server.py --pair default --requests 1000 --out bench-out/soak-server

The requests rotate through chat and completions, streaming and not, over the methods and
drafters; clients that hang up mid-stream; cancels (a request whose client goes away before the
answer); invalid requests (each must get its documented status and code); stalled connections
(idle, partial headers, a short body: each must be closed by the server within its timeout + 5 s);
and, every 50 requests, a burst of max-queue + 3 at once, so that the queue overflows. With
--conversations N (default 6), every fifth request returns to one of N long conversations (the
first every other time, the others in turn), so that the prompt cache (--cache-ram MIB) saves,
restores and evicts all along. Meanwhile a
thread polls GET /health every 50 ms. At the end a long stream is running when SIGTERM arrives.

Violations: a 5xx other than the documented 503s (queue_full, shutting_down, model_loading,
too_many_connections); an answer of the wrong shape or status; a cache inconsistency (the server
runs with ``debug``: it checks the engine's caches after every generation, Engine.check_caches,
and reports at GET /debug/caches); RSS less the prompt cache's bytes growing after warm-up over
--max-rss-growth-mb; the prompt cache holding more than --cache-ram, or RSS at the end over RSS
with the models loaded + --cache-ram + --max-rss-overhead-mb; switching that never saved or
restored a conversation; /health p99
over --max-health-p99-ms, or /health not 200; a stalled socket left open; SIGTERM not ending the
process with 0 within 30 s; a traceback in the server's log.

The server is `cactus_edge.server.run` (what `cactus-edge serve` runs) in a child process of this
script (``--child``), because the CLI has no flag for ``debug``. Writes soak_server.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench_server import start_and_read_url
from script_args import engine_from_args, model_flags, script_parser

from cactus_edge.cli.bench import load_prompts

# Short prompts only: a soak is about many requests, not long prefills.
PROMPTS = [p["prompt"] for p in load_prompts() if p["category"] != "code-editing"]

MODEL = "soak"
DOCUMENTED_503 = {"queue_full", "shutting_down", "model_loading", "too_many_connections"}
ROTATION = [
    "chat",
    "stream",
    "completion",
    "stream_completion",
    "disconnect",
    "chat",
    "cancel",
    "invalid",
    "stream",
    "stall",
]
SWITCH_EVERY = 5  # with --conversations, every fifth request returns to a long conversation
CONVERSATION_WORDS = ("the", "of", "and", "to", "in", "is", "it", "you", "that", "was", "for", "on", "are")
SPECULATIVE = [
    {"method": "cactus", "delta": 0.5},
    {"method": "sps"},
    {"method": "none"},
    {"method": "tas", "drafter": "model+lookup"},
    {"method": "exact", "drafter": "lookup"},
    {"method": "sps", "drafter": "lookup"},
]
BURST_EVERY = 50
HEALTH_EVERY = 0.05  # seconds between /health polls
TIMEOUT = 300.0  # seconds any one request may take (the real pair on 2 cores is slow)
SLACK = 5.0  # seconds a stalled socket may outlive its timeout
TIMEOUTS = ("idle_timeout", "header_timeout", "body_timeout")  # ServerSettings' names


@dataclass
class Outcome:
    kind: str
    status: int | None
    seconds: float
    problem: str | None = None
    code: str | None = None


@dataclass
class Run:
    """Everything measured, for the summary and the exit code."""

    outcomes: list[Outcome] = field(default_factory=list)
    rss_mb: list[tuple[int, float, float]] = field(default_factory=list)  # (requests done, RSS, cache MB)
    loaded_rss_mb: float = float("nan")  # with the models loaded, before any request
    health_ms: list[float] = field(default_factory=list)
    health_problems: list[str] = field(default_factory=list)
    stalls: list[tuple[socket.socket, float, str]] = field(default_factory=list)  # (socket, opened, timeout)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)


# --- the child: the server ---------------------------------------------------------------------------


def serve_child(args) -> None:
    """`cactus-edge serve` as the CLI runs it, with debug (cache audit) and metrics on."""
    import logging

    from cactus_edge.server import ServerSettings, run

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    settings = ServerSettings(
        port=0,
        max_queue=args.max_queue,
        metrics=True,
        debug=True,
        model_name=MODEL,
        **{name: getattr(args, name) for name in TIMEOUTS},
    )

    def load():
        return engine_from_args(args, cache_ram_mib=args.cache_ram)

    def announce(server) -> None:
        print(json.dumps({"event": "listening", "url": server.url, "pid": os.getpid()}), flush=True)

    run(load, settings, announce)


def start_server(args) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, __file__, "--child", "--max-queue", str(args.max_queue), *model_flags(args)]
    command += ["--cache-ram", str(args.cache_ram), "--conversations", str(args.conversations)]
    command += ["--max-tokens", str(args.max_tokens)]
    for name in TIMEOUTS:
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return start_and_read_url(command, "soak-server")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --- requests -----------------------------------------------------------------------------------------


def body_for(index: int, args, chat: bool = True, **extra) -> dict:
    settings = {
        "model": MODEL,
        "max_tokens": args.max_tokens,
        "temperature": 0.0 if index % 2 else 0.7,
        "seed": index,
        "speculative": SPECULATIVE[index % len(SPECULATIVE)],
    }
    prompt = PROMPTS[index % len(PROMPTS)]
    text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return {**settings, **text, **extra}


def error_code(response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def complete(http, index: int, args, chat: bool) -> Outcome:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    begin = time.perf_counter()
    response = http.post(path, json=body_for(index, args, chat))
    seconds = time.perf_counter() - begin
    kind = "chat" if chat else "completion"
    if response.status_code != 200:
        return Outcome(kind, response.status_code, seconds, code=error_code(response))
    body = response.json()
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    problem = None if isinstance(text, str) and body["usage"]["completion_tokens"] >= 0 else "bad body"
    return Outcome(kind, 200, seconds, problem)


def conversation_words(args) -> int:
    """How many words a switching conversation has: 1-2 tokens each, so that it is long enough
    to be kept (256 tokens) and fits with room to answer."""
    return max(200, args.n_ctx // 6)


def conversation_number(index: int, n_conversations: int) -> int:
    """The index-th switch's conversation: the first one every other time (the one a user keeps
    returning to, which stays in the cache), the others in turn between (which evict)."""
    if n_conversations == 1 or index % 2 == 0:
        return 0
    return 1 + (index // 2) % (n_conversations - 1)


def switch(http, index: int, args) -> Outcome:
    """The index-th return to a long conversation: the same prompt each time it comes back."""
    number = conversation_number(index, args.conversations)
    rng = random.Random(number)
    words = " ".join(rng.choice(CONVERSATION_WORDS) for _ in range(conversation_words(args)))
    messages = [{"role": "user", "content": f"{number}: {words}"}]
    body = {**body_for(index, args), "messages": messages, "temperature": 0.0}
    begin = time.perf_counter()
    response = http.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - begin
    if response.status_code != 200:
        code = error_code(response)
        return Outcome("switch", response.status_code, seconds, f"a conversation got {code}", code)
    usage = response.json().get("usage", {})
    problem = None if usage.get("prompt_tokens", 0) >= 256 else f"a short conversation: {usage}"
    return Outcome("switch", 200, seconds, problem)


def stream(
    http, index: int, args, chat: bool, hang_up: bool = False, max_tokens: int | None = None
) -> Outcome:
    """A streaming request read to [DONE], or, with ``hang_up``, closed at the first content."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = "disconnect" if hang_up else ("stream" if chat else "stream_completion")
    body = body_for(index, args, chat, stream=True, max_tokens=max_tokens or args.max_tokens)
    begin = time.perf_counter()
    with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            return Outcome(kind, response.status_code, time.perf_counter() - begin, code=error_code(response))
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if hang_up and len(events) >= 2:
                    return Outcome(kind, 200, time.perf_counter() - begin)
    problem = None if events and events[-1] == "[DONE]" else f"the stream ended without [DONE]: {events[-1:]}"
    return Outcome(kind, 200, time.perf_counter() - begin, problem)


def raw_request(url: str, data: bytes, wait: float = 0.0, limit: float = 30.0) -> bytes:
    """Send ``data`` on a new connection; with ``wait``, hang up after that many seconds (a
    cancel), else return everything until the server closes (at most ``limit`` seconds)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=limit) as sock:
        sock.sendall(data)
        if wait:
            time.sleep(wait)
            return b""
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def cancel(url: str, index: int, args) -> Outcome:
    """A full request whose client goes away after 50 ms: queued, running or done by then."""
    body = json.dumps(body_for(index, args, max_tokens=args.max_tokens * 8)).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    begin = time.perf_counter()
    raw_request(url, head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body, wait=0.05)
    return Outcome("cancel", None, time.perf_counter() - begin)


def invalid_cases(args) -> list[tuple[str, dict, int, str | None]]:
    """(name, how to send it, expected status, expected code)."""
    chat = "/v1/chat/completions"

    def post(**how) -> dict:
        return {"method": "POST", "url": chat, **how}

    long_prompt = [{"role": "user", "content": "the water is hot and " * args.n_ctx}]
    surrogate = b'{"model": "soak", "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}'
    too_large = f"POST {chat} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000\r\n\r\n"
    return [
        ("malformed JSON", post(content=b'{"messages": ['), 400, "invalid_json"),
        ("out of range", post(json={"messages": [], "top_p": 2}), 400, None),
        ("lone surrogate", post(content=surrogate), 400, "invalid_value"),
        ("n > 1", post(json={"messages": [], "n": 2}), 400, "unsupported_parameter"),
        ("context", post(json=body_for(0, args, messages=long_prompt)), 400, "context_length_exceeded"),
        ("unknown route", {"method": "GET", "url": "/v1/embeddings"}, 404, "unknown_url"),
        ("wrong method", {"method": "GET", "url": chat}, 405, "method_not_allowed"),
        ("too large", {"raw": too_large.encode()}, 413, "request_too_large"),
        ("garbage", {"raw": b"\x16\x03\x01\x00\x05hello\r\n\r\n"}, 400, "invalid_http_request"),
    ]


def invalid(http, url: str, index: int, args) -> Outcome:
    cases = invalid_cases(args)
    name, how, expected, code = cases[index % len(cases)]
    begin = time.perf_counter()
    if "raw" in how:
        head, _, body = raw_request(url, how["raw"]).partition(b"\r\n\r\n")
        status = int(head.split()[1]) if head else None
        got = json.loads(body)["error"]["code"] if body else None
    else:
        response = http.request(**how)
        status, got = response.status_code, error_code(response)
    problem = None
    if status != expected or (code is not None and got != code):
        problem = f"{name}: expected {expected} {code}, got {status} {got}"
    return Outcome("invalid", status, time.perf_counter() - begin, problem, got)


STALLS = [
    # (bytes sent, then nothing; the timeout that must close it)
    (b"", "idle_timeout"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", "header_timeout"),
    (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 500\r\n\r\n{",
        "body_timeout",
    ),
]


def stall(url: str, index: int, run: Run) -> Outcome:
    """Open a stalled connection and keep it; :func:`check_stalls` checks the server closed it."""
    data, timeout = STALLS[index % len(STALLS)]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    sock.sendall(data)
    run.stalls.append((sock, time.monotonic(), timeout))
    return Outcome("stall", None, 0.0)


def check_stalls(run: Run, args) -> list[str]:
    """Before SIGTERM (which closes everything): every stalled socket must have been closed by
    its timeout, within timeout + SLACK of its opening, a partial request with a 408."""
    problems = []
    for sock, opened, timeout in run.stalls:
        seconds = getattr(args, timeout)
        sock.settimeout(max(0.1, opened + seconds + SLACK - time.monotonic()))
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            problems.append(
                f"a stalled socket ({timeout} {seconds:g} s) was still open {seconds + SLACK:g} s later"
            )
            continue
        except OSError:
            pass  # reset: closed
        finally:
            sock.close()
        if timeout != "idle_timeout" and not data.startswith(b"HTTP/1.1 408"):
            problems.append(f"a stalled request ({timeout}) was closed without a 408: {data[:60]!r}")
    return problems


def finishes(url: str) -> dict[str, int]:
    """Generations by finish reason, from /metrics: the cancels and hang-ups must show."""
    import httpx

    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("cactus_edge_generations_total{"):
            reason = line.split('"')[1]
            found[reason] = int(float(line.split()[-1]))
    return found


def prompt_cache_metrics(url: str) -> dict[str, float]:
    """The prompt cache's figures from /metrics, by name without the prefix."""
    import httpx

    prefix = "cactus_edge_prompt_cache_"
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return {
        line.split()[0].removeprefix(prefix): float(line.split()[-1])
        for line in lines
        if line.startswith(prefix)
    }


def burst(url: str, index: int, args, run: Run) -> None:
    """max_queue + 3 streaming requests at once: the queue overflows (503 queue_full)."""
    import httpx

    start = threading.Barrier(args.max_queue + 3)

    def one(offset: int) -> None:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            start.wait()
            outcome = stream(http, index + offset, args, chat=True, max_tokens=args.max_tokens * 4)
        outcome.kind = "burst"
        run.add(outcome)

    threads = [threading.Thread(target=one, args=(offset,)) for offset in range(args.max_queue + 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)


# --- the run --------------------------------------------------------------------------------------------


def poll_health(url: str, run: Run, stop: threading.Event) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=10) as http:
        while not stop.wait(HEALTH_EVERY):
            begin = time.perf_counter()
            try:
                status = http.get("/health").status_code
            except httpx.HTTPError as error:
                status = repr(error)
            run.health_ms.append(1000 * (time.perf_counter() - begin))
            if status != 200:
                run.health_problems.append(f"/health answered {status}")


def one_step(kind: str, http, url: str, index: int, args, run: Run) -> None:
    if kind in ("chat", "completion"):
        run.add(complete(http, index, args, chat=kind == "chat"))
    elif kind in ("stream", "stream_completion"):
        run.add(stream(http, index, args, chat=kind == "stream"))
    elif kind == "disconnect":
        run.add(stream(http, index, args, chat=True, hang_up=True, max_tokens=args.max_tokens * 8))
    elif kind == "cancel":
        run.add(cancel(url, index, args))
    elif kind == "invalid":
        run.add(invalid(http, url, index, args))
    else:
        run.add(stall(url, index, run))


def soak(url: str, pid: int, args) -> Run:
    import httpx

    run, stop = Run(loaded_rss_mb=rss_mb(pid)), threading.Event()
    poller = threading.Thread(target=poll_health, args=(url, run, stop), daemon=True)
    poller.start()
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            step = turn = 0
            while len(run.outcomes) < args.requests:
                if (
                    step % BURST_EVERY == BURST_EVERY - 1
                    and args.requests - len(run.outcomes) >= args.max_queue + 3
                ):
                    burst(url, step, args, run)
                elif args.conversations and step % SWITCH_EVERY == SWITCH_EVERY - 1:
                    run.add(switch(http, step // SWITCH_EVERY, args))  # beside the rotation, not instead
                else:
                    one_step(ROTATION[turn % len(ROTATION)], http, url, step, args, run)
                    turn += 1
                step += 1
                done = len(run.outcomes)
                if done >= args.warmup and (not run.rss_mb or done - run.rss_mb[-1][0] >= 10):
                    cache_mb = prompt_cache_metrics(url).get("bytes", 0.0) / 2**20
                    run.rss_mb.append((done, rss_mb(pid), cache_mb))
                if step % 50 == 0:
                    print(f"{done} requests, RSS {rss_mb(pid):.0f} MB", file=sys.stderr, flush=True)
    finally:
        stop.set()
        poller.join(10)
    return run


def cache_audit(url: str) -> dict:
    """The server's audit once the worker is idle (then every generation has been checked)."""
    import httpx

    deadline = time.monotonic() + 120
    while True:
        report = httpx.get(f"{url}/debug/caches", timeout=10).json()
        if (report["waiting"] == 0 and report["running"] == 0) or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def sigterm(process: subprocess.Popen, url: str, args) -> dict:
    """SIGTERM while a long stream runs: the process must exit 0 and the stream end cleanly."""
    import httpx

    first, ended = threading.Event(), {}

    def long_stream() -> None:
        body = body_for(1, args, stream=True, max_tokens=args.n_ctx // 2)
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT) as response:
                for line in response.iter_lines():
                    first.set()
                    ended["last"] = line or ended.get("last")
        except httpx.HTTPError as error:
            ended["error"] = repr(error)
        first.set()

    client = threading.Thread(target=long_stream, daemon=True)
    client.start()
    first.wait(TIMEOUT)
    begin = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(30)
    except subprocess.TimeoutExpired:
        code = None
    client.join(30)
    return {"exit_code": code, "seconds": time.monotonic() - begin, "stream_end": ended}


# --- the verdict ---------------------------------------------------------------------------------------


def violations(run: Run, audit: dict, term: dict, log: str, args) -> list[str]:
    found = [o.problem for o in run.outcomes if o.problem]
    for o in run.outcomes:
        if o.status is not None and o.status >= 500 and not (o.status == 503 and o.code in DOCUMENTED_503):
            found.append(f"{o.kind}: {o.status} {o.code}")
    found += run.health_problems[:10]
    if run.health_ms and percentile(run.health_ms, 99) > args.max_health_p99_ms:
        found.append(f"/health p99 {percentile(run.health_ms, 99):.0f} ms > {args.max_health_p99_ms} ms")
    growth = rss_growth(run)
    if growth is not None and growth > args.max_rss_growth_mb:
        found.append(
            f"RSS less the prompt cache grew {growth:.1f} MB after warm-up > {args.max_rss_growth_mb} MB"
        )
    found += memory_bound_problems(run, audit, args)
    found += [f"cache: {p}" for p in audit["problems"]]
    if audit["checked"] == 0:
        found.append("the cache audit checked no generation")
    if term["exit_code"] != 0:
        found.append(f"SIGTERM: exit code {term['exit_code']} after {term['seconds']:.1f} s")
    if "error" in term["stream_end"] or term["stream_end"].get("last") != "data: [DONE]":
        found.append(f"SIGTERM: the running stream did not end with [DONE]: {term['stream_end']}")
    if "Traceback" in log:
        found.append("a traceback in the server's log")
    return found


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def rss_growth(run: Run) -> float | None:
    """How much RSS less the prompt cache's bytes grew from the first sample after warm-up."""
    if len(run.rss_mb) < 2:
        return None
    (_, first, first_cache), (_, last, last_cache) = run.rss_mb[0], run.rss_mb[-1]
    return (last - last_cache) - (first - first_cache)


def memory_bound_problems(run: Run, audit: dict, args) -> list[str]:
    """The prompt cache within --cache-ram at every sample; RSS at the end within the models'
    RSS + the bound + --max-rss-overhead-mb; and switching that did use the cache."""
    found = []
    held = max((cache for _, _, cache in run.rss_mb), default=0.0)
    if held > args.cache_ram:
        found.append(f"the prompt cache held {held:.1f} MiB > --cache-ram {args.cache_ram}")
    if run.rss_mb:
        allowed = run.loaded_rss_mb + args.cache_ram * 2**20 / 1e6 + args.max_rss_overhead_mb
        if run.rss_mb[-1][1] > allowed:
            found.append(
                f"RSS {run.rss_mb[-1][1]:.0f} MB at the end > {run.loaded_rss_mb:.0f} MB loaded "
                f"+ {args.cache_ram} MiB cache + {args.max_rss_overhead_mb:g} MB"
            )
    cache = audit.get("prompt_cache", {})
    if args.conversations and args.cache_ram and not (cache.get("saves_total") and cache.get("hits_total")):
        found.append(f"switching conversations neither saved nor restored one: {cache}")
    return found


def table(run: Run, audit: dict, term: dict, found: list[str], args) -> str:
    rows = ["| kind | requests | statuses | p50 ms | max ms | problems |", "|---|---|---|---|---|---|"]
    by_kind: dict[str, list[Outcome]] = {}
    for outcome in run.outcomes:
        by_kind.setdefault(outcome.kind, []).append(outcome)
    for kind, outcomes in by_kind.items():
        statuses = Counter(str(o.status or "-") for o in outcomes)
        ms = [1000 * o.seconds for o in outcomes]
        rows.append(
            f"| {kind} | {len(outcomes)} | {', '.join(f'{s}: {n}' for s, n in sorted(statuses.items()))} | "
            f"{statistics.median(ms):.0f} | {max(ms):.0f} | {sum(1 for o in outcomes if o.problem)} |"
        )
    growth, ends = rss_growth(run), run.rss_mb[:1] + run.rss_mb[-1:]
    cache = audit.get("prompt_cache", {})
    rows += [
        "",
        "| check | value |",
        "|---|---|",
        f"| /health polls, p50 / p99 / max ms | {len(run.health_ms)}, {percentile(run.health_ms, 50):.1f} / "
        f"{percentile(run.health_ms, 99):.1f} / {percentile(run.health_ms, 100):.1f} |",
        f"| RSS loaded, after warm-up → end MB | {run.loaded_rss_mb:.1f}, "
        f"{' → '.join(f'{mb:.1f}' for _, mb, _ in ends)} |",
        f"| prompt cache after warm-up → end MiB (bound) | "
        f"{' → '.join(f'{cache_mb:.1f}' for _, _, cache_mb in ends)} ({args.cache_ram}) |",
        f"| RSS less the prompt cache, growth after warm-up MB | "
        f"{'n/a' if growth is None else f'{growth:+.1f}'} |",
        f"| prompt cache: saves, hits, evictions | {cache.get('saves_total', 0):.0f}, "
        f"{cache.get('hits_total', 0):.0f}, {cache.get('evictions_total', 0):.0f} |",
        f"| cache audit: generations checked, problems | {audit['checked']}, {audit['n_problems']} |",
        f"| stalled sockets, all closed by their timeouts unless a violation says so | {len(run.stalls)} |",
        f"| generations by finish reason | {audit['finishes']} |",
        f"| queue_full answers in bursts | {sum(1 for o in run.outcomes if o.code == 'queue_full')} |",
        f"| SIGTERM: exit code, seconds | {term['exit_code']}, {term['seconds']:.1f} |",
        f"| violations | {len(found)} |",
    ]
    return "\n".join(rows)


def parse_args(argv=None):
    from cactus_edge.server import ServerSettings

    parser = script_parser(__doc__, n_ctx=2048)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-queue", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=None, help="requests before the RSS baseline")
    parser.add_argument("--max-rss-growth-mb", type=float, default=20.0, help="of RSS less the prompt cache")
    parser.add_argument("--cache-ram", type=int, default=64, help="the prompt cache's bound, MiB")
    parser.add_argument("--conversations", type=int, default=6, help="long conversations to switch between")
    parser.add_argument(
        "--max-rss-overhead-mb",
        type=float,
        default=150.0,
        help="end RSS over the models' + the cache's bound",
    )
    parser.add_argument("--max-health-p99-ms", type=float, default=100.0)
    for name in TIMEOUTS:
        default = getattr(ServerSettings, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=default, help="seconds")
    parser.add_argument("--out", default="bench-out/soak-server")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.conversations:
        args.n_ctx = max(args.n_ctx, 2 * conversation_words(args) + 4 * args.max_tokens)
    if args.warmup is None:
        args.warmup = max(20, args.requests // 10)
    return args


def main() -> int:
    args = parse_args()
    if args.child:
        serve_child(args)
        return 0
    process, url = start_server(args)
    try:
        run = soak(url, process.pid, args)
        audit = cache_audit(url)
        audit["finishes"] = finishes(url)
        audit["prompt_cache"] = prompt_cache_metrics(url)
        stall_problems = check_stalls(run, args)
        term = sigterm(process, url, args)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    log = Path(process.log_path).read_text(errors="replace")
    found = stall_problems + violations(run, audit, term, log, args)
    summary = table(run, audit, term, found, args)
    print(summary)
    for problem in found[:30]:
        print(f"violation: {problem}", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
        "requests": len(run.outcomes),
        "violations": found,
        "cache_audit": audit,
        "sigterm": term,
        "rss_mb": run.rss_mb,
        "loaded_rss_mb": run.loaded_rss_mb,
        "health_ms": {"n": len(run.health_ms), "p50": percentile(run.health_ms, 50),
                      "p99": percentile(run.health_ms, 99), "max": percentile(run.health_ms, 100)},
        "server_log": process.log_path,
    }  # fmt: skip
    (out / "soak_server.json").write_text(json.dumps(result, indent=2))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
