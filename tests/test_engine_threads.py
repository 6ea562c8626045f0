"""The engine's concurrency contract: one generation at a time, waiting callers (optionally with a
timeout), no deadlock, close() at any time, tokenization that never races a generation.
Every wait is bounded, so a broken build fails instead of hanging. Nothing depends on how fast
this machine is: a stream is paused on an event, and whether a caller waited for the engine is
read from the engine's lock (``WatchedLock``), not from a clock; the few durations left are lower
bounds or generous caps."""

import gc
import threading
import time

import pytest

from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.errors import EngineBusy, EngineClosedError
from cactus_edge.llama.model import LlamaModel

from .conftest import TEST_THREADS

PROMPT = "the water is hot and"
CONFIG = GenerationConfig(method="sps", temperature=0.0, n_draft=3, max_tokens=24)
WAIT = 30  # seconds: generous bound for every join / event wait


class WatchedLock:
    """The engine's one-generation lock, recording each caller that finds it taken and so waits
    (or gives up at once): ``waits`` holds (thread id, timeout); ``waiting`` is set at the first.
    Acquiring a free lock, or asking without blocking, is not a wait."""

    def __init__(self, lock) -> None:
        self._lock = lock
        self.waits: list[tuple[int, float]] = []
        self.waiting = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.waits.append((threading.get_ident(), timeout))
        self.waiting.set()
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()

    def waited(self, thread_id: int) -> bool:
        return any(ident == thread_id for ident, _ in self.waits)


@pytest.fixture
def engine(tiny_pair):
    engine = Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS)
    engine._guard._lock = WatchedLock(engine._guard._lock)  # free now: nobody holds the original
    yield engine
    engine.close()


class PausedStream(threading.Thread):
    """Streams in its own thread and stops after the first event until ``proceed`` is set."""

    def __init__(self, engine, log=None):
        super().__init__(daemon=True)
        self.engine, self.log = engine, log if log is not None else []
        self.started, self.proceed = threading.Event(), threading.Event()
        self.events, self.error = [], None

    def run(self):
        try:
            for event in self.engine.stream(PROMPT, CONFIG):
                self.events.append(event)
                if len(self.events) == 1:
                    self.started.set()
                    assert self.proceed.wait(WAIT)
            self.log.append("first stream done")
        except BaseException as error:  # reported by the test
            self.error = error
            self.started.set()


def test_a_second_caller_with_a_timeout_gets_engine_busy(engine):
    holder = PausedStream(engine)
    holder.start()
    assert holder.started.wait(WAIT)
    begin = time.monotonic()
    with pytest.raises(EngineBusy, match="busy"):
        engine.generate(PROMPT, CONFIG, timeout=0.3)
    waited = time.monotonic() - begin
    # It waited its timeout (a lower bound, which no load can break) and gave up while the engine
    # was still held: the holder goes on only once `proceed` is set, below. The cap only tells a
    # timeout honoured from one ignored (then this call would have waited for the holder's WAIT).
    assert 0.25 < waited < WAIT / 2
    assert holder.is_alive() and not holder.events[-1].finish_reason
    holder.proceed.set()
    holder.join(WAIT)
    assert holder.error is None and holder.events[-1].finish_reason == "length"


def test_a_second_caller_waits_its_turn(engine):
    engine.generate(PROMPT, CONFIG)  # the reference then follows a run of this prompt, as the waiter does
    reference = engine.generate(PROMPT, CONFIG).tokens
    log = []
    holder = PausedStream(engine, log)
    holder.start()
    assert holder.started.wait(WAIT)
    results = []

    def second_caller():
        results.append(engine.generate(PROMPT, CONFIG).tokens)
        log.append("second caller done")

    waiter = threading.Thread(target=second_caller, daemon=True)
    waiter.start()
    assert engine._guard._lock.waiting.wait(WAIT)  # it found the engine taken...
    assert engine._guard._lock.waits == [(waiter.ident, -1)]  # ...and waits for it, without a timeout
    assert waiter.is_alive()  # waiting, not refused
    holder.proceed.set()
    holder.join(WAIT), waiter.join(WAIT)
    assert log == ["first stream done", "second caller done"]
    assert results == [reference]


