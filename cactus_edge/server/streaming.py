"""Answering an admitted generation: the job's events become one JSON body (``stream: false``)
or server-sent events (``stream: true``) in :mod:`cactus_edge.openai_api`'s shapes, while a
watcher withdraws the job if the client hangs up."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from ..engine.events import StreamEvent
from ..openai_api import Timeline, response_blocks
from ..openai_api.replies import Reply
from .errors import HTTPError, from_library_error
from .exchange import Exchange
from .scheduler import Job, Scheduler


def sse_event(data: dict | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


def _blocks(event: StreamEvent, job: Job) -> dict:
    """The response's blocks, from the final event and the job's moments."""
    timeline = Timeline(job.arrived, job.started, job.first_token, ended=time.perf_counter())
    return response_blocks(event.stats, job.config, timeline)


async def respond(
    exchange: Exchange, scheduler: Scheduler, job: Job, reply: Reply, stream: bool, prompt_param: str
) -> None:
    """Send the job's answer; withdraw it from the scheduler unless it ended."""
    watcher = asyncio.ensure_future(_watch_disconnect(exchange, scheduler, job))
    try:
        if stream:
            await _stream(exchange, job, reply, prompt_param)
        else:
            await _complete(exchange, job, reply, prompt_param)
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


async def _next_event(job: Job, prompt_param: str) -> StreamEvent | None:
    """The job's next event; None when the client is gone. An error raised before the
    generation's end becomes its HTTP answer; an end without a final event is a 500."""
    kind, value = await _next(job)
    if kind == "disconnected":
        return None
    if kind == "error":
        raise from_library_error(value, prompt_param)
    if kind == "end":
        raise HTTPError(500, "the generation ended without a result", type="server_error", code="internal")
    return value


async def _complete(exchange: Exchange, job: Job, reply: Reply, prompt_param: str) -> None:
    while True:
        event = await _next_event(job, prompt_param)
        if event is None:
            return
        if event.finish_reason is not None:
            job.done = True
            await exchange.send_json(200, reply.complete(event, _blocks(event, job)))
            return
        reply.add_quietly(event)


async def _stream(exchange: Exchange, job: Job, reply: Reply, prompt_param: str) -> None:
    # The status is sent with the first event: an error before it (a shutdown while queued, a
    # refused setting) still gets its own status and envelope.
    first = await _next_event(job, prompt_param)
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
    role = reply.shape.role_chunk()
    if role is not None:
        await exchange.body(sse_event(role), more=True)
    kind, value = "event", first
    while True:
        if kind == "disconnected":
            return
        if kind == "error":
            error = from_library_error(value, prompt_param)
            await exchange.body(sse_event(error.body()), more=True)
            break
        if kind == "end":
            break
        event: StreamEvent = value
        if event.finish_reason is not None:
            job.done = True
            for chunk in reply.finish(event, _blocks(event, job)):
                await exchange.body(sse_event(chunk), more=True)
            await exchange.body(sse_event("[DONE]"), more=True)
            break
        for chunk in reply.add(event):
            await exchange.body(sse_event(chunk), more=True)
        kind, value = await _next(job)
    await exchange.body(b"")
