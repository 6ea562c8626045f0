"""Connection hygiene below the ASGI app, where uvicorn has no setting for it.

* Deadlines for every phase in which the server waits on the client: a connection with no request
  in progress (new, or kept alive) is closed after ``idle_timeout``; a request's headers must
  arrive within ``header_timeout`` of its first byte and its body within ``body_timeout`` of its
  headers (uvicorn has neither: a stalled client held its socket forever). Bytes trickling in do
  not extend a deadline. Once a request is complete there is none: a generation takes its time.
* A cap on open connections below the process's descriptor limit (:func:`connection_cap`):
  20,000 stalled sockets once exhausted the descriptors and /health stopped answering. At the cap
  the oldest connection with no request in progress is closed for the new one; if every one is
  busy, the new one gets 503.
* The answers the protocol layer gives before the app runs (malformed HTTP, a timeout, too many
  connections) in OpenAI's error envelope, like every other error.
* A rate limit on asyncio's "socket.accept() out of system resource" log and uvicorn's
  "Invalid HTTP request received." (:class:`RepeatLimit`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..dependencies import require_names
from .errors import error_body
from .settings import RETRY_AFTER_SECONDS, ServerSettings

# uvicorn has no public per-phase deadlines or connection cap: GuardedH11Protocol overrides these.
require_names(
    H11Protocol,
    (
        "connection_made",
        "connection_lost",
        "data_received",
        "on_response_complete",
        "shutdown",
        "send_400_response",
        "_unset_keepalive_if_required",
    ),
    "uvicorn",
    "the server's connection guard",
)

try:
    import resource
except ImportError:  # Windows: no descriptor limit to stay under
    resource = None

# What a connection is waiting for; the first three have deadlines.
IDLE, HEADERS, BODY, BUSY = "idle", "headers", "body", "busy"
# The kernel's queue of connections waiting for accept(), and how many asyncio accepts per loop
# tick. Small: a flood then waits in the kernel, not in our descriptors.
LISTEN_BACKLOG = 32
# Descriptors the cap leaves free. A socket counts from its protocol's connection_made, two ticks
# after asyncio accepted it in a batch, and a closed one frees its descriptor a tick later, so in
# a flood the process holds a few batches over the cap. Four are kept, plus the process's own
# (models, logs, the event loop, stdio).
FD_RESERVE = 4 * LISTEN_BACKLOG + 64
ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message
INVALID_HTTP_LOG = "Invalid HTTP request received."  # uvicorn's


def connection_cap(configured: int) -> int:
    """``configured``, lowered to stay below the soft RLIMIT_NOFILE by FD_RESERVE."""
    if resource is None:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft - FD_RESERVE))


def raise_descriptor_limit(max_connections: int) -> None:
    """Raise the soft RLIMIT_NOFILE, within the hard one, so that ``max_connections`` fits under
    it (macOS starts processes at 256). Only for a process that is the server (:func:`~.runner.run`):
    an app embedding the server keeps its limits, and the cap adapts to them."""
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    with contextlib.suppress(ValueError, OSError):  # macOS may refuse more than OPEN_MAX: keep soft
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def raw_error(status: int, reason: str, message: str, code: str, extra_headers: str = "") -> bytes:
    """A whole HTTP/1.1 error response, envelope included, that closes the connection: written
    straight to the socket where h11 has no request to answer (or no longer a usable one)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(error_body(message, kind, None, code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra_headers}connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


INVALID_HTTP = raw_error(400, "Bad Request", "invalid HTTP request", "invalid_http_request")
TOO_MANY_CONNECTIONS = raw_error(
    503,
    "Service Unavailable",
    "too many open connections, all busy; retry later",
    "too_many_connections",
    f"retry-after: {RETRY_AFTER_SECONDS}\r\n",
)

SHUTTING_DOWN = raw_error(
    503,
    "Service Unavailable",
    "the server is shutting down",
    "shutting_down",
    f"retry-after: {RETRY_AFTER_SECONDS}\r\n",
)


def _request_timeout(phase: str, seconds: float) -> bytes:
    part = "headers" if phase == HEADERS else "body"
    message = f"the request's {part} did not arrive within {seconds:g} s"
    return raw_error(408, "Request Timeout", message, "request_timeout")


class ConnectionGuard:
    """One server's open connections, oldest first, their deadlines, and how many were closed
    for what (``closed``: idle, headers, body, evicted, refused)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.cap = connection_cap(settings.max_connections)
        self.timeouts = {
            IDLE: settings.idle_timeout,
            HEADERS: settings.header_timeout,
            BODY: settings.body_timeout,
        }
        self.open: dict[GuardedH11Protocol, None] = {}  # a dict keeps arrival order
        self.closed: Counter[str] = Counter()

    def admit(self, connection: GuardedH11Protocol) -> bool:
        """Make room for ``connection`` by closing the oldest one waiting for a request (only
        those: a busy one is somebody's answer); False when every one is busy."""
        if len(self.open) >= self.cap:
            victim = next((c for c in self.open if c.phase in (IDLE, HEADERS)), None)
            if victim is None:
                self.closed["refused"] += 1
                return False
            victim.close_stalled("evicted")
        self.open[connection] = None
        return True

    def forget(self, connection: GuardedH11Protocol) -> None:
        self.open.pop(connection, None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`ConnectionGuard`'s deadlines and cap. ``guard`` is set
    on a subclass per server (:func:`protocol_class`): uvicorn builds protocols from a class."""

    guard: ConnectionGuard
    phase: str | None = None
    _deadline: object | None = None  # asyncio.TimerHandle

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if not self.guard.admit(self):
            self.transport.write(TOO_MANY_CONNECTIONS)
            self.transport.close()
            return
        self._enter(IDLE)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._unset_keepalive_if_required()  # our IDLE deadline owns keep-alive, new or reused
        self._track()

    def shutdown(self) -> None:
        """The server stops: a request still arriving will not be served, so its connection is
        closed now (uvicorn would wait the grace period for it, then cancel it with a traceback)."""
        if self.phase == BODY and (self.cycle is None or not self.cycle.response_started):
            self._disarm()
            self.guard.forget(self)
            self.transport.write(SHUTTING_DOWN)
            self.transport.close()
            return
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (h11 refused it): our envelope instead of uvicorn's plain text."""
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(INVALID_HTTP)
        self.transport.close()

    def close_stalled(self, reason: str) -> None:
        """Close for ``reason`` (a phase whose deadline passed, or "evicted"); a client that was
        sending a request is told so with a 408."""
        self._disarm()
        self.guard.forget(self)
        self.guard.closed[reason] += 1
        if reason in (HEADERS, BODY) and (self.cycle is None or not self.cycle.response_started):
            self.transport.write(_request_timeout(reason, self.guard.timeouts[reason]))
        self.transport.close()

    def _track(self) -> None:
        if self.transport.is_closing():
            return
        phase = self._current_phase()
        if phase != self.phase:
            self._enter(phase)

    def _current_phase(self) -> str:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return BODY
        if state is h11.IDLE:  # between requests: bytes already buffered are a partial request
            return HEADERS if self.conn.trailing_data[0] else IDLE
        return BUSY  # the request is complete (DONE, MUST_CLOSE) or the connection is ending

    def _enter(self, phase: str) -> None:
        """A phase starts its own deadline: staying in a phase never extends one."""
        self.phase = phase
        self._disarm()
        seconds = self.guard.timeouts.get(phase)
        if seconds is not None:
            self._deadline = self.loop.call_later(seconds, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._deadline = None
        if self.phase == phase and not self.transport.is_closing():
            self.close_stalled(phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def protocol_class(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class RepeatLimit(logging.Filter):
    """Lets a message starting with ``prefix`` through at most once per ``interval`` seconds, with
    the count of those dropped since; other messages pass. Out of descriptors, asyncio logs its
    accept error for every socket of a backlog, every loop tick, which floods stderr; uvicorn logs
    every malformed request."""

    def __init__(self, prefix: str, interval: float = 10.0, clock=time.monotonic) -> None:
        super().__init__()
        self.prefix, self.interval, self.clock = prefix, interval, clock
        self._lock = threading.Lock()
        self._next = float("-inf")
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        now = self.clock()
        with self._lock:
            if now < self._next:
                self.dropped += 1
                return False
            self._next = now + self.interval
            dropped, self.dropped = self.dropped, 0
        if dropped:
            record.msg = f"{record.msg} ({dropped:,} more since the last report, not logged)"
        return True


def limit_repeated_logs() -> None:
    """Install the :class:`RepeatLimit` filters, once per process (loggers are global)."""
    for name, prefix in (("asyncio", ACCEPT_ERROR), ("uvicorn.error", INVALID_HTTP_LOG)):
        target = logging.getLogger(name)
        if not any(isinstance(f, RepeatLimit) and f.prefix == prefix for f in target.filters):
            target.addFilter(RepeatLimit(prefix))
