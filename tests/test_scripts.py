"""The QA scripts no other test runs (screenshot_chat, rpc_bench, bench_server), run on the tiny
pair: a change to the package that breaks one fails here, not the next time someone needs it.

Each script runs as it is run by hand (a subprocess, from a temporary folder so that nothing lands
in the repository), except bench_server's server-against-server comparison: llama-cpp-python's
server extra is not installed here, so its pieces run in this process against our server alone,
and the full run is checked to stop at once with the command that installs the extra. Every wait
is for a process to finish, bounded by LIMIT, which only a hung (broken) script reaches: the runs
take a few seconds."""

from __future__ import annotations

import html
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cactus_edge.llama.rpc import rpc_supported

from .conftest import TEST_THREADS, load_script

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 300  # seconds a script may take: reached only by a hung one (they finish in a few seconds)
THREADS = ("--threads", str(TEST_THREADS))
# The modules `python -m llama_cpp.server` needs that only llama-cpp-python[server] installs.
SERVER_EXTRA = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


def run_script(name: str, *flags: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=LIMIT, cwd=cwd)


def output(result: subprocess.CompletedProcess) -> str:
    """What a failed run printed, for the assertion message."""
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def svg_text(svg: str) -> str:
    """The characters of a Textual screenshot in document order (its spaces are &#160;)."""
    return "".join(html.unescape(text) for text in re.findall(r"<text[^>]*>([^<]*)</text>", svg)).replace(
        "\xa0", " "
    )


# --- screenshot_chat.py ----------------------------------------------------------------------------


def test_screenshot_chat_renders_one_exchange_on_the_tiny_pair(tiny_args, tmp_path):
    prompt = "the cat sat on the mat"
    out = tmp_path / "docs" / "chat.svg"  # a folder the script makes
    result = run_script(
        "screenshot_chat", *tiny_args, *THREADS, "--prompt", prompt, "--out", str(out), cwd=tmp_path
    )
    assert result.returncode == 0, output(result)
    svg = out.read_text()
    assert svg.startswith("<svg")
    text = svg_text(svg)
    assert " you " in text and prompt in text  # the question it typed, in the user's box
    assert " assistant " in text  # and the reply's box
    assert "tok/s" in text and "AL " in text  # the status bar's figures: the reply ended before the shot


# --- rpc_bench.py ----------------------------------------------------------------------------------


@pytest.mark.skipif(not rpc_supported(), reason="llama-cpp-python built without GGML_RPC")
def test_rpc_bench_runs_through_workers_and_a_delay_proxy_then_reprints_its_report(tiny_args, tmp_path):
    """A full run: two `cactus-edge worker`s per delay, at 0 ms straight to them, at 1 ms through
    the script's delay proxies, `cactus-edge bench` on one prompt through them; then --report."""
    out = tmp_path / "rpc"
    flags = [*tiny_args, *THREADS, "--worker-threads", str(TEST_THREADS), "--delays", "0,1"]
    flags += ["--limit", "1", "--max-tokens", "8", "--out", str(out)]
    result = run_script("rpc_bench", *flags, cwd=tmp_path)
    assert result.returncode == 0, output(result)
    assert "bench: 2 variants x 1 prompts" in result.stderr  # bench's plan line: it ran, twice
    rows = json.loads((out / "rpc.json").read_text())
    assert [row["delay_ms"] for row in rows] == [0, 1]
    for row in rows:
        assert "none" in row["summary"] and len(row["summary"]) == 2  # plain decoding and the defaults
        assert row["summary"]["none"]["tokens_per_second"] > 0
        assert {"1", "4"} <= set(row["costs"]["verify_ms"])  # the table's "verify 1 / 4" column
    for delay in ("0 ms", "1 ms"):  # a row in the measured table and one in the projection
        assert result.stdout.count(f"| {delay} |") == 2, result.stdout
    assert "| one-way delay | plain tok/s |" in result.stdout and "R used:" in result.stdout
    assert (out / "delay-1ms" / "bench.md").exists()

    again = run_script("rpc_bench", *tiny_args, "--report", str(out / "rpc.json"), cwd=tmp_path)
    assert again.returncode == 0, output(again)
    assert again.stdout == result.stdout  # the same tables, from the recorded rows alone


# --- bench_server.py -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_server():
    return load_script("bench_server")


