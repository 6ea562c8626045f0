"""`cactus-edge worker`: ggml's own RPC server, started from Python (no second binary).

A worker holds the layers a host places on it and computes the graphs the host sends. The
protocol has no authentication (llama.cpp's rpc-server README says so): anyone who reaches the
port runs graphs on it and reads its memory. So it binds to loopback unless told otherwise, and
binding anywhere else needs ``--insecure-bind``.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CactusEdgeError, InvalidSettingError, WorkerLostError
from .rpc import (
    DEFAULT_PORT,
    Endpoint,
    device_name,
    probe_worker,
    rpc_registry,
    serve_rpc,
    worker_devices,
)

INSECURE_WARNING = (
    "warning: ggml's RPC protocol has no authentication and no encryption: anyone who can reach "
    "{endpoint} can run code-like graphs on this machine and read its memory. Expose it only on a "
    "network you trust (a private LAN, a VPN, an SSH tunnel)."
)


class WorkerStartError(CactusEdgeError):
    """The RPC server could not start (a port in use, an address this machine does not have)."""

    exit_code = 6


@dataclass(frozen=True)
class WorkerSettings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    n_threads: int | None = None
    cache_dir: str | None = None  # ggml's tensor cache: a restarted host re-sends no weights
    insecure_bind: bool = False


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (unresolvable: not)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_bind(settings: WorkerSettings) -> str | None:
    """The warning to print for a non-loopback bind (None for loopback); refuses it without
    ``insecure_bind``."""
    if is_loopback(settings.host):
        return None
    warning = INSECURE_WARNING.format(endpoint=f"{settings.host}:{settings.port}")
    if not settings.insecure_bind:
        raise InvalidSettingError(
            f"refusing to bind the RPC worker to {settings.host}, which is not loopback: {warning} "
            "Pass --insecure-bind to do it anyway.",
            param="host",
        )
    return warning


def _check_port_free(endpoint: Endpoint) -> None:
    """ggml only prints that it could not bind; find out first, with a typed error."""
    family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((endpoint.host, endpoint.port))
        except OSError as error:
            raise WorkerStartError(f"cannot listen on {endpoint}: {error.strerror or error}") from None


def worker_command(port: int, *flags: str) -> list[str]:
    """The command line that starts a worker on ``port`` with this Python (scripts and tests)."""
    return [sys.executable, "-m", "cactus_edge.cli.main", "worker", "--port", str(port), *flags]


def wait_for_worker(endpoint: Endpoint, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Return once the worker at ``endpoint`` answers the handshake. Raises the last probe's
    WorkerLostError when it has not within ``timeout`` s, or as soon as ``alive()`` is False (the
    worker's process exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            probe_worker(endpoint, 1.0)
            return
        except WorkerLostError:
            if not alive() or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run_worker(settings: WorkerSettings, announce=print) -> None:
    """Serve until SIGTERM or SIGINT (then return: exit 0). Raises WorkerStartError if ggml's
    server stops on its own (it only does when it cannot start)."""
    from .model import physical_cores

    warning = check_bind(settings)
    rpc_registry()  # RPCUnavailableError (with the rebuild command) before anything binds
    endpoint = Endpoint(settings.host, settings.port)
    _check_port_free(endpoint)
    if settings.cache_dir:
        Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)
    n_threads = settings.n_threads or physical_cores()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = threading.Thread(
            target=serve_rpc, args=(endpoint, settings.cache_dir, n_threads), name="rpc-server", daemon=True
        )
        server.start()
        if warning:
            print(warning, file=sys.stderr)
        devices = ", ".join(device_name(d) for d in worker_devices())
        announce(f"cactus-edge worker on {endpoint} ({devices}, {n_threads} threads); Ctrl-C stops it")
        # A short wait, not join(): the main thread must come back to Python for signal handlers.
        while not stop.wait(0.2):
            if not server.is_alive():
                raise WorkerStartError(f"ggml's RPC server on {endpoint} stopped (see the lines above)")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
