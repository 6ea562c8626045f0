"""OpenAI / llama-cpp-python shaped chat completions over Engine, so embedding apps can switch."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine

# OpenAI's names for the settings we share.
_RENAMES = {"max_completion_tokens": "max_tokens"}


def _config(settings: dict):
    from .engine import GenerationConfig

    settings = {_RENAMES.get(k, k): v for k, v in settings.items() if v is not None}
    if isinstance(settings.get("stop"), list):
        settings["stop"] = tuple(settings["stop"])
    return GenerationConfig(**settings)


def chat_completion(engine: Engine, messages, *, stream: bool, model: str, **settings):
    config = _config(settings)
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    events = engine.stream_chat(messages, config)
    if stream:
        return _chunks(events, completion_id, created, model)
    text, usage, finish, stats = [], None, None, None
    for event in events:
        text.append(event.text)
        if event.finish_reason is not None:
            finish, stats = event.finish_reason, event.stats
    usage = {
        "prompt_tokens": stats.n_prompt_tokens,
        "completion_tokens": stats.n_tokens,
        "total_tokens": stats.n_prompt_tokens + stats.n_tokens,
    }
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(text)},
                "finish_reason": _openai_finish(finish),
            }
        ],
        "usage": usage,
        "speculative": stats.summary(),
    }


def _openai_finish(reason: str | None) -> str | None:
    return "stop" if reason == "cancelled" else reason


def _chunks(events, completion_id: str, created: int, model: str) -> Iterator[dict]:
    def chunk(delta: dict, finish: str | None) -> dict:
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    yield chunk({"role": "assistant"}, None)
    for event in events:
        if event.text:
            yield chunk({"content": event.text}, None)
        if event.finish_reason is not None:
            yield chunk({}, _openai_finish(event.finish_reason))
