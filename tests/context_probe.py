"""Run by tests/test_context_limits.py in a subprocess, so that a native abort fails a test
instead of killing pytest: loads a pair at one requested n_ctx and generates from prompts of
every length around the requested and the allocated context, with every drafter and long drafts.

    python -m tests.context_probe DRAFT TARGET N_CTX

Prints one JSON object: {"n_ctx": allocated, "outcomes": [[case, length, outcome], ...]} where
outcome is a finish reason, or the name of the typed error raised.
"""

from __future__ import annotations

import json
import sys

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.engine import Engine
from cactus_edge.errors import CactusEdgeError

CONFIGS = {
    "plain": GenerationConfig(method="none", max_tokens=8, seed=0),
    "sps model k=16": GenerationConfig(method="sps", n_draft=16, drafter="model", max_tokens=40, seed=0),
    "cactus lookup k=16": GenerationConfig(
        method="cactus", n_draft=16, drafter="lookup", max_tokens=40, seed=0
    ),
    "defaults": GenerationConfig(max_tokens=40, seed=0),
}


def _prompt(length: int) -> list[int]:
    """A repeating text, so lookup finds continuations and drafts long blocks."""
    cycle = list(range(300, 340))
    return [cycle[i % len(cycle)] for i in range(length)]


def _run(engine: Engine, label: str, tokens: list[int]) -> str:
    try:
        result = engine.generate(tokens, CONFIGS[label])
        outcome = result.finish_reason
        expected = tokens + result.tokens
    except CactusEdgeError as error:
        outcome, expected = type(error).__name__, None
    problems = engine.check_caches(expected)
    return outcome if not problems else f"{outcome}; caches: {problems}"


def _conversation(engine: Engine) -> list[str]:
    """A chat that grows past the context: each turn a finish or a typed error, never an abort."""
    messages, outcomes = [], []
    words = " ".join(["speculative draft token"] * max(1, engine.n_ctx // 48))  # ~n_ctx / 16 tokens
    for turn in range(40):
        messages.append({"role": "user", "content": f"turn {turn}: {words}"})
        try:
            result = engine.chat(messages, GenerationConfig(max_tokens=24, seed=turn))
        except CactusEdgeError as error:
            outcomes.append(type(error).__name__)
            break
        outcomes.append(result.finish_reason)
        messages.append({"role": "assistant", "content": result.text})
    return outcomes


def main(draft: str, target: str, n_ctx: str) -> None:
    with Engine.load(draft, target, n_ctx=int(n_ctx)) as engine:
        allocated = engine.n_ctx
        lengths = sorted({n for base in (int(n_ctx), allocated) for n in (base - 1, base, base + 1) if n > 0})
        outcomes = [[label, n, _run(engine, label, _prompt(n))] for n in lengths for label in CONFIGS]
        print(json.dumps({"n_ctx": allocated, "outcomes": outcomes, "conversation": _conversation(engine)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
