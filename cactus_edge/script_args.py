"""The model flags every script in scripts/ shares (--pair, or --draft/--target; --n-ctx, --threads),
and the engine they choose: the same rule as the CLI (:func:`registry.resolve_pair`)."""

from __future__ import annotations

import argparse

from .config import DEFAULT_N_CTX


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
    from .registry import resolve_pair

    return resolve_pair(args.pair, args.draft, args.target)


def engine_from_args(args: argparse.Namespace, **settings):
    """The Engine the flags choose; ``settings`` override --n-ctx/--threads (Engine.load's)."""
    from .engine import Engine

    settings = {"n_ctx": args.n_ctx, "n_threads": args.threads, **settings}
    return Engine.load(*model_paths(args), **settings)


def model_flags(args: argparse.Namespace) -> list[str]:
    """The same model flags as a command line, for a script that starts a child process."""
    flags = ["--n-ctx", str(args.n_ctx)]
    flags += ["--draft", args.draft] if args.draft else []
    flags += ["--target", args.target] if args.target else []
    flags += ["--pair", args.pair] if args.pair else []
    return flags + (["--threads", str(args.threads)] if args.threads else [])
