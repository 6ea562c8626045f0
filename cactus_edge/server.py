"""`cactus-edge serve`: an OpenAI-compatible HTTP server over one Engine, for desktop apps.

Layout:

* :class:`ServerApp` is a plain ASGI application over an Engine (or none yet: ``/health`` says 503
  while the CLI loads the models, then :meth:`ServerApp.attach` makes it ready). It checks every
  request (Host, Origin, API key, size), parses it with :func:`~cactus_edge.openai_compat.parse_request`,
  tokenizes it, checks it fits the context and hands it to the scheduler.
* :class:`Scheduler` owns the engine: ONE worker thread runs one generation at a time, in arrival
  order, from a bounded queue (``max_queue`` waiting behind the running one; more get 503). A
  running generation is never pre-empted. A request whose client goes away is withdrawn from the
  queue, or, if it runs, cancelled at the engine's next step (the engine leaves its caches
  consistent, so the next request sees what a fresh engine would give).
* :class:`Server` runs the app on uvicorn (h11, asyncio) in a background thread, on a socket it
  binds itself (so port 0 is known before serving); :func:`run` is what the CLI calls: signals,
  loading, the ready line, a clean shutdown.

``/v1/models``, ``/health`` and ``/metrics`` never touch the engine or wait for it.

Every error is OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import hmac
import itertools
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .config import GenerationConfig
from .errors import (
    BackendError,
    CactusEdgeError,
    ContextLengthError,
    EngineBusy,
    EngineClosedError,
    InvalidSettingError,
    UnsupportedParameterError,
)
from .openai_compat import parse_request
from .stats import GenerationStats, StreamEvent

logger = logging.getLogger("cactus_edge.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765  # not llama-server's 8080, llama-cpp-python's 8000, LM Studio's 1234, Ollama's 11434
DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
API_KEY_ENV = "CACTUS_EDGE_API_KEY"
MODEL_ALIAS = "cactus-edge"  # always accepted as `model`, whatever the served id
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
KL_BUCKETS = (0.0, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
RETRY_AFTER_SECONDS = 1


# --- settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """How the server listens and what it lets through.

    host/port: TCP address (port 0: a free port). uds: a Unix socket path instead of TCP.
    api_key: required as ``Authorization: Bearer KEY`` on every route but /health (None: no key).
    cors_origins: browser origins allowed to call (none by default; "*" = any, never with credentials).
    allowed_hosts: Host header names accepted besides localhost, 127.0.0.1 and [::1] ("*" = any).
    max_queue: requests that may wait behind the running one; more get 503 + Retry-After.
    max_tokens_cap: the most tokens one request may generate (None: the context's room).
    metrics: serve GET /metrics (Prometheus text).
    max_body_bytes: larger request bodies get 413.
    model_name: the id /v1/models lists and requests may name (``cactus-edge`` always works too).
    base_config: generation defaults that requests override (the CLI's flags).
    default_system: a system message added to chat requests that have none.
    shutdown_grace: seconds open connections get to finish when the server stops.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    uds: str | None = None
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_queue: int = DEFAULT_MAX_QUEUE
    max_tokens_cap: int | None = None
    metrics: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_name: str = MODEL_ALIAS
    base_config: GenerationConfig = field(default_factory=GenerationConfig)
    default_system: str | None = None
    shutdown_grace: float = 3.0

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise InvalidSettingError(f"max_queue must be >= 0, got {self.max_queue}", param="max_queue")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise InvalidSettingError(
                f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}", param="max_tokens_cap"
            )
        if self.max_body_bytes < 1024:
            raise InvalidSettingError(
                f"max_body_bytes must be >= 1024, got {self.max_body_bytes}", param="max_body_bytes"
            )
        if not 0 <= self.port <= 65535:
            raise InvalidSettingError(f"port must be in [0, 65535], got {self.port}", param="port")
        if self.api_key is not None and not self.api_key:
            raise InvalidSettingError("the API key must not be empty", param="api_key")
        for origin in self.cors_origins:
            if origin != "*" and ("://" not in origin or origin.endswith("/")):
                raise InvalidSettingError(
                    f"a CORS origin looks like scheme://host[:port] (no path, no trailing /), got {origin!r}",
                    param="cors_origin",
                )

    @property
    def accepted_hosts(self) -> frozenset[str]:
        names = {_normalize_host(name) for name in self.allowed_hosts}
        if self.uds is None and self.host not in ("0.0.0.0", "::", ""):
            names.add(_normalize_host(self.host))  # the address we bind is never a rebinding
        return LOOPBACK_HOSTS | names


def _normalize_host(name: str) -> str:
    name = name.strip().lower()
    if ":" in name and not name.startswith("["):
        return f"[{name}]"  # a bare IPv6 address
    return name


def _host_name(header: str) -> str | None:
    """The host part of a Host header ("[::1]:8765" → "[::1]"); None when malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return None
        name, rest = header[: end + 1], header[end + 1 :]
    else:
        name, _, port = header.partition(":")
        rest = f":{port}" if port or header.endswith(":") else ""
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    return name or None


# --- errors ------------------------------------------------------------------------------------


class HTTPError(Exception):
    """An answer in OpenAI's error envelope."""

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


def _busy(message: str, code: str) -> HTTPError:
    return HTTPError(
        503, message, type="server_error", code=code, headers=[("retry-after", str(RETRY_AFTER_SECONDS))]
    )


def _from_library_error(error: BaseException, prompt_param: str) -> HTTPError:
    """The HTTP answer for an exception a generation raised before its first event."""
    if isinstance(error, UnsupportedParameterError):
        return HTTPError(400, str(error), param=error.param, code="unsupported_parameter")
    if isinstance(error, InvalidSettingError):
        return HTTPError(400, str(error), param=error.param, code="invalid_value")
    if isinstance(error, ContextLengthError):
        return HTTPError(400, str(error), param=prompt_param, code="context_length_exceeded")
    if isinstance(error, (ShuttingDown, EngineClosedError)):
        return _busy("the server is shutting down", "shutting_down")
    if isinstance(error, EngineBusy):
        return _busy(str(error), "engine_busy")
    if isinstance(error, CactusEdgeError):
        logger.error("generation failed: %s: %s", type(error).__name__, error)
        return HTTPError(
            500, f"the generation failed: {error}", type="server_error", code="generation_failed"
        )
    logger.error("unexpected error in a generation", exc_info=error)
    return HTTPError(
        500, "internal server error (logged on the server)", type="server_error", code="internal"
    )


# --- metrics -----------------------------------------------------------------------------------


class Metrics:
    """Counters for GET /metrics (Prometheus text format); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.generations: Counter[str] = Counter()  # by finish reason (stop, length, cancelled, error)
        self.prompt_tokens = self.completion_tokens = 0
        self.drafted = self.accepted = self.verifier_calls = 0
        self.kl_buckets = [0] * len(KL_BUCKETS)
        self.kl_sum, self.kl_count = 0.0, 0

    def count_request(self, status: int) -> None:
        with self._lock:
            self.requests[str(status)] += 1

    def count_failed_generation(self) -> None:
        with self._lock:
            self.generations["error"] += 1

    def record_generation(self, stats: GenerationStats, finish: str) -> None:
        with self._lock:
            self.generations[finish] += 1
            self.prompt_tokens += stats.n_prompt_tokens
            self.completion_tokens += stats.n_tokens
            self.drafted += stats.n_drafted
            self.accepted += stats.n_accepted
            self.verifier_calls += stats.n_verifier_calls
            kl = stats.kl_mean
            if kl is not None:
                self.kl_sum += kl
                self.kl_count += 1
                for index, bound in enumerate(KL_BUCKETS):
                    if kl <= bound:
                        self.kl_buckets[index] += 1

    def render(self, waiting: int, running: int) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP cactus_edge_{name} {help}")
            lines.append(f"# TYPE cactus_edge_{name} {kind}")
            lines.extend(f"cactus_edge_{name}{labels} {_number(value)}" for labels, value in samples)

        with self._lock:
            metric(
                "requests_total",
                "counter",
                "HTTP requests answered, by status code (499: the client went away).",
                [(f'{{status="{s}"}}', n) for s, n in sorted(self.requests.items())],
            )
            metric(
                "generations_total",
                "counter",
                "Generations run, by finish reason.",
                [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.generations.items())],
            )
            for name, help, value in (
                ("prompt_tokens_total", "Prompt tokens of finished generations.", self.prompt_tokens),
                ("completion_tokens_total", "Tokens generated.", self.completion_tokens),
                ("draft_tokens_total", "Draft tokens proposed.", self.drafted),
                ("draft_tokens_accepted_total", "Draft tokens accepted.", self.accepted),
                ("verifier_calls_total", "Target (verifier) forward passes.", self.verifier_calls),
            ):
                metric(name, "counter", help, [("", value)])
            metric("queue_depth", "gauge", "Requests waiting for the engine.", [("", waiting)])
            metric("requests_running", "gauge", "Generations running (0 or 1).", [("", running)])
            buckets = [
                (f'_bucket{{le="{_number(b)}"}}', n) for b, n in zip(KL_BUCKETS, self.kl_buckets, strict=True)
            ]
            buckets.append(('_bucket{le="+Inf"}', self.kl_count))
            metric(
                "response_kl_mean",
                "histogram",
                "Per-response mean KL(output || target) of decided draft positions (0 when lossless).",
                [*buckets, ("_sum", self.kl_sum), ("_count", self.kl_count)],
            )
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


# --- jobs and the scheduler --------------------------------------------------------------------


class Job:
    """One admitted generation request: the worker thread feeds its events to the handler's
    asyncio queue; ``cancel`` ends it at the engine's next step."""

    def __init__(
        self,
        prompt: list[int],
        config: GenerationConfig,
        loop: asyncio.AbstractEventLoop,
        ticket: int,
        arrived: float,
    ) -> None:
        self.prompt, self.config, self.loop, self.ticket, self.arrived = prompt, config, loop, ticket, arrived
        self.cancel = threading.Event()
        self.items: asyncio.Queue = asyncio.Queue()
        self.started: float | None = None
        self.first_token: float | None = None
        self.done = False

    def __lt__(self, other: Job) -> bool:
        return self.ticket < other.ticket

    def put(self, kind: str, value: Any = None) -> None:
        """From any thread: hand an item to the request's handler."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancel.set()


class Scheduler:
    """One worker thread that owns the engine and runs admitted jobs in ticket (arrival) order."""

    def __init__(self, engine, max_queue: int, metrics: Metrics) -> None:
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._cond = threading.Condition()
        self._waiting: list[Job] = []  # a heap by ticket
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="cactus-edge-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return int(self._running is not None)

    def submit(self, job: Job) -> None:
        """Admit ``job`` or raise QueueFull / ShuttingDown. At most one job runs and ``max_queue``
        wait: counting the admitted ones, not the worker's progress, keeps this deterministic."""
        with self._cond:
            if self._closed:
                raise ShuttingDown
            if len(self._waiting) + (self._running is not None) > self.max_queue:
                raise QueueFull
            heapq.heappush(self._waiting, job)
            self._cond.notify_all()

    def withdraw(self, job: Job) -> None:
        """The client went away: drop the job if it waits, cancel it if it runs."""
        job.cancel.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                heapq.heapify(self._waiting)

    def shutdown(self) -> None:
        """Refuse new jobs, fail the waiting ones, cancel the running one at its next step."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            running = self._running
            self._cond.notify_all()
        for job in waiting:
            job.cancel.set()
            job.put("error", ShuttingDown())
            job.put("end")
        if running is not None:
            running.cancel.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = heapq.heappop(self._waiting)
                self._running = job
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        try:
            if job.cancel.is_set():
                return
            job.started = time.perf_counter()
            events = self.engine.stream(job.prompt, job.config, cancel=job.cancel)
            with contextlib.closing(events):
                for event in events:
                    if event.token is not None and job.first_token is None:
                        job.first_token = time.perf_counter()
                    job.put("event", event)
                    if event.finish_reason is not None:
                        self.metrics.record_generation(event.stats, event.finish_reason)
        except Exception as error:  # handed to the request; the worker goes on
            self.metrics.count_failed_generation()
            job.put("error", error)
        finally:
            job.put("end")


# --- response shapes ---------------------------------------------------------------------------


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"  # cancelled or a stop string: stopped on our side


def response_blocks(stats: GenerationStats, config: GenerationConfig, job: Job) -> dict:
    """usage, llama-server ``timings``, LM Studio ``stats`` and our ``speculative`` block."""
    cached = stats.n_prompt_tokens - stats.n_prompt_decoded
    decided = sum(step.n_decided for step in stats.steps)
    end = time.perf_counter()
    first = job.first_token if job.first_token is not None else end
    prompt_per_second = stats.n_prompt_decoded / (stats.prefill_ms / 1000) if stats.prefill_ms > 0 else 0.0
    return {
        "usage": {
            "prompt_tokens": stats.n_prompt_tokens,
            "completion_tokens": stats.n_tokens,
            "total_tokens": stats.n_prompt_tokens + stats.n_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
        "timings": {
            "cache_n": cached,
            "prompt_n": stats.n_prompt_decoded,
            "prompt_ms": stats.prefill_ms,
            "prompt_per_token_ms": stats.prefill_ms / stats.n_prompt_decoded
            if stats.n_prompt_decoded
            else 0.0,
            "prompt_per_second": prompt_per_second,
            "predicted_n": stats.n_tokens,
            "predicted_ms": stats.decode_ms,
            "predicted_per_token_ms": stats.decode_ms / stats.n_tokens if stats.n_tokens else 0.0,
            "predicted_per_second": stats.tokens_per_second,
            "draft_n": stats.n_drafted,
            "draft_n_accepted": stats.n_accepted,
        },
        "stats": {
            "tokens_per_second": stats.tokens_per_second,
            "time_to_first_token": first - job.arrived,
            "generation_time": end - (job.started or job.arrived),
            "queue_time": (job.started or end) - job.arrived,
            "stop_reason": stats.finish_reason,
            "total_draft_tokens_count": stats.n_drafted,
            "accepted_draft_tokens_count": stats.n_accepted,
            "rejected_draft_tokens_count": stats.n_drafted - stats.n_accepted,
            "ignored_draft_tokens_count": stats.n_drafted - decided,
        },
        "speculative": {
            "method": stats.method,
            "delta": config.delta if config.method == "cactus" else None,
            "lossless": not stats.lossy,
            "n_draft": config.n_draft,
            "drafter": config.drafter if config.method != "none" else None,
            "acceptance_length": stats.acceptance_length,
            "tokens_per_verifier_call": stats.tokens_per_verifier_call,
            "verifier_calls": stats.n_verifier_calls,
            "drafted": stats.n_drafted,
            "accepted": stats.n_accepted,
            "draft_length_histogram": {str(k): v for k, v in stats.draft_length_histogram.items()},
            "accepted_by_position": list(stats.accepted_by_position),
            "kl_mean": stats.kl_mean,
            "kl_total": stats.kl_total,
            "kl_budget": getattr(config, "kl_budget", None),
        },
    }


class _Shape:
    """Chat (``chat.completion``) or legacy completions (``text_completion``) bodies and chunks."""

    def __init__(self, chat: bool, model: str, include_usage: bool) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def complete(self, text: str, finish: str, blocks: dict) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            return {**self._envelope("chat.completion", [choice]), **blocks}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._envelope("text_completion", [choice]), **blocks}

    def chunk(self, choices: list[dict], **extra) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)
        if self.include_usage:
            body["usage"] = None
        return {**body, **extra}

    def role_chunk(self) -> dict | None:
        return self.chunk([self._choice(None, None, role=True)]) if self.chat else None

    def text_chunk(self, text: str) -> dict:
        return self.chunk([self._choice(text, None)])

    def final_chunks(self, finish: str, blocks: dict) -> list[dict]:
        extra = {key: value for key, value in blocks.items() if key != "usage"}
        if not self.include_usage:
            extra["usage"] = blocks["usage"]  # not OpenAI's, harmless: every response carries usage
        chunks = [self.chunk([self._choice(None if self.chat else "", finish)], **extra)]
        if self.include_usage:
            chunks.append({**self.chunk([]), **blocks})
        return chunks


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


# --- the ASGI application ----------------------------------------------------------------------


class _Exchange:
    """One HTTP request/response: the scope, the ASGI callables, and what was sent."""

    def __init__(self, scope, receive, send, cors_headers: list[tuple[bytes, bytes]]) -> None:
        self.scope, self.receive, self._send = scope, receive, send
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.cors_headers = cors_headers
        self.status: int | None = None
        self.started = False

    async def start(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        self.status, self.started = status, True
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers] + self.cors_headers
        await self._send({"type": "http.response.start", "status": status, "headers": raw})

    async def body(self, data: bytes, more: bool = False) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def send_json(self, status: int, body: Any, headers: Sequence[tuple[str, str]] = ()) -> None:
        data = json.dumps(body).encode()
        await self.start(
            status,
            [("content-type", "application/json"), ("content-length", str(len(data))), *headers],
        )
        await self.body(data)

    async def send_text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode()
        await self.start(status, [("content-type", content_type), ("content-length", str(len(data)))])
        await self.body(data)

    async def send_error(self, error: HTTPError) -> None:
        await self.send_json(error.status, error.body(), error.headers)


class ServerApp:
    """The ASGI application. ``engine`` may be None until :meth:`attach` (the server then answers
    /health with 503 "loading" and generation requests with 503)."""

    def __init__(self, engine=None, settings: ServerSettings | None = None) -> None:
        self.settings = settings or ServerSettings()
        self.metrics = Metrics()
        self.engine = None
        self.scheduler: Scheduler | None = None
        self._tickets = itertools.count()
        self._hosts = self.settings.accepted_hosts
        self._created = int(time.time())
        self._routes: dict[str, tuple[str, Callable]] = {
            "/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
        }
        if self.settings.metrics:
            self._routes["/metrics"] = ("GET", self._metrics)
        for path in ("/models", "/chat/completions", "/completions"):  # base_url without /v1
            self._routes[path] = self._routes[f"/v1{path}"]
        if engine is not None:
            self.attach(engine)

    # --- lifecycle

    def attach(self, engine) -> None:
        """The engine is loaded: start serving generations."""
        self.engine = engine
        self.scheduler = Scheduler(engine, self.settings.max_queue, self.metrics)

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    def shutdown(self, wait: float = 5.0) -> bool:
        """Refuse new generations, fail waiting ones, cancel the running one; True once the worker
        thread has ended (within ``wait`` seconds)."""
        if self.scheduler is None:
            return True
        self.scheduler.shutdown()
        return self.scheduler.join(wait)

    # --- ASGI entry

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets are not served (uvicorn runs with ws="none")
        exchange = _Exchange(scope, receive, send, [])
        try:
            await self._handle(exchange)
        except HTTPError as error:
            if not exchange.started:
                await exchange.send_error(error)
        except Exception:
            logger.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if not exchange.started:
                await exchange.send_error(
                    HTTPError(
                        500,
                        "internal server error (logged on the server)",
                        type="server_error",
                        code="internal",
                    )
                )
        finally:
            self.metrics.count_request(exchange.status or 499)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _handle(self, exchange: _Exchange) -> None:
        self._check_host(exchange)
        self._check_origin(exchange)
        method, path = exchange.scope["method"], exchange.scope["path"]
        if method == "OPTIONS":
            await self._preflight(exchange)
            return
        route = self._routes.get(path)
        if route is None and path.startswith(("/v1/models/", "/models/")):
            route = ("GET", self._model)
        if route is None:
            raise HTTPError(404, f"unknown route {method} {path}", code="unknown_url")
        if method != route[0]:
            raise HTTPError(
                405,
                f"{path} takes {route[0]}, not {method}",
                code="method_not_allowed",
                headers=[("allow", route[0])],
            )
        if path != "/health":
            self._check_api_key(exchange)
        await route[1](exchange)

    # --- checks

    def _check_host(self, exchange: _Exchange) -> None:
        header = exchange.headers.get("host")
        if header is None or "*" in self.settings.allowed_hosts:
            return  # HTTP/1.0 without Host: not a browser, so not a rebinding attack
        name = _host_name(header)
        if name is None or name not in self._hosts:
            raise HTTPError(
                403,
                f"Host {header!r} is not allowed (DNS rebinding protection); "
                "start the server with --allowed-host NAME to accept it",
                code="host_not_allowed",
            )

    def _check_origin(self, exchange: _Exchange) -> None:
        origin = exchange.headers.get("origin")
        if origin is None:
            return
        origins = self.settings.cors_origins
        if "*" in origins:
            exchange.cors_headers = [(b"access-control-allow-origin", b"*")]
        elif origin in origins:
            exchange.cors_headers = [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"vary", b"Origin"),
            ]
        else:
            raise HTTPError(
                403,
                f"Origin {origin!r} is not allowed; start the server with --cors-origin {origin} to allow it",
                code="origin_not_allowed",
            )

    def _check_api_key(self, exchange: _Exchange) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, token = exchange.headers.get("authorization", "").strip().partition(" ")
        given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, key.encode()):
            raise HTTPError(
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                code="invalid_api_key",
                headers=[("www-authenticate", "Bearer")],
            )

    async def _preflight(self, exchange: _Exchange) -> None:
        requested = exchange.headers.get("access-control-request-headers", "authorization, content-type")
        headers = [("allow", "GET, POST, OPTIONS"), ("content-length", "0")]
        if exchange.cors_headers:
            headers += [
                ("access-control-allow-methods", "GET, POST, OPTIONS"),
                ("access-control-allow-headers", requested),
                ("access-control-max-age", "600"),
            ]
        await exchange.start(204, headers)
        await exchange.body(b"")

    # --- simple routes (never touch the engine)

    async def _health(self, exchange: _Exchange) -> None:
        if self.ready:
            await exchange.send_json(200, {"status": "ok"})
        else:
            body = {
                "status": "loading",
                **error_body("the model is loading", "server_error", code="model_loading"),
            }
            await exchange.send_json(503, body, [("retry-after", str(RETRY_AFTER_SECONDS))])

    def _model_card(self) -> dict:
        card = {
            "id": self.settings.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "cactus-edge",
        }
        engine = self.engine
        if engine is not None:
            card["meta"] = {
                "n_ctx": engine.target.n_ctx,
                "target": Path(str(getattr(engine.target, "path", ""))).name or None,
                "draft": Path(str(engine.draft.path)).name if getattr(engine, "draft", None) else None,
                "method": self.settings.base_config.method,
            }
        return card

    async def _models(self, exchange: _Exchange) -> None:
        await exchange.send_json(200, {"object": "list", "data": [self._model_card()]})

    async def _model(self, exchange: _Exchange) -> None:
        name = exchange.scope["path"].split("/models/", 1)[1]
        self._check_model(name)
        await exchange.send_json(200, self._model_card())

    async def _metrics(self, exchange: _Exchange) -> None:
        scheduler = self.scheduler
        waiting, running = (scheduler.waiting, scheduler.running) if scheduler else (0, 0)
        await exchange.send_text(200, self.metrics.render(waiting, running), "text/plain; version=0.0.4")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.settings.model_name, MODEL_ALIAS):
            raise HTTPError(
                404,
                f"the model {name!r} does not exist; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # --- generation routes

    async def _chat(self, exchange: _Exchange) -> None:
        await self._generate(exchange, chat=True)

    async def _completions(self, exchange: _Exchange) -> None:
        await self._generate(exchange, chat=False)

    async def _read_json(self, exchange: _Exchange) -> Any:
        limit = self.settings.max_body_bytes
        too_large = HTTPError(
            413, f"the request body is larger than {limit} bytes", param=None, code="request_too_large"
        )
        length = exchange.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        while True:
            message = await exchange.receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        try:
            return json.loads(b"".join(chunks), parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as error:
            raise HTTPError(
                400, f"the request body is not valid JSON: {error}", code="invalid_json"
            ) from None

    async def _generate(self, exchange: _Exchange, chat: bool) -> None:
        arrived = time.perf_counter()
        ticket = next(self._tickets)  # arrival order, kept through tokenization
        try:
            body = await self._read_json(exchange)
        except _ClientGone:
            return
        if not isinstance(body, Mapping):
            raise HTTPError(
                400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
            )
        try:
            request = parse_request(body, base=self.settings.base_config)
        except InvalidSettingError as error:
            raise _from_library_error(error, "messages") from None
        self._check_model(request.model)
        engine, scheduler = self.engine, self.scheduler
        if scheduler is None:
            raise _busy("the model is loading", "model_loading")
        prompt_param = "messages" if chat else "prompt"
        prompt = await self._tokenize(engine, body, chat)
        n_ctx = engine.target.n_ctx
        if len(prompt) >= n_ctx:
            raise HTTPError(
                400,
                f"This model's maximum context length is {n_ctx} tokens. However, your "
                f"{prompt_param} resulted in {len(prompt)} tokens.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        config = self._final_config(request.config, body, len(prompt), n_ctx)
        if config.uses_model and getattr(engine, "draft", None) is None:
            raise HTTPError(
                400,
                f"drafter {config.drafter!r} needs a draft model and this server has none; "
                'use "speculative": {"drafter": "lookup"} or {"method": "none"}',
                param="speculative.drafter",
                code="invalid_value",
            )
        job = Job(prompt, config, asyncio.get_running_loop(), ticket, arrived)
        try:
            scheduler.submit(job)
        except QueueFull:
            raise _busy(
                f"the queue is full ({self.settings.max_queue} waiting); retry later",
                "queue_full",
            ) from None
        except ShuttingDown:
            raise _busy("the server is shutting down", "shutting_down") from None
        shape = _Shape(chat, request.model or self.settings.model_name, request.include_usage)
        watcher = asyncio.ensure_future(self._watch_disconnect(exchange, job))
        try:
            if request.stream:
                await self._stream(exchange, job, shape, prompt_param)
            else:
                await self._complete(exchange, job, shape, prompt_param)
        finally:
            watcher.cancel()
            if not job.done:
                scheduler.withdraw(job)

    async def _tokenize(self, engine, body: Mapping, chat: bool) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            if chat:
                messages = self._messages(body)
                return await loop.run_in_executor(None, engine.tokenize_chat, messages)
            prompt = _prompt(body, engine.target.vocab_size)
            if isinstance(prompt, list):
                return prompt
            return await loop.run_in_executor(None, lambda: engine.tokenize_prompt(prompt, chat=True))
        except (InvalidSettingError, EngineClosedError, BackendError) as error:
            raise _from_library_error(error, "prompt") from None
        except CactusEdgeError as error:  # a chat template refusing the messages
            raise HTTPError(
                400, str(error), param="messages" if chat else "prompt", code="invalid_value"
            ) from None

    def _messages(self, body: Mapping) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPError(
                400, "messages must be a non-empty array of messages", param="messages", code="invalid_value"
            )
        out = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise HTTPError(
                    400,
                    f"messages[{index}] must be an object with a string 'role'",
                    param="messages",
                    code="invalid_value",
                )
            message = dict(message)
            if message["role"] == "developer":  # OpenAI's newer name for the system role
                message["role"] = "system"
            if message.get("content") is None:
                message["content"] = ""
            out.append(message)
        system = self.settings.default_system
        if system and not any(m["role"] == "system" for m in out):
            out.insert(0, {"role": "system", "content": system})
        return out

    def _final_config(
        self, config: GenerationConfig, body: Mapping, n_prompt: int, n_ctx: int
    ) -> GenerationConfig:
        """max_tokens: the request's, or the context's room when it gives none; capped."""
        asked = any(body.get(name) is not None for name in ("max_tokens", "max_completion_tokens"))
        max_tokens = config.max_tokens if asked else n_ctx - n_prompt
        if self.settings.max_tokens_cap is not None:
            max_tokens = min(max_tokens, self.settings.max_tokens_cap)
        return replace(config, max_tokens=max(1, max_tokens))

    async def _watch_disconnect(self, exchange: _Exchange, job: Job) -> None:
        while True:
            message = await exchange.receive()
            if message["type"] == "http.disconnect":
                if not job.done:
                    self.scheduler.withdraw(job)
                    job.items.put_nowait(("disconnected", None))
                return

    async def _next(self, job: Job) -> tuple[str, Any]:
        kind, value = await job.items.get()
        if kind in ("end", "disconnected"):
            job.done = job.done or kind == "end"
        return kind, value

    async def _next_event(self, job: Job, prompt_param: str) -> StreamEvent | None:
        """The job's next event; None when the client is gone. An error raised before the
        generation's end becomes its HTTP answer; an end without a final event is a 500."""
        kind, value = await self._next(job)
        if kind == "disconnected":
            return None
        if kind == "error":
            raise _from_library_error(value, prompt_param)
        if kind == "end":
            raise HTTPError(
                500, "the generation ended without a result", type="server_error", code="internal"
            )
        return value

    async def _complete(self, exchange: _Exchange, job: Job, shape: _Shape, prompt_param: str) -> None:
        text: list[str] = []
        while True:
            event = await self._next_event(job, prompt_param)
            if event is None:
                return
            text.append(event.text)
            if event.finish_reason is not None:
                job.done = True
                blocks = response_blocks(event.stats, job.config, job)
                await exchange.send_json(
                    200, shape.complete("".join(text), _finish(event.finish_reason), blocks)
                )
                return

    async def _stream(self, exchange: _Exchange, job: Job, shape: _Shape, prompt_param: str) -> None:
        # The status is sent with the first event: an error before it (a shutdown while queued, a
        # refused setting) still gets its own status and envelope.
        first = await self._next_event(job, prompt_param)
        if first is None:
            return
        await exchange.start(
            200,
            [
                ("content-type", "text/event-stream; charset=utf-8"),
                ("cache-control", "no-cache"),
                ("x-accel-buffering", "no"),
            ],
        )
        role = shape.role_chunk()
        if role is not None:
            await exchange.body(_sse(role), more=True)
        kind, value = "event", first
        while True:
            if kind == "disconnected":
                return
            if kind == "error":
                error = _from_library_error(value, prompt_param)
                await exchange.body(_sse(error.body()), more=True)
                break
            if kind == "end":
                break
            event: StreamEvent = value
            if event.text:
                await exchange.body(_sse(shape.text_chunk(event.text)), more=True)
            if event.finish_reason is not None:
                job.done = True
                blocks = response_blocks(event.stats, job.config, job)
                for chunk in shape.final_chunks(_finish(event.finish_reason), blocks):
                    await exchange.body(_sse(chunk), more=True)
                await exchange.body(_sse("[DONE]"), more=True)
                break
            kind, value = await self._next(job)
        await exchange.body(b"")


class _ClientGone(Exception):
    pass


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _prompt(body: Mapping, vocab_size: int) -> str | list[int]:
    """A completions prompt: a string, token ids, or a batch of one of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise HTTPError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise HTTPError(
                400, f"prompt token ids must be in [0, {vocab_size})", param="prompt", code="invalid_value"
            )
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise HTTPError(
            400,
            "a batch of several prompts is not supported; send one per request",
            param="prompt",
            code="unsupported_parameter",
        )
    raise HTTPError(
        400, "prompt must be a non-empty string or array of token ids", param="prompt", code="invalid_value"
    )


# --- running it --------------------------------------------------------------------------------


def _bind(settings: ServerSettings) -> socket.socket:
    if settings.uds:
        path = Path(settings.uds)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise InvalidSettingError(f"{path} exists and is not a socket", param="uds")
            path.unlink()  # a stale socket of an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)  # only this user may connect
        try:
            sock.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
    else:
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((settings.host, settings.port))
        except OSError as error:
            sock.close()
            raise CactusEdgeError(
                f"cannot listen on {settings.host}:{settings.port}: {error.strerror}"
            ) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Server:
    """The app served by uvicorn in a background thread. ``start()`` binds (port 0: a free one,
    known at once as ``port``/``url``) and returns once it accepts connections; ``stop()`` stops
    accepting, cancels the running generation and waits for open responses to end. Never closes
    the engine: whoever made it does."""

    def __init__(self, app: ServerApp) -> None:
        import uvicorn

        self.app, self.settings = app, app.settings
        self._socket = _bind(self.settings)
        if self.settings.uds:
            self.port, self.url = None, f"unix:{self.settings.uds}"
        else:
            self.port = self._socket.getsockname()[1]
            host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
            self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            app,
            http="h11",
            ws="none",
            loop="asyncio",
            lifespan="off",
            log_level="warning",
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=self.settings.shutdown_grace,
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="cactus-edge-http", daemon=True)
        self.error: BaseException | None = None

    def _serve(self) -> None:
        try:
            self._uvicorn.run(sockets=[self._socket])
        except BaseException as error:  # reported by start()/stop()
            self.error = error
            logger.exception("the HTTP server stopped with an error")

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise CactusEdgeError(f"the HTTP server did not start: {self.error or 'timeout'}")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 10.0) -> bool:
        """True if everything ended within ``timeout`` seconds."""
        self._uvicorn.should_exit = True
        worker_done = self.app.shutdown(wait=timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        with contextlib.suppress(OSError):
            self._socket.close()
        if self.settings.uds:
            with contextlib.suppress(OSError):
                Path(self.settings.uds).unlink()
        return worker_done and not self._thread.is_alive()

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def create_server(engine, settings: ServerSettings | None = None) -> Server:
    """A Server over an already-built engine (not started; call ``start()``)."""
    return Server(ServerApp(engine, settings))


def run(
    load_engine: Callable[[], Any],
    settings: ServerSettings,
    announce: Callable[[Server], None],
    install_signals: bool = True,
) -> None:
    """What `cactus-edge serve` does: listen at once (/health answers 503 while loading), load and
    warm up the engine (the first request should not pay auto's calibration), announce, serve
    until SIGINT/SIGTERM, then stop accepting, cancel the running generation, close the engine
    and return."""
    import signal

    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt  # a second signal: give up waiting
        stop.set()

    previous = {}
    if install_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    app = ServerApp(None, settings)
    server = Server(app)
    engine = None
    try:
        server.start()
        engine = load_engine()
        if not stop.is_set():
            engine.warm_up()
        if not stop.is_set():
            app.attach(engine)
            announce(server)
        while not stop.wait(0.5):
            if not server._thread.is_alive():
                raise CactusEdgeError(f"the HTTP server stopped: {server.error}")
    finally:
        server.stop(timeout=settings.shutdown_grace + 2)
        if engine is not None:
            engine.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
