"""The model flags every script in scripts/ shares (--pair, or --draft/--target; --n-ctx, --threads),
and the engine they choose: the same rule as the CLI (:func:`registry.resolve_pair`); and what the
scripts that start servers share: a free loopback port, and waiting for a server to answer."""

from __future__ import annotations

import argparse
import socket
import subprocess
import time
from pathlib import Path

from cactus_edge.llama import DEFAULT_N_CTX


def script_parser(description: str, *, n_ctx: int = DEFAULT_N_CTX) -> argparse.ArgumentParser:
    """A script's argument parser: its docstring as help (kept as written) and the model flags."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser, n_ctx=n_ctx)
    return parser


def add_model_args(parser: argparse.ArgumentParser, *, n_ctx: int = DEFAULT_N_CTX) -> None:
    parser.add_argument("--pair", default=None, help="Registered pair (default: 'default').")
    parser.add_argument("--draft", help="Draft GGUF path or registered name (with --target).")
    parser.add_argument("--target", help="Target GGUF path or registered name.")
    parser.add_argument("--n-ctx", type=int, default=n_ctx, help=f"Context length (default {n_ctx}).")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores).")


def model_paths(args: argparse.Namespace) -> tuple[str | None, str]:
    """(draft, target) names or paths the flags choose."""
    from cactus_edge.catalog.registry import resolve_pair

    return resolve_pair(args.pair, args.draft, args.target)


def engine_from_args(args: argparse.Namespace, **settings):
    """The Engine the flags choose; ``settings`` override --n-ctx/--threads (Engine.load's)."""
    from cactus_edge.engine.engine import Engine

    settings = {"n_ctx": args.n_ctx, "n_threads": args.threads, **settings}
    return Engine.load(*model_paths(args), **settings)


def model_flags(args: argparse.Namespace) -> list[str]:
    """The same model flags as a command line, for a script that starts a child process."""
    flags = ["--n-ctx", str(args.n_ctx)]
    flags += ["--draft", args.draft] if args.draft else []
    flags += ["--target", args.target] if args.target else []
    flags += ["--pair", args.pair] if args.pair else []
    return flags + (["--threads", str(args.threads)] if args.threads else [])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(
    url: str, process: subprocess.Popen, *, path: str = "/v1/models", timeout: float = 600
) -> None:
    """Wait until GET ``url + path`` answers 200, or SystemExit when ``process`` exits first or
    ``timeout`` s pass (with the tail of its log when the process has a ``log_path``)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}: {log_tail(process)}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become ready within {timeout} s")


def log_tail(process: subprocess.Popen, n_chars: int = 2000) -> str:
    """The end of a server's log file (``process.log_path``), "" when it has none."""
    log_path = getattr(process, "log_path", None)
    return Path(log_path).read_text()[-n_chars:] if log_path else ""
