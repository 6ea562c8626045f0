"""The APIs the generation routes speak, each a conversion over chat completions: how a request
body becomes a chat request (:meth:`Api.read`), how the chat reply goes out (a replier: server-sent
events or one JSON body) and how errors look. OpenAI's chat and completions are the base;
Responses and Anthropic's Messages convert in :mod:`cactus_edge.openai_api` and frame here."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.events import StreamEvent
from ..errors import InvalidSettingError
from ..openai_api import ResponseShape, messages, responses
from ..openai_api.replies import Reply
from .errors import HTTPError, from_library_error

logger = logging.getLogger("cactus_edge.server")
HEADER_UNSAFE = re.compile(r"[^A-Za-z0-9_.:/@+-]")  # what a tool name may hold in a header


def sse(data: dict | str, event: str | None = None) -> bytes:
    """One server-sent event; with ``event``, its ``event:`` line (Responses, Messages)."""
    text = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


@dataclass
class Incoming:
    """A request read by its API: the chat request that answers it, and what the reply needs."""

    chat_body: dict
    headers: list[tuple[str, str]] = field(default_factory=list)  # extra response headers
    context: Any = None  # the API's own reading of the request


class Api:
    """OpenAI's chat completions (``chat``) or legacy completions; the base of the others."""

    template = True  # the prompt goes through the chat template (else: a raw prompt)
    prompt_param = "messages"
    params: Mapping[str, str] = {}  # the API's name of a chat field an error names

    def __init__(self, chat: bool = True) -> None:
        if not chat:
            self.template, self.prompt_param = False, "prompt"

    def read(self, body: Any) -> Incoming:
        return Incoming(body)

    def replier(self, incoming: Incoming, parsed, model: str, n_prompt: int):
        shape = ResponseShape.new(self.template, model, parsed.include_usage)
        return ChatReplier(Reply(shape, parsed.tools, parsed.config.logprobs))

    def error_body(self, error: HTTPError) -> dict:
        return error.body()

    def renamed(self, error: HTTPError) -> HTTPError:
        """``error`` naming the API's field where the chat request's differs."""
        if error.param is None:
            return error
        head, dot, rest = error.param.partition(".")
        name = self.params.get(error.param) or (
            self.params[head] + dot + rest if head in self.params else None
        )
        if name is not None:
            error.param = name
        return error

    def library_error(self, error: Exception) -> HTTPError:
        return self.renamed(from_library_error(error, self.prompt_param))