def test_bench_server_measures_our_server_and_the_engine_on_the_tiny_pair(bench_server, tiny_args, tmp_path):
    """Our server started by the script, its requests (one client, the mixed category, 8 tokens),
    a two-turn conversation, the in-process Engine (--direct) and the report. The report compares
    two servers: a second pass over ours stands in for llama_cpp.server (not installed here)."""
    out = tmp_path / "server.json"
    flags = [*tiny_args, *THREADS, "--categories", "mixed", "--per-category", "1", "--clients", "1"]
    args = bench_server.build_parser().parse_args(
        [*flags, "--max-tokens", "8", "--direct", "--out", str(out)]
    )
    requests = bench_server.workload("mixed", args.per_category)
    assert len(requests) == 4 and all(len(turns) == 1 for turns in requests)  # one of each kind

    target = Path(bench_server.resolve_model_path(bench_server.model_paths(args)[1]))
    model = target.name.removesuffix(".gguf")  # the name main() asks our server for
    process, url = bench_server.start_ours(args)
    try:
        phases = [bench_server.run_phase(url, model, args, 1, requests, 0) for _ in range(2)]
        conversation = bench_server.run_conversation(url, model, ["the cat sat", "and the dog ran"], args, 7)
    finally:
        bench_server.stop_server(process)
    for phase in phases:
        assert [r["request"] for r in phase["results"]] == ["0.0", "10.0", "20.0", "30.0"]
        for r in phase["results"]:
            assert r["tokens"] > 0 and r["text"] and 0 < r["ttft"] <= r["total_s"] <= phase["wall_s"]
    assert [r["request"] for r in conversation] == ["7.0", "7.1"] and all(r["text"] for r in conversation)

    direct = {"mixed": bench_server.summarize([bench_server.run_direct(args, requests, 0)])}
    assert direct["mixed"]["requests"] == 4 and direct["mixed"]["aggregate_tok_s"] > 0
    runs = {"cactus-edge": {("mixed", 1): phases[:1]}, "llama_cpp.server": {("mixed", 1): phases[1:]}}
    table = bench_server.report(args, ["mixed"], [1], runs, direct, args.out)
    assert "| mixed | 1 | cactus-edge | 4 |" in table and "| mixed | 1 | llama_cpp.server | 4 |" in table
    assert "In-process Engine, mixed (C = 1)" in table
    saved = json.loads(out.read_text())
    summary = saved["summary"]["mixed C=1"]
    assert summary["cactus-edge"]["requests"] == 4 and summary["cactus-edge"]["aggregate_tok_s"] > 0
    assert math.isfinite(summary["per_request_ratio_median"]) and summary["per_request_ratio_median"] > 0
    assert saved["settings"]["max_tokens"] == 8 and out.with_suffix(".md").read_text() == table


def test_bench_server_without_the_server_extra_says_what_to_install(tiny_args, tmp_path):
    if all(importlib.util.find_spec(name) for name in SERVER_EXTRA):
        pytest.skip("llama-cpp-python[server] is installed: a full run would start llama_cpp.server")
    result = run_script("bench_server", *tiny_args, *THREADS, "--max-tokens", "8", cwd=tmp_path)
    assert result.returncode == 1, output(result)
    assert "pip install 'llama-cpp-python[server]'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "bench-out").exists()  # it stopped before starting anything


# --- bench_switching.py ----------------------------------------------------------------------------


def test_bench_switching_returns_to_conversations_through_our_server(tiny_args, tmp_path):
    """Our server started by the script, two long conversations asked in turn twice: the returns
    report the earlier turn's tokens as reused (the prompt cache), and the table compares rounds.
    (llama-server is not built here: the table is checked with our rows alone.)"""
    bench_switching = load_script("bench_switching")
    args = bench_switching.script_parser("").parse_args([*tiny_args, *THREADS])
    openings = ["the water is hot and " * 30, "and hot is water the " * 30]
    process, url = bench_switching.start_ours(args)
    try:
        records = bench_switching.run_server(url, "cactus-edge", openings, 2, 4, "cactus-edge serve")
    finally:
        bench_switching.stop_server(process)
    assert [(r["round"], r["conversation"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first_round = {r["conversation"]: r for r in records if r["round"] == 0}
    for record in records:
        assert record["ttft_ms"] > 0 and record["prompt_tokens"] > 300
        if record["round"]:  # the whole earlier turn came back, not only the system prompt
            assert record["cached"] >= first_round[record["conversation"]]["prompt_tokens"]
    table = bench_switching.table(records)
    assert "| cactus-edge serve |" in table and "later / first" in table
