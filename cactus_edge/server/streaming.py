"""Answering an admitted generation: the job's events become one JSON body (``stream: false``)
or server-sent events (``stream: true``) through its API's replier (:mod:`.apis`), while a
watcher withdraws the job if the client hangs up."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..engine.events import StreamEvent
from ..openai_api import Timeline, response_blocks
from .apis import Api
from .errors import HTTPError
from .exchange import Exchange
from .scheduler import Job, Scheduler


def _blocks(event: StreamEvent, job: Job) -> dict:
    """The response's blocks, from the final event and the job's moments."""
    timeline = Timeline(job.arrived, job.started, job.first_token, ended=time.perf_counter())
    return response_blocks(event.stats, job.config, timeline)


async def respond(
    exchange: Exchange, scheduler: Scheduler, job: Job, replier, stream: bool, api: Api, headers: list
) -> None:
    """Send the job's answer through ``replier`` (:mod:`.apis`); withdraw it from the scheduler
    unless it ended."""
    watcher = asyncio.ensure_future(_watch_disconnect(exchange, scheduler, job))
    try:
        if stream:
            await _stream(exchange, job, replier, api, headers)
        else:
            await _complete(exchange, job, replier, api, headers)
    finally:
        watcher.cancel()
        if not job.done:
            scheduler.withdraw(job)


async def _watch_disconnect(exchange: Exchange, scheduler: Scheduler, job: Job) -> None:
    while True:
        message = await exchange.receive()
        if message["type"] == "http.disconnect":
            if not job.done:
                scheduler.withdraw(job)
                job.items.put_nowait(("disconnected", None))
            return


async def _next(job: Job) -> tuple[str, Any]:
    kind, value = await job.items.get()
    if kind in ("end", "disconnected"):
        job.done = job.done or kind == "end"
    return kind, value


async def _next_event(job: Job, api: Api) -> StreamEvent | None:
    """The job's next event; None when the client is gone. An error raised before the
    generation's end becomes its HTTP answer; an end without a final event is a 500."""
    kind, value = await _next(job)
    if kind == "disconnected":
        return None
    if kind == "error":
        raise api.library_error(value)
    if kind == "end":
        raise _no_result()
    return value


def _no_result() -> HTTPError:
    return HTTPError(500, "the generation ended without a result", type="server_error", code="internal")


async def _complete(exchange: Exchange, job: Job, replier, api: Api, headers: list) -> None:
    while True:
        event = await _next_event(job, api)
        if event is None:
            return
        if event.finish_reason is not None:
            job.done = True
            await exchange.send_json(200, replier.complete(event, _blocks(event, job)), headers)
            return
        replier.add_quietly(event)


async def _stream(exchange: Exchange, job: Job, replier, api: Api, headers: list) -> None:
    # The status is sent with the first event: an error before it (a shutdown while queued, a
    # refused setting) still gets its own status and envelope.
    first = await _next_event(job, api)
    if first is None:
        return
    await exchange.start(
        200,
        [
            ("content-type", "text/event-stream; charset=utf-8"),
            ("cache-control", "no-cache"),
            ("x-accel-buffering", "no"),
            *headers,
        ],
    )
    await _send(exchange, replier.opening(first))
    kind, value = "event", first
    while True:
        if kind == "disconnected":
            return
        if kind == "error":
            await _send(exchange, replier.failure(api.library_error(value)))
            break
        if kind == "end":  # the generation ended without a result: say so in the stream
            await _send(exchange, replier.failure(_no_result()))
            break
        event: StreamEvent = value
        if event.finish_reason is not None:
            job.done = True
            await _send(exchange, replier.finish(event, _blocks(event, job)))
            break
        await _send(exchange, replier.add(event))
        kind, value = await _next(job)
    await exchange.body(b"")


async def _send(exchange: Exchange, frames: list[bytes]) -> None:
    for frame in frames:
        await exchange.body(frame, more=True)
