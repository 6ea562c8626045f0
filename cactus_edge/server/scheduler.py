"""The engine's one worker thread: :class:`Scheduler` runs one generation at a time, in arrival
order, from a bounded queue (``max_queue`` waiting behind the running one; more get 503). A
request takes its :class:`Place` in the queue before its body is read, so reading, parsing and
tokenizing are bounded by the queue too. A running generation is never pre-empted. A request
whose client goes away is withdrawn from the queue, or, if it runs, cancelled at the engine's next
step (the engine leaves its caches consistent, so the next request sees what a fresh engine would
give)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import threading
import time
from collections import deque
from typing import Any

from ..engine.config import GenerationConfig
from ..errors import CactusEdgeError
from .errors import QueueFull, ShuttingDown
from .metrics import Metrics

logger = logging.getLogger("cactus_edge.server")
KEPT_CACHE_PROBLEMS = 50  # the debug audit keeps the latest problems, not all of them


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


class Place:
    """A place in the queue, taken before a request's body is read (:meth:`Scheduler.reserve`):
    ``submit`` hands the job over; leaving the ``with`` block without submitting gives it back."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler, self._held = scheduler, True

    def submit(self, job: Job) -> None:
        self._held = False
        self._scheduler._submit(job)

    def __enter__(self) -> Place:
        return self

    def __exit__(self, *exc) -> None:
        if self._held:
            self._held = False
            self._scheduler._release()


class CacheAudit:
    """With ``debug``: the engine's caches checked after every generation (Engine.check_caches
    against prompt + the tokens the worker received)."""

    def __init__(self) -> None:
        self.checked = 0
        self.problems: deque[str] = deque(maxlen=KEPT_CACHE_PROBLEMS)
        self.n_problems = 0

    def check(self, engine, job: Job, tokens: list[int]) -> None:
        try:
            problems = engine.check_caches(job.prompt + tokens)
        except CactusEdgeError:  # closed while shutting down: nothing left to check
            return
        self.checked += 1
        self.n_problems += len(problems)
        for problem in problems:
            logger.error("cache inconsistency after request %d: %s", job.ticket, problem)
            self.problems.append(f"request {job.ticket}: {problem}")

    def report(self) -> dict:
        return {"checked": self.checked, "n_problems": self.n_problems, "problems": list(self.problems)}


class Scheduler:
    """One worker thread that owns the engine and runs admitted jobs in ticket (arrival) order."""

    def __init__(self, engine, max_queue: int, metrics: Metrics, audit: CacheAudit | None = None) -> None:
        self.engine, self.max_queue, self.metrics, self.audit = engine, max_queue, metrics, audit
        self._cond = threading.Condition()
        self._waiting: list[Job] = []  # a heap by ticket
        self._running: Job | None = None
        self._reserved = 0  # places taken by requests still being read or tokenized
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="cactus-edge-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return int(self._running is not None)

    @property
    def reserved(self) -> int:
        return self._reserved

    def reserve(self) -> Place:
        """A place for a request about to be read, or QueueFull / ShuttingDown. At most one job
        runs and ``max_queue`` wait or are being read: counting places, not the worker's
        progress, keeps this deterministic."""
        with self._cond:
            if self._closed:
                raise ShuttingDown
            if self._reserved + len(self._waiting) + (self._running is not None) > self.max_queue:
                raise QueueFull
            self._reserved += 1
        return Place(self)

    def _release(self) -> None:
        with self._cond:
            self._reserved -= 1

    def _submit(self, job: Job) -> None:
        """Queue ``job`` in its reserved place (ShuttingDown if the server stopped meanwhile)."""
        with self._cond:
            self._reserved -= 1
            if self._closed:
                raise ShuttingDown
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
        tokens: list[int] = []  # what the engine handed over: its caches hold a prefix of prompt + these
        try:
            if job.cancel.is_set():
                return
            job.started = time.perf_counter()
            self._generate(job, tokens)
        except Exception as error:  # handed to the request; the worker goes on
            self.metrics.count_failed_generation()
            job.put("error", error)
        finally:
            if self.audit is not None and job.started is not None:
                self.audit.check(self.engine, job, tokens)
            job.put("end")

    def _generate(self, job: Job, tokens: list[int]) -> None:
        events = self.engine.stream(job.prompt, job.config, cancel=job.cancel)
        with contextlib.closing(events):  # closing cuts the caches back before the audit looks
            for event in events:
                if event.token is not None:
                    tokens.append(event.token)
                    if job.first_token is None:
                        job.first_token = time.perf_counter()
                job.put("event", event)
                if event.finish_reason is not None:
                    self.metrics.record_generation(event.stats, event.finish_reason)
