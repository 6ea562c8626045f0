"""A target whose layers live on RPC workers, run in a supervised model process.

ggml's RPC client aborts its process when a worker dies, answers garbage or never existed, and it
has no timeouts: a stopped worker hangs it forever. So the llama.cpp context that talks to the
workers lives in a child process (``python -m cactus_edge.llama.remote``), and the process that
embeds us holds a :class:`RemoteLlamaModel`: the vocabulary loaded locally (tokenizing, grammars,
chat templates never cross a process), and every cache operation sent to the child over a socket
pair, each answer awaited with a deadline. A child that dies or misses its deadline is killed,
the worker at fault is found by a handshake probe, and the call raises :class:`WorkerLostError`
naming it. The cache mirror is then empty (a consistent cache); the next decode probes the
workers and, when all answer, starts a new model process and reloads.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from .. import errors
from ..errors import BackendError, WorkerLostError
from . import DEFAULT_N_CTX
from .gguf import GGUFInfo, read_gguf
from .library import set_verbose
from .model import DevicePlacement, LlamaModel, Model, physical_cores
from .rpc import parse_endpoints, probe_worker, rpc_registry, target_devices
from .vocabulary import Vocabulary

DEFAULT_RPC_TIMEOUT = 60.0  # seconds one cache operation may take (a long prefill over a LAN)
PROBE_TIMEOUT = 3.0  # seconds a worker has to answer the handshake probe
ALL_LAYERS = 999  # llama.cpp offloads min(n_gpu_layers, n_layer + 1) layers: all of them


class RemoteLlamaModel(Model):
    """A model whose weights and KV cache live on RPC workers.

    The vocabulary (tokenize, detokenize, end-of-generation ids, chat template, grammar
    tokenizer) is local; decode, truncate, reset and the cache checks go to the model process.
    ``n_gpu_layers`` counts the layers placed on the workers (all by default); the rest stay on
    this machine's CPU. ``tensor_split`` gives each worker's share (default: in proportion to
    their free memory, llama.cpp's split). ``timeout``: seconds one call may take before the
    worker is declared lost.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        rpc_servers: str | Sequence[str],
        n_ctx: int = DEFAULT_N_CTX,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        n_batch: int = 512,
        tensor_split: Sequence[float] = (),
        timeout: float = DEFAULT_RPC_TIMEOUT,
        info: GGUFInfo | None = None,
        verbose: bool = False,
    ) -> None:
        self._process: _ModelProcess | None = None
        path = Path(path)
        info = info or read_gguf(path)
        self.endpoints = parse_endpoints(rpc_servers)
        rpc_registry()  # a build without RPC fails here, before anything starts
        super().__init__(path, info, Vocabulary.load(path))
        self.n_threads = n_threads or physical_cores()
        self.n_gpu_layers = n_gpu_layers if n_gpu_layers > 0 else ALL_LAYERS
        self.tensor_split = tuple(float(share) for share in tensor_split)
        self.timeout = timeout
        self._settings = {
            "n_ctx": n_ctx,
            "n_threads": self.n_threads,
            "n_gpu_layers": self.n_gpu_layers,
            "n_batch": n_batch,
        }
        self._verbose = verbose
        self._call_lock = threading.Lock()
        self.n_ctx, self.n_batch = n_ctx, n_batch  # until the model process reports its own
        self.devices: list[str] = []
        self.device = f"RPC {', '.join(str(endpoint) for endpoint in self.endpoints)}"
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # --- lifecycle -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.vocabulary.closed:
            raise BackendError(f"{self.path.name} is closed")

    @property
    def closed(self) -> bool:
        return self.vocabulary.closed

    @property
    def connected(self) -> bool:
        """Whether a model process holds the weights now (False after a lost worker)."""
        return self._process is not None

    def close(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None
        if getattr(self, "vocabulary", None) is not None:  # absent if the vocabulary failed to load
            self.vocabulary.close()

    def cost_identity(self) -> dict | None:
        identity = super().cost_identity()
        if identity is not None:
            identity["rpc"] = [str(endpoint) for endpoint in self.endpoints]
            identity["tensor_split"] = list(self.tensor_split)
        return identity

    def _start(self) -> None:
        """Probe every worker, then start a model process and load the weights onto them."""
        for endpoint in self.endpoints:
            probe_worker(endpoint, min(self.timeout, PROBE_TIMEOUT))
        self._process = _ModelProcess.spawn(self._verbose)
        load = ("load", str(self.path), self._settings, self.tensor_split, [str(e) for e in self.endpoints])
        try:
            loaded = self._ask(load)
        except BaseException:
            if self._process is not None:  # a refused load (a context too long, say)
                self._process.stop()
                self._process = None
            raise
        self.n_ctx, self.n_batch, self.devices = loaded["n_ctx"], loaded["n_batch"], loaded["devices"]
        self.tokens.clear()

    # --- calls into the model process ----------------------------------------------------------

    def _call(self, *request):
        """Send one request and return its answer; reconnects first if a worker was lost."""
        self._check_open()
        with self._call_lock:
            if self._process is None:
                self._start()
            return self._ask(request)

    def _ask(self, request: tuple):
        process = self._process
        try:
            answer = process.request(request, self.timeout)
        except _ProcessLost as lost:
            raise self._lost(lost) from None
        except BaseException:
            # Interrupted (Ctrl-C) while the child works: its answer would arrive as the next
            # request's, so the process is dropped; the next call reloads, the mirror is empty.
            self._process = None
            process.stop()
            self.tokens.clear()
            raise
        kind, value, child_n_past = answer
        if kind == "error":
            raise _rebuilt_error(*value)
        if request[0] != "load" and child_n_past < len(self.tokens):
            del self.tokens[child_n_past:]  # sync_cache may have emptied a broken cache
        return value

    def _lost(self, lost: _ProcessLost) -> WorkerLostError:
        """Stop the model process, empty the mirror, and name the worker at fault."""
        process, self._process = self._process, None
        said = process.stop()
        self.tokens.clear()
        for endpoint in self.endpoints:
            try:
                probe_worker(endpoint, PROBE_TIMEOUT)
            except WorkerLostError as error:
                return WorkerLostError(
                    f"lost RPC worker {endpoint} during {lost.request!r}: {error}", endpoint=error.endpoint
                )
        said = re.sub(r"^\S+:\d+: ", "", said)  # ggml's abort names its source line first
        detail = f": {said}" if said else ""
        if len(self.endpoints) == 1:  # every worker answers a handshake, so blame the only one
            endpoint = str(self.endpoints[0])
            return WorkerLostError(f"RPC worker {endpoint} failed during {lost.request!r}{detail}", endpoint)
        workers = ", ".join(str(e) for e in self.endpoints)
        return WorkerLostError(f"one of the RPC workers {workers} failed: the model process {lost}{detail}")

    # --- the cache -----------------------------------------------------------------------------

    def decode(
        self, tokens: Sequence[int], output_rows: Sequence[int] = (-1,), *, copy: bool = True
    ) -> np.ndarray:
        """As :meth:`LlamaModel.decode`; the logits always arrive as a fresh array."""
        if len(tokens) == 0:
            raise ValueError("decode needs at least one token")
        self.last_decode_ms = 0.0
        tokens = [int(t) for t in tokens]
        logits, decode_ms = self._call("decode", tokens, [int(row) for row in output_rows])
        self.last_decode_ms = decode_ms
        self.tokens.extend(tokens)
        return logits

    def truncate(self, n_tokens: int) -> None:
        if not 0 <= n_tokens <= self.n_past:
            raise ValueError(f"cannot truncate to {n_tokens}: the cache holds {self.n_past} tokens")
        if n_tokens < self.n_past:
            self._call("truncate", n_tokens)
            del self.tokens[n_tokens:]

    def cache_range(self) -> tuple[int, int]:
        if self._process is None:
            self._check_open()
            return (-1, -1)  # no model process, no cache: what an empty mirror says
        return tuple(self._call("cache_range"))

    def sync_cache(self) -> None:
        if self._process is not None:  # a lost model's empty mirror is already in sync
            self._call("sync_cache")

    def reset(self) -> None:
        if self._process is not None:
            self._call("reset")
        self.tokens.clear()


class _ProcessLost(Exception):
    """The model process died or missed a deadline during ``request`` (the message says which)."""

    def __init__(self, message: str, request: str) -> None:
        super().__init__(message)
        self.request = request


class _ModelProcess:
    """The child that holds the RPC-backed llama.cpp context, and the socket pair to it."""

    def __init__(self, popen: subprocess.Popen, connection: Connection, stderr) -> None:
        self.popen, self.connection, self.stderr = popen, connection, stderr

    @classmethod
    def spawn(cls, verbose: bool) -> _ModelProcess:
        ours, theirs = socket.socketpair()
        stderr = None if verbose else tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop)
        # No gdb backtrace on abort (seconds), and its own session: a terminal's Ctrl-C is ours to
        # handle, not the child's to die of.
        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
        with theirs:
            popen = subprocess.Popen(
                [sys.executable, "-m", "cactus_edge.llama.remote", str(theirs.fileno()), str(int(verbose))],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
                start_new_session=True,
            )
        return cls(popen, Connection(ours.detach()), stderr)

    def request(self, request: tuple, timeout: float):
        """Send ``request``; the answer (kind, value, n_past). Progress messages (while loading)
        restart the deadline."""
        try:
            self.connection.send(request)
            deadline = time.monotonic() + timeout
            while True:
                if not self.connection.poll(max(0.0, deadline - time.monotonic())):
                    raise _ProcessLost(f"did not answer {request[0]!r} within {timeout:g} s", request[0])
                answer = self.connection.recv()
                if answer[0] != "progress":
                    return answer
                deadline = time.monotonic() + timeout
        except (EOFError, OSError):
            self.popen.wait(timeout=5)
            raise _ProcessLost(f"died ({_exit_description(self.popen.returncode)})", request[0]) from None

    def stop(self) -> str:
        """Kill the process (it holds nothing that must be flushed), reap it, and return the last
        line it wrote to stderr (ggml's abort message), if that was kept."""
        if self.popen.poll() is None:
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be refused
            self.popen.wait(timeout=5)
        self.connection.close()
        if self.stderr is None:
            return ""
        with self.stderr:
            self.stderr.seek(0)
            lines = self.stderr.read().decode(errors="replace").splitlines()
        said = [line.strip() for line in lines if line.strip()]
        return said[-1] if said else ""


