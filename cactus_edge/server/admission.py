"""Admitting a generation request (chat, completions, Responses, Messages: :mod:`.apis`): a place
in the queue before anything is read (a full queue costs a refused request nothing but its
headers), then the body read, converted to a chat request by its API and parsed (:mod:`.parsing`),
the prompt tokenized one at a time, the request checked by the engine (``Engine.check_request``),
a :class:`~.scheduler.Job` handed to the scheduler, and the answer (:mod:`.streaming`)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Mapping

from ..engine.config import GenerationConfig
from ..errors import CactusEdgeError, ContextLengthError
from ..openai_api import ParsedRequest
from ..openai_api.requests import config_for_vocabulary
from .apis import Api, Incoming
from .errors import HTTPError, QueueFull, ShuttingDown, busy_error, from_library_error, model_loading, quote
from .exchange import Exchange
from .parsing import ClientGone, check_declared_length, final_config, parse_body, read_json, tokenize
from .scheduler import Job, Place, Scheduler
from .settings import MODEL_ALIAS, ServerSettings
from .streaming import respond

logger = logging.getLogger("cactus_edge.server")

# Prompts are tokenized (and new grammars compiled) one at a time: each takes a core for as long
# as its text is long (a chat template render and llama.cpp's tokenizer), and the running
# generation needs the cores.
# How many wait is bounded by the queue's places.
TOKENIZE_SLOTS = 1


def check_model(settings: ServerSettings, name: str | None) -> None:
    """404 unless ``name`` is None, the served model's id or the alias every server accepts."""
    if name is not None and name not in (settings.model_name, MODEL_ALIAS):
        raise HTTPError(
            404,
            f"the model {quote(name)} does not exist; this server serves {settings.model_name!r}",
            param="model",
            code="model_not_found",
        )


class Admission:
    """The generation routes of one app."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._tickets = itertools.count()
        self._tokenize_slots = asyncio.Semaphore(TOKENIZE_SLOTS)

    async def answer(self, exchange: Exchange, engine, scheduler: Scheduler | None, api: Api) -> None:
        """Admit the request and answer it in ``api``'s shapes (``engine``/``scheduler`` None:
        still loading, 503)."""
        arrived = time.perf_counter()
        ticket = next(self._tickets)  # arrival order, kept through tokenization
        check_declared_length(exchange, self.settings.max_body_bytes)
        if scheduler is None:
            raise model_loading()
        with self._reserve(scheduler) as place:
            try:
                incoming, request, job = await self._prepare(exchange, engine, api, ticket, arrived)
            except ClientGone:
                return
            try:
                place.submit(job)
            except ShuttingDown:
                raise busy_error("the server is shutting down", "shutting_down") from None
        model = request.model or self.settings.model_name
        replier = api.replier(incoming, request, model, len(job.prompt))
        headers = [
            *incoming.headers,
            *_clamp_header(incoming.chat_body, job.config),
            *_unenforced_header(request),
        ]
        await respond(exchange, scheduler, job, replier, request.stream, api, headers)

    async def _prepare(
        self, exchange: Exchange, engine, api: Api, ticket: int, arrived: float
    ) -> tuple[Incoming, ParsedRequest, Job]:
        """(the request as its API read it, the chat request parsed, its Job): the body read,
        converted, parsed, tokenized and checked by the engine; ClientGone if the client hangs up
        while sending it."""
        body = await read_json(exchange, self.settings.max_body_bytes)
        incoming = api.read(body)
        chat_body = incoming.chat_body
        try:
            request, prompt = await self._prompt(engine, chat_body, api.template, check=True)
            config = config_for_vocabulary(request, engine)
            loop = asyncio.get_running_loop()
            if config.grammar_source is None:
                config = self._fit(engine, config, chat_body, prompt, api.prompt_param)
            else:  # a new grammar compiles here (up to seconds): in a worker thread, as tokenizing is
                fit = functools.partial(self._fit, engine, config, chat_body, prompt, api.prompt_param)
                async with self._tokenize_slots:
                    config = await loop.run_in_executor(None, fit)
        except HTTPError as error:
            raise api.renamed(error) from None
        return incoming, request, Job(prompt, config, loop, ticket, arrived)

    async def count_tokens(self, engine, chat_body: Mapping, api: Api) -> int:
        """How many tokens a chat request's prompt has (its tools included), as it would run."""
        try:
            _, prompt = await self._prompt(engine, chat_body, chat=True, check=False)
        except HTTPError as error:
            raise api.renamed(error) from None
        return len(prompt)

    async def _prompt(
        self, engine, chat_body: Mapping, chat: bool, check: bool
    ) -> tuple[ParsedRequest, list[int]]:
        """(the chat request parsed, its prompt tokenized, tools included); ``check``: its model
        is checked before the prompt is tokenized."""
        request = parse_body(chat_body, self.settings.base_config)
        if check:
            check_model(self.settings, request.model)
        tools = request.tools.tools if request.tools is not None and chat else None
        prompt = await tokenize(
            engine, chat_body, chat, self.settings.default_system, self._tokenize_slots, tools
        )
        return request, prompt

    def _fit(
        self, engine, config: GenerationConfig, body: Mapping, prompt: list[int], prompt_param: str
    ) -> GenerationConfig:
        """The request's config once the engine has accepted it (Engine.check_request: the prompt
        fits the context, its ids exist, the drafter has its model), with its final max_tokens.
        The engine's message is kept; the server adds OpenAI's status, code and field name."""
        try:
            engine.check_request(prompt, config)
        except CactusEdgeError as error:
            if isinstance(error, ContextLengthError):  # agents show their own words, not ours
                logger.warning("a request was refused: %s", error)
            raise from_library_error(error, prompt_param) from None
        return final_config(config, body, len(prompt), engine.target.n_ctx, self.settings.max_tokens_cap)

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


def _clamp_header(body: Mapping, final: GenerationConfig) -> list[tuple[str, str]]:
    """Say so when the reply's budget asked for was cut (to the context's room, or the cap)."""
    asked = body.get("max_tokens", body.get("max_completion_tokens"))
    if not isinstance(asked, int) or final.max_tokens >= asked:
        return []
    return [
        ("x-cactus-edge-max-tokens", f"{asked} clamped to {final.max_tokens} (the context's room or the cap)")
    ]


def _unenforced_header(request: ParsedRequest) -> list[tuple[str, str]]:
    """Name the tools whose schemas hold keywords the grammar cannot enforce (llguidance's
    unimplemented ones, as propertyNames): their arguments follow the rest of the schema."""
    names = request.tools.unenforced if request.tools is not None else ()
    if not names:
        return []
    logger.info("tools whose schemas are enforced without unimplemented keywords: %s", ", ".join(names))
    return [("x-cactus-edge-unenforced-schemas", ", ".join(names)[:500])]
