"""The ASGI application: :class:`ServerApp` routes each request after the checks in
:mod:`.guards`; the simple routes (/health, /v1/models, /metrics) never touch the engine or wait
for it; the generation routes are :mod:`.admission`'s (queue place, parsing, tokenizing, the
engine's check, the scheduler, the answer)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import InvalidSettingError
from ..openai_api.messages import read_messages_request
from ..openai_api.responses import ResponseStore
from . import guards
from .admission import Admission, check_model
from .apis import Api, MessagesApi, ResponsesApi
from .errors import HTTPError, error_body, model_loading, quote
from .exchange import Exchange
from .metrics import Metrics
from .parsing import read_json
from .scheduler import CacheAudit, Scheduler
from .settings import RETRY_AFTER_SECONDS, ServerSettings

logger = logging.getLogger("cactus_edge.server")


class ServerApp:
    """The ASGI application. ``engine`` may be None until :meth:`attach` (the server then answers
    /health with 503 "loading" and generation requests with 503)."""

    def __init__(self, engine=None, settings: ServerSettings | None = None) -> None:
        self.settings = settings or ServerSettings()
        self.metrics = Metrics()
        self.engine = None
        self.scheduler: Scheduler | None = None
        self._hosts = self.settings.accepted_hosts
        self._created = int(time.time())
        self._admission = Admission(self.settings)
        self.audit = CacheAudit() if self.settings.debug else None
        self.responses = ResponseStore(self.settings.responses_store_mib * 2**20)
        self._apis = {
            "chat": Api(chat=True),
            "completions": Api(chat=False),
            "responses": ResponsesApi(self.responses),
            "messages": MessagesApi(),
        }
        self._routes: dict[str, tuple[str, Callable]] = {
            "/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            "/v1/responses": ("POST", self._responses),
            "/v1/messages": ("POST", self._messages),
            "/v1/messages/count_tokens": ("POST", self._count_tokens),
        }
        if self.settings.metrics:
            self._routes["/metrics"] = ("GET", self._metrics)
        if self.settings.debug:
            self._routes["/debug/caches"] = ("GET", self._debug_caches)
        for path in ("/models", "/chat/completions", "/completions", "/responses"):  # base_url without /v1
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
            await _lifespan(receive, send)
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

    async def _handle(self, exchange: Exchange) -> None:
        """The checks of :mod:`.guards` in their order, then the route. With an API key, every
        path but /health needs it before 404 or 405 is said: no probing routes without it."""
        method, path = exchange.scope["method"], exchange.scope["path"]
        if path.startswith("/v1/messages"):
            exchange.error_shape = self._apis["messages"].error_body
        guards.check_host(self.settings, exchange, self._hosts)
        guards.check_origin(self.settings, exchange)
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
        if route is None and path.startswith(("/v1/responses/", "/responses/")):
            route = ("GET, DELETE", self._stored_response)
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

    async def _models(self, exchange: Exchange) -> None:
        card = _model_card(self.settings, self.engine, self._created)
        await exchange.send_json(200, {"object": "list", "data": [card]})

    async def _model(self, exchange: Exchange) -> None:
        check_model(self.settings, exchange.scope["path"].split("/models/", 1)[1])
        await exchange.send_json(200, _model_card(self.settings, self.engine, self._created))

    async def _metrics(self, exchange: Exchange) -> None:
        scheduler = self.scheduler
        waiting, running = (scheduler.waiting, scheduler.running) if scheduler else (0, 0)
        cache = getattr(self.engine, "prompt_cache", None)
        text = self.metrics.render(waiting, running, cache.snapshot() if cache is not None else None)
        await exchange.send_text(200, text, "text/plain; version=0.0.4")

    async def _debug_caches(self, exchange: Exchange) -> None:
        """Only with ``debug``: the cache audit, and whether the worker is idle (then every
        generation so far has been checked)."""
        scheduler = self.scheduler
        waiting, running = (scheduler.waiting, scheduler.running) if scheduler else (0, 0)
        await exchange.send_json(200, {**self.audit.report(), "waiting": waiting, "running": running})

    # --- generation routes

    async def _chat(self, exchange: Exchange) -> None:
        await self._admission.answer(exchange, self.engine, self.scheduler, self._apis["chat"])

    async def _completions(self, exchange: Exchange) -> None:
        await self._admission.answer(exchange, self.engine, self.scheduler, self._apis["completions"])

    async def _responses(self, exchange: Exchange) -> None:
        await self._admission.answer(exchange, self.engine, self.scheduler, self._apis["responses"])

    async def _messages(self, exchange: Exchange) -> None:
        await self._admission.answer(exchange, self.engine, self.scheduler, self._apis["messages"])

    async def _count_tokens(self, exchange: Exchange) -> None:
        """Anthropic's count_tokens: the prompt's tokens as the Messages route would run it."""
        if self.engine is None:
            raise model_loading()
        api = self._apis["messages"]
        body = await read_json(exchange, self.settings.max_body_bytes)
        try:
            chat_body = read_messages_request(body, counting=True).chat_body
        except InvalidSettingError as error:
            raise api.library_error(error) from None
        count = await self._admission.count_tokens(self.engine, chat_body, api)
        await exchange.send_json(200, {"input_tokens": count})

    async def _stored_response(self, exchange: Exchange) -> None:
        """GET or DELETE a stored /v1/responses answer."""
        response_id = exchange.scope["path"].rsplit("/", 1)[1]
        if exchange.scope["method"] == "DELETE":
            if not self.responses.delete(response_id):
                raise _no_stored_response(response_id)
            await exchange.send_json(200, {"id": response_id, "object": "response.deleted", "deleted": True})
            return
        stored = self.responses.get(response_id)
        if stored is None:
            raise _no_stored_response(response_id)
        await exchange.send_json(200, stored.body)


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _model_card(settings: ServerSettings, engine, created: int) -> dict:
    """/v1/models' entry for the served model; with the engine loaded, what it runs."""
    card = {"id": settings.model_name, "object": "model", "created": created, "owned_by": "cactus-edge"}
    if engine is not None:
        card["meta"] = {
            "n_ctx": engine.target.n_ctx,
            "target": Path(str(getattr(engine.target, "path", ""))).name or None,
            "draft": Path(str(engine.draft.path)).name if getattr(engine, "draft", None) else None,
            "target_device": getattr(engine.target, "device", None),
            "draft_device": getattr(engine.draft, "device", None) if getattr(engine, "draft", None) else None,
            "method": settings.base_config.method,
        }
    return card


def _methods(method: str) -> str:
    """The methods a route answers: HEAD wherever GET (uvicorn leaves the body out)."""
    return method.replace("GET", "GET, HEAD")


def _no_stored_response(response_id: str) -> HTTPError:
    return HTTPError(
        404,
        f"no stored response {quote(response_id)}: it was never stored (store: false), was deleted, "
        "or was evicted or lost when the server restarted",
        param="response_id",
        code="response_not_found",
    )
