"""Serving the app: :class:`Server` runs it on uvicorn (h11, asyncio) in a background thread, on a
socket it binds itself (so port 0 is known before serving), with the deadlines and the cap of
:mod:`.connections`; :func:`run` is what the CLI calls: signals, loading, the ready line, a clean
shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CactusEdgeError, InvalidSettingError
from .app import ServerApp
from .connections import (
    LISTEN_BACKLOG,
    ConnectionGuard,
    limit_repeated_logs,
    protocol_class,
    raise_descriptor_limit,
)
from .settings import ServerSettings

logger = logging.getLogger("cactus_edge.server")


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
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


class Server:
    """The app served by uvicorn in a background thread. ``start()`` binds (port 0: a free one,
    known at once as ``port``/``url``) and returns once it accepts connections; ``stop()`` stops
    accepting, cancels the running generation and waits for open responses to end. Never closes
    the engine: whoever made it does. ``guard`` holds the open connections and what closed them."""

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
        self.guard = ConnectionGuard(self.settings)
        limit_repeated_logs()
        config = uvicorn.Config(
            app,
            http=protocol_class(self.guard),  # uvicorn's h11, with our deadlines and cap
            backlog=LISTEN_BACKLOG,  # asyncio listens again with it, and accepts this many a tick
            timeout_keep_alive=self.settings.idle_timeout,  # ours closes idle ones; same value
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
    warm up the engine (the first request should not pay auto's calibration) and build its grammar
    tokenizer index, announce, serve until SIGINT/SIGTERM, then stop accepting, cancel the running
    generation, close the engine and return."""
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
    raise_descriptor_limit(settings.max_connections)  # before the Server sizes its cap from it
    app = ServerApp(None, settings)
    server = Server(app)
    engine = None
    try:
        server.start()
        engine = load_engine()
        if not stop.is_set():
            engine.warm_up(grammars=True)  # the grammar index too: off the first structured request
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
