"""Reading a generation request: the declared and the actual body size, the JSON body, text that
cannot be UTF-8, OpenAI's fields, messages and prompt (read by :mod:`cactus_edge.openai_api`,
answered here as HTTP errors), the tokenized prompt, and the final ``max_tokens``."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..engine.config import GenerationConfig
from ..errors import BackendError, CactusEdgeError, EngineClosedError, InvalidSettingError
from ..openai_api import chat_messages, completion_prompt, parse_request
from .errors import HTTPError, from_library_error
from .exchange import Exchange

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # str holds them only unpaired


class ClientGone(Exception):
    pass


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def check_declared_length(exchange: Exchange, limit: int) -> None:
    """413 from the Content-Length header alone, before any of the body is read (h11 has already
    refused a malformed or negative one)."""
    length = exchange.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)


async def read_json(exchange: Exchange, limit: int) -> Any:
    """The request body as JSON; 413 past ``limit`` bytes (a chunked body has no Content-Length to
    check first); ClientGone if the client hangs up."""
    chunks, size = [], 0
    while True:
        message = await exchange.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    try:
        # Bytes are decoded with "surrogatepass": the raw bytes ED A0 80 become a lone surrogate,
        # exactly like the escape "\ud800"; check_text refuses both.
        return json.loads(b"".join(chunks), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:
        raise HTTPError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None


def check_text(body: Any) -> None:
    """400 naming the first string that holds a lone UTF-16 surrogate: it has no UTF-8 encoding,
    so the tokenizer could not take it (it was a 500). Every string is checked, not only the ones
    known to reach the tokenizer today; iterative, as JSON nests deeper than Python recurses."""
    pending: list[tuple[str, Any]] = [("", body)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            found = _LONE_SURROGATE.search(value)
            if found:
                raise HTTPError(
                    400,
                    f"{path} is not valid Unicode text: it holds a lone surrogate "
                    f"U+{ord(found.group()):04X}, which has no UTF-8 encoding",
                    param=path,
                    code="invalid_value",
                )
        elif isinstance(value, Mapping):
            items = [(f"{path}.{key}" if path else str(key), item) for key, item in value.items()]
            pending.extend(reversed(items))  # popped in document order
        elif isinstance(value, list):
            pending.extend(reversed([(f"{path}[{index}]", item) for index, item in enumerate(value)]))


def parse_body(body: Any, base: GenerationConfig):
    """OpenAI's fields of a generation request, over the server's generation defaults."""
    if not isinstance(body, Mapping):
        raise HTTPError(
            400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    try:
        request = parse_request(body, base=base)
    except InvalidSettingError as error:
        raise from_library_error(error, "messages") from None
    check_text(body)  # after the fields' own checks, which refuse a huge logit_bias faster
    return request


async def tokenize(
    engine,
    body: Mapping,
    chat: bool,
    default_system: str | None,
    slots: asyncio.Semaphore,
    tools: list[dict] | None = None,
) -> list[int]:
    """The prompt's token ids, computed in a worker thread while holding one of ``slots``: a long
    prompt takes seconds of CPU, which the running generation needs too."""
    loop = asyncio.get_running_loop()
    prompt_param = "messages" if chat else "prompt"
    try:
        if chat:
            messages = chat_messages(body.get("messages"), default_system)
            async with slots:
                return await loop.run_in_executor(None, engine.tokenize_chat, messages, tools)
        prompt = completion_prompt(body.get("prompt"))
        if isinstance(prompt, list):
            return prompt  # token ids: Engine.check_request checks they exist
        async with slots:
            return await loop.run_in_executor(None, lambda: engine.tokenize_prompt(prompt, chat=True))
    except (InvalidSettingError, EngineClosedError, BackendError) as error:
        raise from_library_error(error, prompt_param) from None
    except CactusEdgeError as error:  # a chat template refusing the messages
        raise HTTPError(400, str(error), param=prompt_param, code="invalid_value") from None


def final_config(
    config: GenerationConfig, body: Mapping, n_prompt: int, n_ctx: int, cap: int | None
) -> GenerationConfig:
    """max_tokens: the request's, at most the context's room (all of it when it gives none);
    capped at ``cap``."""
    asked = any(body.get(name) is not None for name in ("max_tokens", "max_completion_tokens"))
    max_tokens = min(config.max_tokens, n_ctx - n_prompt) if asked else n_ctx - n_prompt
    if cap is not None:
        max_tokens = min(max_tokens, cap)
    return replace(config, max_tokens=max(1, max_tokens))