class ChatReplier:
    """Chat completions' frames: a role chunk, chunks, the finish and usage chunks, [DONE]."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply

    def opening(self, first: StreamEvent) -> list[bytes]:
        role = self.reply.shape.role_chunk()
        return [sse(role)] if role is not None else []

    def add(self, event: StreamEvent) -> list[bytes]:
        return [sse(chunk) for chunk in self.reply.add(event)]

    def finish(self, event: StreamEvent, blocks: dict) -> list[bytes]:
        return [*(sse(chunk) for chunk in self.reply.finish(event, blocks)), sse("[DONE]")]

    def complete(self, event: StreamEvent, blocks: dict) -> dict:
        return self.reply.complete(event, blocks)

    def add_quietly(self, event: StreamEvent) -> None:
        self.reply.add_quietly(event)

    def failure(self, error: HTTPError) -> list[bytes]:
        return [sse(error.body())]


def _chat_reply(parsed, model: str) -> Reply:
    """The chat reply a converting API translates: chat shape, usage on the last chunk."""
    return Reply(ResponseShape.new(True, model, include_usage=True), parsed.tools, False)


# --- OpenAI's Responses ------------------------------------------------------------------------


class ResponsesApi(Api):
    prompt_param = "input"
    params = responses.PARAMS

    def __init__(self, store: responses.ResponseStore) -> None:
        self.store = store

    def read(self, body: Any) -> Incoming:
        try:
            request = responses.read_responses_request(body, self.store)
        except InvalidSettingError as error:
            raise self.library_error(error) from None
        headers = _skipped_header(request.skipped_tools, "responses")
        return Incoming(request.chat_body, headers, request)

    def replier(self, incoming: Incoming, parsed, model: str, n_prompt: int):
        api_reply = responses.ResponsesReply(incoming.context, model)
        # Stored before its last event goes out: a client may continue it the moment it has it.
        return ResponsesReplier(
            _chat_reply(parsed, model), api_reply, lambda: self.store.keep(incoming.context, api_reply)
        )


class _Translated:
    """A chat reply's chunks translated into another API's events (``api_reply``)."""

    def __init__(self, reply: Reply, api_reply) -> None:
        self.reply, self.api_reply = reply, api_reply

    def add(self, event: StreamEvent) -> list[bytes]:
        return _framed([e for chunk in self.reply.add(event) for e in self.api_reply.add(chunk)])

    def add_quietly(self, event: StreamEvent) -> None:
        self.reply.add_quietly(event)


class ResponsesReplier(_Translated):
    """``keep``: stores the finished response (if its request asked to)."""

    def __init__(self, reply: Reply, api_reply: responses.ResponsesReply, keep) -> None:
        super().__init__(reply, api_reply)
        self.keep = keep

    def opening(self, first: StreamEvent) -> list[bytes]:
        return _framed(self.api_reply.opening())

    def finish(self, event: StreamEvent, blocks: dict) -> list[bytes]:
        frames = _framed(self.api_reply.finish(self.reply.finish(event, blocks)))
        self.keep()
        return frames

    def complete(self, event: StreamEvent, blocks: dict) -> dict:
        body = self.api_reply.complete(self.reply.complete(event, blocks))
        self.keep()
        return body

    def failure(self, error: HTTPError) -> list[bytes]:
        return _framed(self.api_reply.failure(error.message, error.code or "server_error"))


# --- Anthropic's Messages ----------------------------------------------------------------------


class MessagesApi(Api):
    prompt_param = "messages"
    params = messages.PARAMS

    def read(self, body: Any) -> Incoming:
        try:
            request = messages.read_messages_request(body)
        except InvalidSettingError as error:
            raise self.library_error(error) from None
        headers = _skipped_header(request.skipped_tools, "messages")
        return Incoming(request.chat_body, headers, request)

    def replier(self, incoming: Incoming, parsed, model: str, n_prompt: int):
        return MessagesReplier(_chat_reply(parsed, model), messages.MessagesReply(model, n_prompt))

    def error_body(self, error: HTTPError) -> dict:
        message = error.message
        if error.code == "context_length_exceeded":
            message = f"prompt is too long: {message}"  # the words Anthropic's clients look for
        return messages.error_body(error.status, message)


class MessagesReplier(_Translated):
    def opening(self, first: StreamEvent) -> list[bytes]:
        stats = first.stats
        cached = stats.n_prompt_tokens - stats.n_prompt_decoded if stats is not None else 0
        return _framed(self.api_reply.opening(cached))

    def finish(self, event: StreamEvent, blocks: dict) -> list[bytes]:
        chunks = self.reply.finish(event, blocks)
        return _framed(self.api_reply.finish(chunks, _stop_string(event)))

    def complete(self, event: StreamEvent, blocks: dict) -> dict:
        return self.api_reply.complete(self.reply.complete(event, blocks), _stop_string(event))

    def failure(self, error: HTTPError) -> list[bytes]:
        return _framed(self.api_reply.failure(error.status, error.message))


def _stop_string(event: StreamEvent) -> str | None:
    return event.stats.stop_string if event.stats is not None else None


def _framed(events: list[tuple[str, dict]]) -> list[bytes]:
    return [sse(data, name) for name, data in events]


def _skipped_header(skipped: list[str], api: str) -> list[tuple[str, str]]:
    """Tools left out of the prompt are named in a response header (their names as a header can
    hold them: a client's name may be any text) and logged once per request."""
    if not skipped:
        return []
    logger.info("%s: tools this server cannot run were left out of the prompt: %s", api, skipped)
    names = ", ".join(HEADER_UNSAFE.sub("?", name) for name in skipped)
    return [("x-cactus-edge-skipped-tools", names[:500])]
