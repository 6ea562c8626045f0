"""The ASGI application: :class:`ServerApp` routes each request after the checks in
:mod:`.guards`; the simple routes (/health, /v1/models, /metrics) never touch the engine or wait
for it; the generation routes take a place in the queue before reading anything (a full queue
costs a refused request nothing but its headers), then parse (:mod:`.parsing`), tokenize, check
the prompt fits the context, hand a :class:`~.scheduler.Job` to the scheduler and answer
(:mod:`.streaming`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ..config import GenerationConfig
from . import guards
from .errors import HTTPError, QueueFull, ShuttingDown, busy_error, error_body, quote
from .exchange import Exchange
from .metrics import Metrics
from .parsing import (
    ClientGone,
    check_declared_length,
    final_config,
    parse_body,
    read_json,
    tokenize,
)
from .responses import ResponseShape
from .scheduler import CacheAudit, Job, Place, Scheduler
from .settings import MODEL_ALIAS, RETRY_AFTER_SECONDS, ServerSettings
from .streaming import respond

logger = logging.getLogger("cactus_edge.server")

# Prompts are tokenized one at a time: each takes a core for as long as its text is long (a
# chat template render and llama.cpp's tokenizer), and the running generation needs the cores.
# How many wait is bounded by the queue's places.
TOKENIZE_SLOTS = 1


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
        self._tokenize_slots = asyncio.Semaphore(TOKENIZE_SLOTS)
        self.audit = CacheAudit() if self.settings.debug else None
        self._routes: dict[str, tuple[str, Callable]] = {
            "/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
        }
        if self.settings.metrics:
            self._routes["/metrics"] = ("GET", self._metrics)
        if self.settings.debug:
            self._routes["/debug/caches"] = ("GET", self._debug_caches)
        for path in ("/models", "/chat/completions", "/completions"):  # base_url without /v1
            self._routes[path] = self._routes[f"/v1{path}"]
        if engine is not None:
            self.attach(engine)

    # --- lifecycle

    def attach(self, engine) -> None:
        """The engine is loaded: start serving generations."""
        self.engine = engine
        self.scheduler = Scheduler(engine, self.settings.max_queue, self.metrics, self.audit)

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
        exchange = Exchange(scope, receive, send, [])
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

    async def _handle(self, exchange: Exchange) -> None:
        """The checks of :mod:`.guards` in their order, then the route. With an API key, every
        path but /health needs it before 404 or 405 is said: no probing routes without it."""
        guards.check_host(self.settings, exchange, self._hosts)
        guards.check_origin(self.settings, exchange)
        method, path = exchange.scope["method"], exchange.scope["path"]
        route = self._route(path)
        if route is not None and guards.is_preflight(exchange):
            await guards.preflight(exchange, _methods(route[0]))
            return
        if path != "/health":
            guards.check_api_key(self.settings, exchange)
        if route is None:
            raise HTTPError(404, f"unknown route {method} {quote(path)}", code="unknown_url")
        if method not in _methods(route[0]).split(", "):
            raise HTTPError(
                405,
                f"{path} takes {_methods(route[0])}, not {quote(method)}",
                code="method_not_allowed",
                headers=[("allow", _methods(route[0]))],
            )
        await route[1](exchange)

    def _route(self, path: str) -> tuple[str, Callable] | None:
        route = self._routes.get(path)
        if route is None and path.startswith(("/v1/models/", "/models/")):
            route = ("GET", self._model)
        return route

    # --- simple routes (never touch the engine)

    async def _health(self, exchange: Exchange) -> None:
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

    async def _models(self, exchange: Exchange) -> None:
        await exchange.send_json(200, {"object": "list", "data": [self._model_card()]})

    async def _model(self, exchange: Exchange) -> None:
        name = exchange.scope["path"].split("/models/", 1)[1]
        self._check_model(name)
        await exchange.send_json(200, self._model_card())

    async def _metrics(self, exchange: Exchange) -> None:
        scheduler = self.scheduler
        waiting, running = (scheduler.waiting, scheduler.running) if scheduler else (0, 0)
        await exchange.send_text(200, self.metrics.render(waiting, running), "text/plain; version=0.0.4")

    async def _debug_caches(self, exchange: Exchange) -> None:
        """Only with ``debug``: the cache audit, and whether the worker is idle (then every
        generation so far has been checked)."""
        scheduler = self.scheduler
        waiting, running = (scheduler.waiting, scheduler.running) if scheduler else (0, 0)
        await exchange.send_json(200, {**self.audit.report(), "waiting": waiting, "running": running})

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.settings.model_name, MODEL_ALIAS):
            raise HTTPError(
                404,
                f"the model {quote(name)} does not exist; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # --- generation routes

    async def _chat(self, exchange: Exchange) -> None:
        await self._generate(exchange, chat=True)

    async def _completions(self, exchange: Exchange) -> None:
        await self._generate(exchange, chat=False)

    async def _generate(self, exchange: Exchange, chat: bool) -> None:
        arrived = time.perf_counter()
        ticket = next(self._tickets)  # arrival order, kept through tokenization
        check_declared_length(exchange, self.settings.max_body_bytes)
        scheduler = self.scheduler
        if scheduler is None:
            raise busy_error("the model is loading", "model_loading")
        prompt_param = "messages" if chat else "prompt"
        with self._reserve(scheduler) as place:
            try:
                request, job = await self._prepare(exchange, chat, prompt_param, ticket, arrived)
            except ClientGone:
                return
            try:
                place.submit(job)
            except ShuttingDown:
                raise busy_error("the server is shutting down", "shutting_down") from None
        shape = ResponseShape(chat, request.model or self.settings.model_name, request.include_usage)
        await respond(exchange, scheduler, job, shape, request.stream, prompt_param)

    async def _prepare(self, exchange: Exchange, chat: bool, prompt_param: str, ticket: int, arrived: float):
        """(the parsed request, its Job): the body read, parsed, tokenized and fitted to the
        context; ClientGone if the client hangs up while sending it."""
        body = await read_json(exchange, self.settings.max_body_bytes)
        request = parse_body(body, self.settings.base_config)
        self._check_model(request.model)
        engine = self.engine
        prompt = await tokenize(engine, body, chat, self.settings.default_system, self._tokenize_slots)
        config = self._fit(engine, request.config, body, prompt, prompt_param)
        return request, Job(prompt, config, asyncio.get_running_loop(), ticket, arrived)

    def _fit(
        self, engine, config: GenerationConfig, body: Mapping, prompt: list[int], prompt_param: str
    ) -> GenerationConfig:
        """The request's config once its prompt fits the context and its drafter this server."""
        n_ctx = engine.target.n_ctx
        if len(prompt) >= n_ctx:
            raise HTTPError(
                400,
                f"This model's maximum context length is {n_ctx} tokens. However, your "
                f"{prompt_param} resulted in {len(prompt)} tokens.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        config = final_config(config, body, len(prompt), n_ctx, self.settings.max_tokens_cap)
        if config.uses_model and getattr(engine, "draft", None) is None:
            raise HTTPError(
                400,
                f"drafter {config.drafter!r} needs a draft model and this server has none; "
                'use "speculative": {"drafter": "lookup"} or {"method": "none"}',
                param="speculative.drafter",
                code="invalid_value",
            )
        return config

    def _reserve(self, scheduler: Scheduler) -> Place:
        """A place in the queue before the body is read, or 503: a full queue refuses a request
        before any of its work is done."""
        try:
            return scheduler.reserve()
        except QueueFull:
            raise busy_error(
                f"the queue is full ({self.settings.max_queue} waiting); retry later",
                "queue_full",
            ) from None
        except ShuttingDown:
            raise busy_error("the server is shutting down", "shutting_down") from None


def _methods(method: str) -> str:
    """The methods a route answers: HEAD wherever GET (uvicorn leaves the body out)."""
    return "GET, HEAD" if method == "GET" else method