def test_a_second_stream_on_the_same_thread_is_refused_at_once(engine):
    outcome = []

    def same_thread_twice():
        first = engine.stream(PROMPT, CONFIG)
        next(first)
        try:
            engine.generate(PROMPT, CONFIG)  # would deadlock if it waited for `first`
        except EngineBusy as error:
            outcome.append((str(error), engine._guard._lock.waited(threading.get_ident())))
        first.close()

    # In a thread of its own, so a regression fails the test instead of hanging the suite.
    worker = threading.Thread(target=same_thread_twice, daemon=True)
    worker.start()
    worker.join(WAIT)
    assert not worker.is_alive(), "deadlock: the second stream waited for the first on one thread"
    ((message, waited),) = outcome
    assert "this thread already has an open stream" in message
    assert not waited  # refused at once: it never waited for the engine's lock, even briefly
    assert engine.generate(PROMPT, CONFIG, timeout=0).finish_reason == "length"


def test_an_abandoned_stream_releases_the_engine_when_collected(engine):
    stream = engine.stream(PROMPT, CONFIG)
    next(stream)
    with pytest.raises(EngineBusy):
        engine.generate(PROMPT, CONFIG, timeout=0)  # the stream holds the engine
    del stream
    gc.collect()
    assert engine.generate(PROMPT, CONFIG, timeout=0).finish_reason == "length"


def test_close_from_another_thread_cancels_the_stream_then_frees_the_models(engine):
    holder = PausedStream(engine)
    holder.start()
    assert holder.started.wait(WAIT)
    begin = time.monotonic()
    engine.close(wait=0.2)
    # close() returned while the stream is still paused (it goes on only when `proceed` is set,
    # below): it did not wait for the stream to end. The cap is far below the holder's WAIT.
    assert time.monotonic() - begin < WAIT / 2
    assert holder.is_alive() and not holder.events[-1].finish_reason
    assert not engine.target.closed  # still in use by the paused stream: freed when it lets go
    holder.proceed.set()
    holder.join(WAIT)
    assert holder.error is None
    assert holder.events[-1].finish_reason == "cancelled"
    assert engine.target.closed and engine.draft.closed
    with pytest.raises(EngineClosedError):
        engine.generate(PROMPT, CONFIG)
    with pytest.raises(EngineClosedError):
        engine.tokenize_chat([{"role": "user", "content": "hi"}])


def test_close_from_the_consuming_thread_does_not_wait_for_itself(engine):
    stream = engine.stream(PROMPT, CONFIG)
    next(stream)
    engine.close()  # waits up to 5 s for the engine's lock, unless this thread holds it
    assert not engine._guard._lock.waited(threading.get_ident())  # it did not wait for itself
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"
    assert engine.target.closed and engine.draft.closed
    engine.close()  # idempotent


def test_tokenizing_while_another_thread_generates_changes_nothing(engine):
    messages = [{"role": "user", "content": "hello world, write some python code"}]
    expected_ids = engine.tokenize_chat(messages)
    expected_text = engine.render(messages)
    long = GenerationConfig(**{**CONFIG.__dict__, "max_tokens": 120})
    engine.generate(PROMPT, long)  # the reference then follows a run of this prompt, as the worker's does
    reference = engine.generate(PROMPT, long).tokens
    results, stop = [], threading.Event()
    rounds_done = threading.Semaphore(0)  # released once per tokenizing round

    def generate():
        try:
            tokens = []
            for event in engine.stream(PROMPT, long):
                if event.token is not None:
                    tokens.append(event.token)
                # Each step waits for one more round: however the threads are scheduled, the
                # generation cannot end before the tokenizing began, and each of its steps
                # decodes while the main thread is at its next round.
                if not rounds_done.acquire(timeout=WAIT):
                    break
            results.append(tokens)
        finally:
            stop.set()  # bounds the loop below, whatever happens here

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    rounds = 0
    while not stop.is_set():
        assert engine.tokenize_chat(messages) == expected_ids
        assert engine.render(messages) == expected_text
        rounds += 1
        rounds_done.release()
    worker.join(WAIT)
    assert rounds >= len(reference) and results == [reference]


def test_detokenizing_from_two_threads_gives_each_its_own_bytes(tiny_pair):
    """ctypes releases the GIL inside llama_token_to_piece: a buffer shared between calls would
    let one thread read the other's piece."""
    with LlamaModel(tiny_pair[1], n_ctx=64) as model:
        tokens = [300, 301, 400, 401, 500, 501]
        expected = {t: model.token_bytes(t) for t in tokens}
        assert len(set(expected.values())) == len(tokens)
        wrong = []

        def hammer(mine):
            for _ in range(20000):
                for token in mine:
                    piece = model.token_bytes(token)
                    if piece != expected[token]:
                        wrong.append((token, piece))

        threads = [threading.Thread(target=hammer, args=(tokens[i::2],)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads) and wrong == []
