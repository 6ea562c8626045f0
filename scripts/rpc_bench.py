"""Plain decoding against the defaults with the target on two RPC workers on loopback, at several
simulated network delays: what `--rpc` costs and what speculation wins back.

For each one-way delay (ms), two `cactus-edge worker`s hold the target's layers; a delay proxy in
front of each forwards bytes with that fixed one-way delay (0 = no proxy). `cactus-edge bench`
then runs plain decoding and the defaults (cactus, auto, model+lookup) on the chosen categories
through them, and this prints one table. Run nothing else meanwhile (2 cores: the workers, the
host and the draft already share them).

    .venv/bin/python scripts/rpc_bench.py --delays 0,0.5,3 --category code-editing --out bench-out/rpc
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

from script_args import add_model_args, free_port, model_flags

from cactus_edge.errors import WorkerLostError
from cactus_edge.llama.rpc import Endpoint
from cactus_edge.llama.worker import wait_for_worker, worker_command
from cactus_edge.machine import cpu_model_name


def start_worker(port: int, threads: int) -> subprocess.Popen:
    process = subprocess.Popen(
        worker_command(port, "--threads", str(threads)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_worker(Endpoint("127.0.0.1", port), 30, alive=lambda: process.poll() is None)
    except WorkerLostError:
        raise SystemExit(f"worker on port {port} did not start") from None
    return process


class DelayProxy:
    """Forwards TCP bytes between a listen port and ``upstream`` with a fixed one-way delay: each
    chunk is written ``delay_ms`` after it was read, in order (a wire with latency, unlimited
    bandwidth). Runs its own event loop in a thread."""

    def __init__(self, upstream: int, delay_ms: float) -> None:
        self.upstream, self.delay = upstream, delay_ms / 1000
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._connect, "127.0.0.1", self.port))
        ready.set()
        with contextlib.suppress(RuntimeError):
            self.loop.run_until_complete(server.serve_forever())

    async def _connect(self, client_reader, client_writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        for sock in (client_writer.get_extra_info("socket"), up_writer.get_extra_info("socket")):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as ggml sets on its own sockets
        await asyncio.gather(self._pipe(client_reader, up_writer), self._pipe(up_reader, client_writer))

    async def _pipe(self, reader, writer) -> None:
        chunks: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await chunks.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - self.loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        delivery = asyncio.ensure_future(deliver())
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 20):
                await chunks.put((self.loop.time() + self.delay, data))
        await chunks.put(None)
        with contextlib.suppress(ConnectionError):
            await delivery


def run_bench(args, endpoints: list[str], out: Path) -> dict:
    command = [
        sys.executable, "-m", "cactus_edge.cli.main", "bench", *model_flags(args),
        "--rpc", ",".join(endpoints),
        "--methods", "none,cactus", "--deltas", "1", "--n-draft", "auto",
        "--max-tokens", str(args.max_tokens), "--out", str(out),
    ]  # fmt: skip
    for category in args.category:
        command += ["--category", category]
    if args.limit:
        command += ["--limit", str(args.limit)]
    if args.per_category:
        command += ["--per-category", str(args.per_category)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "bench.json").read_text())


def measure(args) -> list[dict]:
    rows = []
    for delay in args.delays:
        ports = [free_port(), free_port()]
        workers = [start_worker(port, args.worker_threads) for port in ports]
        proxies = [DelayProxy(port, delay) for port in ports] if delay > 0 else []
        endpoints = [f"127.0.0.1:{p.port}" for p in proxies] or [f"127.0.0.1:{port}" for port in ports]
        try:
            result = run_bench(args, endpoints, Path(args.out) / f"delay-{delay:g}ms")
        finally:
            for worker in workers:
                worker.kill()
                worker.wait()
        rows.append({"delay_ms": delay, "summary": result["summary"], "costs": result["costs"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| one-way delay | plain tok/s | defaults tok/s | decode ratio | e2e ratio | verify 1 / 4 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        plain, spec = row["summary"]["none"], next(v for k, v in row["summary"].items() if k != "none")
        verify = row["costs"]["verify_ms"]
        lines.append(
            f"| {row['delay_ms']:g} ms | {plain['tokens_per_second']:.1f} | "
            f"{spec['tokens_per_second']:.1f} | "
            f"{spec['speedup_median']:.2f}× | {spec['e2e_speedup_median']:.2f}× | "
            f"{verify['1']:.1f} / {verify['4']:.1f} |"
        )
    return "\n".join(lines)


def step_ms(summary: dict) -> float:
    """Mean ms of one verifier call's step: draft + verify + host work."""
    return summary["draft_ms_per_step"] + summary["verify_ms_per_step"] + summary["overhead_ms_per_step"]


