"""The engine's lifecycle: one generation at a time (the lock), open or closed, and the prompt
operations that closing must wait for."""

from __future__ import annotations

import contextlib
import threading

from ..errors import EngineBusy, EngineClosedError


class Guard:
    """The engine's one-generation-at-a-time lock, with an owner (to refuse re-entry from the same
    thread) and a callback run on release (a deferred close)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = threading.Lock()  # makes "is it free, or else run this on release" atomic
        self._owner: int | None = None
        self._on_release = None

    @contextlib.contextmanager
    def hold(self, timeout: float | None):
        if self._owner == threading.get_ident():
            raise EngineBusy(
                "this thread already has an open stream of this engine; finish or close it first"
            )
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            raise EngineBusy(f"the engine is busy with another generation (waited {timeout:g} s)")
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            with self._state:
                self._owner = None
                callback, self._on_release = self._on_release, None
                try:
                    if callback is not None:
                        callback()
                finally:
                    self._lock.release()

    def run_when_free(self, callback, wait: float) -> bool:
        """Run ``callback`` holding the lock, now or within ``wait`` seconds if it is free by then;
        otherwise when the current holder lets go. True if it ran now."""
        if self._owner != threading.get_ident() and self._lock.acquire(timeout=max(wait, 0)):
            try:
                callback()
            finally:
                self._lock.release()
            return True
        with self._state:
            if self._lock.acquire(blocking=False):
                try:
                    callback()
                finally:
                    self._lock.release()
                return True
            self._on_release = callback
            return False


class Lifecycle:
    """Open or closed, and which prompt operations (tokenizing, rendering) are in flight: they
    never wait for a generation, so closing must wait for them before freeing the models."""

    def __init__(self) -> None:
        self.closed = False
        self.closing = threading.Event()  # the running generation ends at its next step
        self._in_flight = 0
        self._changed = threading.Condition()

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the engine is closed")

    @contextlib.contextmanager
    def prompt_operation(self):
        with self._changed:
            self.check_open()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    def close(self) -> bool:
        """Mark closed (False if it already was); no new prompt operation starts after this."""
        with self._changed:
            if self.closed:
                return False
            self.closed = True
        self.closing.set()
        return True

    def wait_for_prompt_operations(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._in_flight == 0, timeout=30)
