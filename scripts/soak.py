"""Soak test: a long chat on one engine, checking the caches after every turn and sampling memory.

    .venv/bin/python scripts/soak.py --pair default --turns 200 --out bench-out/soak

Each turn sends a short user message and streams a short reply. Turns rotate through the methods
and drafters, and some end early on purpose (a cancel after a few tokens, a closed stream, a stop
string), so every exit path runs many times. When the next turn would not fit the context, the
oldest exchanges are dropped, as `/drop` does in the chat, until half the context is free. After
every turn the caches must hold a prefix of prompt + reply according to llama.cpp's own position
range; the resident set size
(RSS) is sampled every 10 turns. Writes soak.json and soak_rss.png (with matplotlib) to --out and
exits non-zero on any inconsistency or when RSS grew by more than --max-growth-mb after the
context first filled (before that, llama.cpp's preallocated KV cache is being paged in).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from script_args import engine_from_args, script_parser

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.engine import Engine

QUESTIONS = [
    "Name one prime number.",
    "Write a Python one-liner that reverses a string.",
    "What does HTTP stand for?",
    "Give a synonym for quick.",
    "Write a SQL query that counts rows in a table named users.",
    "What is 12 times 7?",
    "Name a sorting algorithm.",
    "Write a haiku about the sea.",
]
# (method, drafter, how the turn ends besides length/EOS)
ROTATION = [
    ("cactus", "model", None),
    ("sps", "model", "cancel"),
    ("none", "model", None),
    ("tas", "model+lookup", "close"),
    ("exact", "lookup", None),
    ("cactus", "model", "stop"),
    ("sps", "lookup", None),
]


def rss_mb() -> float:
    """Current resident set size of this process (not the peak)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def fits(engine: Engine, messages: list[dict], max_tokens: int) -> bool:
    return len(engine.tokenize_chat(messages)) + max_tokens + 1 < engine.target.n_ctx


def run_turn(engine: Engine, messages: list[dict], turn: int, max_tokens: int) -> tuple[str, list[int], str]:
    """One reply: (text, tokens, finish_reason), ended the way the rotation says."""
    method, drafter, ending = ROTATION[turn % len(ROTATION)]
    stop = ("\n\n",) if ending == "stop" else ()
    config = GenerationConfig(
        method=method, drafter=drafter, max_tokens=max_tokens, seed=turn, stop=stop, n_draft="auto"
    )
    cancel = threading.Event()
    stream = engine.stream_chat(messages, config, cancel=cancel)
    text, tokens, finish = [], [], "closed"
    for event in stream:
        text.append(event.text)
        if event.token is not None:
            tokens.append(event.token)
        if event.finish_reason is not None:
            finish = event.finish_reason
        if len(tokens) == 5 and ending == "cancel":
            cancel.set()
        if len(tokens) == 7 and ending == "close":
            stream.close()
            break
    return "".join(text), tokens, finish


def soak(engine: Engine, turns: int, max_tokens: int) -> dict:
    messages: list[dict] = []
    samples, problems, finishes, dropped, first_drop = [], [], {}, 0, None
    start = time.perf_counter()
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        if not fits(engine, messages, max_tokens):
            # As a user would: /drop the oldest exchanges until half the context is free, rather
            # than one per turn (each drop changes the prompt's start and costs a full prefill).
            while len(messages) > 1 and not fits(engine, messages, max_tokens + engine.target.n_ctx // 2):
                del messages[:2]
                dropped += 1
                first_drop = turn if first_drop is None else first_drop
        prompt = engine.tokenize_chat(messages)
        text, tokens, finish = run_turn(engine, messages, turn, max_tokens)
        finishes[finish] = finishes.get(finish, 0) + 1
        problems += [f"turn {turn}: {p}" for p in engine.check_caches(prompt + tokens)]
        messages.append({"role": "assistant", "content": text})
        if turn % 10 == 0 or turn == turns - 1:
            samples.append({"turn": turn, "rss_mb": rss_mb(), "seconds": time.perf_counter() - start})
            print(
                f"turn {turn:>4}  rss {samples[-1]['rss_mb']:7.1f} MB  problems {len(problems)}", flush=True
            )
    return {
        "samples": samples,
        "problems": problems,
        "finishes": finishes,
        "dropped_exchanges": dropped,
        "first_drop_turn": first_drop,
    }


def growth(result: dict) -> tuple[float, float]:
    """(RSS growth from the first sample to the last; growth after the context first filled).

    llama.cpp allocates each KV cache for the whole context up front, and the kernel maps its
    pages on first write: RSS climbs until the conversation first fills the context (and the
    first long re-prefill after a /drop touches the batch buffers), then stays flat unless
    something leaks. The second number is the one a leak would move.
    """
    samples = result["samples"]
    total = samples[-1]["rss_mb"] - samples[0]["rss_mb"]
    filled = result["first_drop_turn"]
    after = [s for s in samples if filled is not None and s["turn"] > filled]
    steady = after[-1]["rss_mb"] - after[0]["rss_mb"] if len(after) > 1 else total
    return total, steady


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [s["turn"] for s in result["samples"]]
    rss = [s["rss_mb"] for s in result["samples"]]
    figure, axis = plt.subplots(figsize=(6, 3.2))
    axis.plot(turns, rss, marker="o")
    axis.set_xlabel("chat turn")
    axis.set_ylabel("resident memory (MB)")
    total, steady = growth(result)
    if result["first_drop_turn"] is not None:
        axis.axvline(result["first_drop_turn"], color="grey", linewidth=0.8, linestyle="--")
        axis.annotate(
            "context full: first /drop",
            (result["first_drop_turn"], min(rss)),
            fontsize="small",
            xytext=(4, 4),
            textcoords="offset points",
        )
    axis.set_title(
        f"{turns[-1] + 1} turns, one engine: {total:+.0f} MB in all, "
        f"{steady:+.1f} MB after the context filled",
        fontsize="medium",
    )
    axis.set_ylim(min(rss) - 60, max(rss) + 60)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = script_parser(__doc__, n_ctx=1024)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-growth-mb", type=float, default=50.0)
    parser.add_argument("--out", default="bench-out/soak")
    args = parser.parse_args()
    with engine_from_args(args) as engine:
        result = soak(engine, args.turns, args.max_tokens)
    rss = [s["rss_mb"] for s in result["samples"]]
    result["growth_mb"], result["steady_growth_mb"] = growth(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    try:
        plot(result, out / "soak_rss.png")
    except ImportError:
        print("no plot: pip install matplotlib", file=sys.stderr)
    print(
        f"{args.turns} turns: RSS {rss[0]:.0f} → {rss[-1]:.0f} MB ({result['growth_mb']:+.1f} MB; "
        f"{result['steady_growth_mb']:+.1f} MB after the context first filled at turn "
        f"{result['first_drop_turn']}), {len(result['problems'])} inconsistencies, "
        f"finishes {result['finishes']}, {result['dropped_exchanges']} exchanges dropped"
    )
    for problem in result["problems"][:10]:
        print(problem, file=sys.stderr)
    return 0 if not result["problems"] and result["steady_growth_mb"] <= args.max_growth_mb else 1


if __name__ == "__main__":
    sys.exit(main())