def projection(rows: list[dict], scale: float) -> str:
    """A cost model fitted on the no-delay run, checked against the delayed ones, then applied to a
    target ``scale`` times larger.

    One verifier call costs  draft + host + verify_compute + 2·d·R  ms: d the one-way delay, R the
    synchronous round trips of one target forward (fitted from plain decoding's verify time at each
    delay against no delay), the draft local and unchanged. Rate = tokens per verifier call / step.
    A target ``scale`` times larger multiplies verify_compute (the CPU's work grows with the weights
    it reads) and nothing else: same round trips (activations are a few KB), same acceptance (an
    assumption: a larger target of the same family accepts about as often)."""
    base = {k: v for k, v in rows[0]["summary"].items()}
    plain0, spec0 = base["none"], next(v for k, v in base.items() if k != "none")
    lines = [
        f"Model: step = draft + host + verify·s + 2·d·R, fitted at d = {rows[0]['delay_ms']:g} ms.\n",
        "| one-way delay | R fitted | plain tok/s measured / modelled | defaults measured / modelled | "
        f"defaults ÷ plain, this target | ÷ plain, a {scale:g}× target |",
        "|---|---|---|---|---|---|",
    ]
    fits = [
        (row["delay_ms"], row["summary"]["none"]["verify_ms_per_step"] - plain0["verify_ms_per_step"])
        for row in rows[1:]
        if row["delay_ms"] > 0
    ]
    round_trips = sum(extra / (2 * d) for d, extra in fits) / len(fits) if fits else 0.0
    for row in rows:
        d = row["delay_ms"]
        plain, spec = row["summary"]["none"], next(v for k, v in row["summary"].items() if k != "none")
        net = 2 * d * round_trips

        def rate(summary, tpc, s=1.0, net=net):
            return 1000 * tpc / (summary["draft_ms_per_step"] + summary["overhead_ms_per_step"]
                                 + summary["verify_ms_per_step"] * s + net)  # fmt: skip

        measured_plain = 1000 * plain["tokens_per_verifier_call"] / step_ms(plain)
        measured_spec = 1000 * spec["tokens_per_verifier_call"] / step_ms(spec)
        model_plain = rate(plain0, 1.0)
        model_spec = rate(spec0, spec0["tokens_per_verifier_call"])
        big = rate(spec0, spec0["tokens_per_verifier_call"], scale) / rate(plain0, 1.0, scale)
        fitted = (
            (row["summary"]["none"]["verify_ms_per_step"] - plain0["verify_ms_per_step"]) / (2 * d)
            if d
            else 0
        )
        lines.append(
            f"| {d:g} ms | {fitted:.1f} | {measured_plain:.1f} / {model_plain:.1f} | "
            f"{measured_spec:.1f} / {model_spec:.1f} | {measured_spec / measured_plain:.2f}× measured, "
            f"{model_spec / model_plain:.2f}× modelled | {big:.2f}× |"
        )
    return "\n".join(lines) + f"\n\nR used: {round_trips:.1f} round trips per target forward."


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)  # --pair (default: 'default') or --draft/--target, --n-ctx, --threads
    parser.add_argument("--delays", default="0,0.5,3", type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--category", action="append", default=[])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--per-category", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--worker-threads", type=int, default=2)
    parser.add_argument("--out", default="bench-out/rpc")
    parser.add_argument("--scale", type=float, default=10.0, help="Projected target size, × this one.")
    parser.add_argument("--report", default=None, help="Only print the tables of an earlier run's rpc.json.")
    args = parser.parse_args()
    if args.report:
        rows = json.loads(Path(args.report).read_text())
    else:
        rows = measure(args)
        (Path(args.out) / "rpc.json").write_text(json.dumps(rows, indent=2))
    models = f"{args.draft} + {args.target}" if args.target else f"pair {args.pair or 'default'}"
    print(f"{cpu_model_name()} · {models} · categories {args.category or 'all'}\n")
    print(table(rows))
    print()
    print(projection(rows, args.scale))


if __name__ == "__main__":
    main()
