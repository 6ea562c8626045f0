"""Errors as HTTP answers: OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``,
the scheduler's refusals, the mapping from the library's exceptions to statuses, and
:func:`quote`, how every message shows a value the client sent."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import (
    CactusEdgeError,
    ContextLengthError,
    EngineBusy,
    EngineClosedError,
    InvalidSettingError,
    UnsupportedParameterError,
    WorkerLostError,
)
from ..openai_api import openai_param
from .settings import RETRY_AFTER_SECONDS

logger = logging.getLogger("cactus_edge.server")

QUOTE_LIMIT = 200  # characters of a client's value an error message shows
# Every message is clipped too: the library's own messages (openai_api) quote values in full,
# so a huge logit_bias would otherwise make a megabytes-long error body.
MESSAGE_LIMIT = 400  # our own longest, the Host refusal with a quoted value, is ~320


def clip(text: str, limit: int) -> str:
    """``text`` if short enough, else its start and end around a note of how much was cut."""
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 2)
    head, tail = text[: keep * 3 // 4], text[len(text) - keep // 4 :]
    return f"{head}…[{len(text) - len(head) - len(tail):,} characters cut]…{tail}"


def quote(value: object) -> str:
    """A value the client sent, as every error message shows it: its repr, at most about
    QUOTE_LIMIT characters."""
    return clip(repr(value), QUOTE_LIMIT)


class HTTPError(Exception):
    """An answer in OpenAI's error envelope; the message is clipped at MESSAGE_LIMIT."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        message = clip(message, MESSAGE_LIMIT)
        param = clip(param, QUOTE_LIMIT) if param else param  # it may hold a client's key
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, tuple(headers)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


def busy_error(message: str, code: str) -> HTTPError:
    return HTTPError(
        503, message, type="server_error", code=code, headers=[("retry-after", str(RETRY_AFTER_SECONDS))]
    )


def model_loading() -> HTTPError:
    return busy_error("the model is loading", "model_loading")


def from_library_error(error: BaseException, prompt_param: str) -> HTTPError:
    """The HTTP answer for a library exception: a request's parsing, the engine's checks
    (Engine.check_request) or a generation before its first event. The library's message is
    kept; this adds OpenAI's status, type, code, and the request's name for the field
    (``prompt_param`` is ``messages`` or ``prompt``)."""
    if isinstance(error, InvalidSettingError):
        code = "unsupported_parameter" if isinstance(error, UnsupportedParameterError) else "invalid_value"
        return HTTPError(400, str(error), param=openai_param(error.param, prompt_param), code=code)
    if isinstance(error, ContextLengthError):
        return HTTPError(400, str(error), param=prompt_param, code="context_length_exceeded")
    if isinstance(error, (ShuttingDown, EngineClosedError)):
        return busy_error("the server is shutting down", "shutting_down")
    if isinstance(error, EngineBusy):
        return busy_error(str(error), "engine_busy")
    if isinstance(error, WorkerLostError):
        # Not the request's fault, and over once the worker is back: the next request reconnects.
        logger.error("RPC worker lost: %s", error)
        return busy_error(str(error), "rpc_worker_lost")
    if isinstance(error, CactusEdgeError):
        logger.error("generation failed: %s: %s", type(error).__name__, error)
        return HTTPError(
            500, f"the generation failed: {error}", type="server_error", code="generation_failed"
        )
    logger.error("unexpected error in a generation", exc_info=error)
    return HTTPError(
        500, "internal server error (logged on the server)", type="server_error", code="internal"
    )
