"""The Python facade: :func:`create_chat_completion` runs one chat completion on an Engine and
returns what the HTTP server would send for it (the same :mod:`.shapes`), so an embedding app can
switch between the two, or from llama-cpp-python, without changing how it reads responses."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..engine.config import GenerationConfig
from ..engine.events import StreamEvent
from ..errors import CactusEdgeError, InvalidSettingError
from .replies import Reply
from .requests import SPECULATIVE_KEYS, chat_messages, config_for_vocabulary, parse_request, with_openai_param
from .shapes import MODEL_ALIAS, ResponseShape, Timeline, response_blocks

if TYPE_CHECKING:  # only for annotations: importing .engine would load llama.cpp
    from ..engine.engine import Engine


def create_chat_completion(
    engine: Engine, messages: list[dict], *, stream: bool = False, model: str = MODEL_ALIAS, **settings
):
    """One chat completion on ``engine``: a ``chat.completion`` dict, or with ``stream`` an
    iterator of ``chat.completion.chunk`` dicts, shaped as the server's.

    ``settings`` are OpenAI request fields, parsed by :func:`~.requests.parse_request` (harmless
    unknown ones are ignored; meaning-changing ones raise UnsupportedParameterError before the
    engine runs). The speculative settings may also be given flat (``method="sps"``). Errors name
    the request's field (``speculative.drafter``), as the server's do.

    A function of this layer, not an Engine method: the engine imports nothing of OpenAI's. It
    knows the engine by duck type (``stream_chat``), so importing it loads no model library.
    """
    moments = _Moments()
    request = parse_request({**_lift_speculative(settings), "stream": stream, "model": model})
    tools = request.tools.tools if request.tools is not None else None
    try:
        config = config_for_vocabulary(request, engine)
        events = engine.stream_chat(chat_messages(messages), config, tools=tools)
    except InvalidSettingError as error:  # the engine's checks (Engine.check_request)
        raise with_openai_param(error) from error
    shape = ResponseShape.new(chat=True, model=model, include_usage=request.include_usage)
    reply = Reply(shape, request.tools, config.logprobs)
    if request.stream:
        return _chunks(events, reply, config, moments)
    return _completion(events, reply, config, moments)


def _lift_speculative(settings: dict[str, Any]) -> dict[str, Any]:
    """Python callers have always passed GenerationConfig's speculative fields flat; move them
    into the ``speculative`` object that parse_request reads (flat values win)."""
    flat = {key: settings[key] for key in SPECULATIVE_KEYS if key in settings}
    nested = settings.get("speculative")
    if not flat or not (nested is None or isinstance(nested, Mapping)):
        return settings  # nothing to move, or a malformed object parse_request will report
    rest = {key: value for key, value in settings.items() if key not in SPECULATIVE_KEYS}
    return {**rest, "speculative": {**(nested or {}), **flat}}


class _Moments:
    """The request's :class:`~.shapes.Timeline` as the facade sees it: it arrives at the call,
    starts when its events are first asked for (the engine is taken there)."""

    def __init__(self) -> None:
        self.arrived = time.perf_counter()
        self.started: float | None = None
        self.first_token: float | None = None

    def watch(self, events: Iterable[StreamEvent]) -> Iterator[StreamEvent]:
        self.started = time.perf_counter()
        for event in events:
            if event.token is not None and self.first_token is None:
                self.first_token = time.perf_counter()
            yield event

    def timeline(self) -> Timeline:
        return Timeline(self.arrived, self.started, self.first_token, time.perf_counter())


def _completion(
    events: Iterator[StreamEvent], reply: Reply, config: GenerationConfig, moments: _Moments
) -> dict:
    with contextlib.closing(events):
        for event in moments.watch(events):
            if event.finish_reason is not None:
                blocks = response_blocks(event.stats, config, moments.timeline())
                return reply.complete(event, blocks)
            reply.add_quietly(event)
    raise CactusEdgeError("the engine's stream ended without a final event")


def _chunks(
    events: Iterator[StreamEvent], reply: Reply, config: GenerationConfig, moments: _Moments
) -> Iterator[dict]:
    """The server's stream, chunk for chunk: a role chunk, content (or tool-call) chunks, the
    finish chunk with our blocks and, with include_usage, the usage chunk. Closing it ends the
    generation."""
    with contextlib.closing(events):
        yield reply.shape.role_chunk()
        for event in moments.watch(events):
            if event.finish_reason is not None:
                blocks = response_blocks(event.stats, config, moments.timeline())
                yield from reply.finish(event, blocks)
                return
            yield from reply.add(event)
