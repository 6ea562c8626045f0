"""`bench --workload switching`: several long coding conversations asked in turn (A B C A B C …),
as a chat app's conversation list or an agent's sub-agents do, each request's time to the first
token against the same request from empty caches on an engine without a prompt cache."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

from ..engine.config import GenerationConfig
from ..engine.engine import Engine
from .bench import load_conversations, load_prompts, timed_generation

SYSTEM = "You are a careful senior engineer. Answer briefly."
OPENING = "Here are some files from my project:\n\n{files}\n\nWhich function would you test first, and why?"
FOLLOW_UPS = (
    "Write one unit test for it.",
    "What would you rename in these files, and to what?",
    "Which error case is not handled yet?",
)
MIN_OPENING_CHARS = 4200  # about 1.2k tokens of code with the Qwen2.5 tokenizer


def code_blocks() -> list[str]:
    """Every fenced code block of the bundled prompts and conversations, in file order."""
    texts = [entry["prompt"] for entry in load_prompts()]
    texts += [turn for entry in load_conversations() for turn in entry["turns"]]
    blocks = []
    for text in texts:
        parts = text.split("```")
        blocks += [f"```{part.rstrip()}\n```" for part in parts[1::2] if part.strip()]
    return blocks


def openings(n_conversations: int) -> list[str]:
    """The first user message of each conversation: the bundled code blocks, starting at another
    block for each conversation (so that no two share more than the system prompt), until the
    message is long enough."""
    blocks = code_blocks()
    stride = max(1, len(blocks) // n_conversations)
    messages = []
    for index in range(n_conversations):
        chosen, length, at = [], 0, index * stride
        while length < MIN_OPENING_CHARS and len(chosen) < len(blocks):
            block = blocks[at % len(blocks)]
            chosen.append(block)
            length += len(block)
            at += 1
        messages.append(OPENING.format(files="\n\n".join(chosen)))
    return messages


def asked_in_turn(texts: list[str], rounds: int) -> Iterator[tuple[int, int, list[dict]]]:
    """(round, conversation, its messages so far) for each request: round r asks each conversation
    opened by ``texts`` its r-th question in turn. The caller appends each reply to the messages."""
    system = {"role": "system", "content": SYSTEM}
    conversations = [[system, {"role": "user", "content": text}] for text in texts]
    for round_index in range(rounds):
        for index, messages in enumerate(conversations):
            if round_index:
                follow_up = FOLLOW_UPS[(round_index - 1) % len(FOLLOW_UPS)]
                messages.append({"role": "user", "content": follow_up})
            yield round_index, index, messages


def run_switching(
    engine: Engine,
    cold_engine: Engine,
    config: GenerationConfig,
    n_conversations: int,
    rounds: int,
    progress: Callable[[str], None],
) -> list[dict]:
    """One record per request: round r asks each conversation its r-th question in turn on
    ``engine``; right after, ``cold_engine`` (no prompt cache) answers the same prompt from empty
    caches, so each return is compared with its own cold first token in the same minute."""
    engine.clear_caches()
    records = []
    for round_index, index, messages in asked_in_turn(openings(n_conversations), rounds):
        prompt = engine.tokenize_chat(messages)
        warm = timed_generation(engine, prompt, config)
        messages.append({"role": "assistant", "content": warm.text})
        cold_engine.clear_caches()
        cold = timed_generation(cold_engine, prompt, config.with_changes(max_tokens=1))
        stats = warm.stats
        records.append(
            {
                "round": round_index,
                "conversation": index,
                "prompt_tokens": len(prompt),
                "cached_tokens": stats.n_prompt_tokens - stats.n_prompt_decoded,
                "source": stats.prompt_cache,
                "ttft_ms": warm.ttft_ms,
                "cold_ttft_ms": cold.ttft_ms,
                "restore_ms": stats.prompt_cache_restore_ms,
                "save_ms": stats.prompt_cache_save_ms,
                "cache_mib": engine.prompt_cache.n_bytes / 2**20,
                "rss_mb": current_rss_mb(),
            }
        )
        progress(
            f"round {round_index} conversation {index}: {len(prompt)} prompt tokens, "
            f"{records[-1]['cached_tokens']} cached ({stats.prompt_cache or 'none'}), first token "
            f"{warm.ttft_ms:.0f} ms against {cold.ttft_ms:.0f} ms cold"
        )
    return records


def current_rss_mb() -> float | None:
    """This process's resident memory now (Linux), None where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def switching_table(records: list[dict], title: str) -> str:
    """Per round, medians of the first token warm and cold and their ratio, and the cache's costs."""
    lines = [
        title,
        "| round | requests | prompt tokens | cached tokens | first token | cold first token | "
        "ratio (median of each request's) | restore ms | save ms | prompt cache, RSS at the end |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for round_index in sorted({r["round"] for r in records}):
        rows = [r for r in records if r["round"] == round_index]
        ratios = [r["ttft_ms"] / r["cold_ttft_ms"] for r in rows if r["cold_ttft_ms"] > 0]
        numbers = [key for key in rows[0] if key not in ("source", "rss_mb")]
        median = {key: statistics.median(r[key] for r in rows) for key in numbers}
        last = rows[-1]
        rss = f"{last['rss_mb']:.0f} MB" if last["rss_mb"] is not None else "–"
        lines.append(
            f"| {round_index + 1} | {len(rows)} | {median['prompt_tokens']:.0f} | "
            f"{median['cached_tokens']:.0f} | {median['ttft_ms']:.0f} ms | {median['cold_ttft_ms']:.0f} ms | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) | "
            f"{median['restore_ms']:.1f} | {median['save_ms']:.1f} | {last['cache_mib']:.0f} MiB, {rss} |"
        )
    return "\n".join(lines) + "\n"


def write_switching(folder: Path, table: str, records: list[dict], settings: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "switching.md").write_text(table)
    (folder / "switching.json").write_text(json.dumps({"settings": settings, "requests": records}, indent=2))
