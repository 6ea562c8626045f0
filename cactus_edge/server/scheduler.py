"""The engine's one worker thread: :class:`Scheduler` runs one generation at a time, in arrival
order, from a bounded queue (``max_queue`` waiting behind the running one; more get 503). A
running generation is never pre-empted. A request whose client goes away is withdrawn from the
queue, or, if it runs, cancelled at the engine's next step (the engine leaves its caches
consistent, so the next request sees what a fresh engine would give)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import threading
import time
from typing import Any

from ..config import GenerationConfig
from .errors import QueueFull, ShuttingDown
from .metrics import Metrics


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