def _exit_description(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def _rebuilt_error(module: str, name: str, message: str, attributes: dict) -> BaseException:
    """The model process's exception, rebuilt here: our typed errors keep their class and
    attributes (``row`` of a non-finite logit, say); anything else becomes a BackendError."""
    cls = getattr(errors if module == errors.__name__ else builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return BackendError(f"the RPC model process failed: {name}: {message}")
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(attributes)
    return error


# --- the model process ---------------------------------------------------------------------------


def _load(connection: Connection, path: str, settings: dict, tensor_split, endpoints: list[str]):
    placement = DevicePlacement(
        devices=tuple(target_devices(parse_endpoints(endpoints))),
        tensor_split=tuple(tensor_split),
        on_progress=lambda fraction: connection.send(("progress", fraction)) or True,
    )
    model = LlamaModel(path, placement=placement, **settings)
    return model, {"n_ctx": model.n_ctx, "n_batch": model.n_batch, "devices": list(endpoints)}


def _answer(model: LlamaModel, kind: str, args: tuple):
    if kind == "decode":
        return model.decode(*args, copy=True), model.last_decode_ms
    return getattr(model, kind)(*args)  # truncate, cache_range, sync_cache, reset


_REQUESTS = {"decode", "truncate", "cache_range", "sync_cache", "reset"}


def serve(fd: int, verbose: bool) -> None:
    """The model process: answer requests on socket ``fd`` until the host closes it."""
    set_verbose(verbose)
    connection = Connection(fd)
    model = None
    while True:
        try:
            kind, *args = connection.recv()
        except (EOFError, OSError):
            return  # the host is gone: so are we
        try:
            if kind == "load":
                model, value = _load(connection, *args)
            elif kind in _REQUESTS and model is not None:
                value = _answer(model, kind, tuple(args))
            else:
                raise BackendError(f"the RPC model process got an unknown request {kind!r}")
            connection.send(("ok", value, model.n_past))
        except Exception as error:
            cls = type(error)
            detail = (cls.__module__, cls.__qualname__, str(error), dict(vars(error)))
            connection.send(("error", detail, model.n_past if model is not None else 0))


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2] == "1")
