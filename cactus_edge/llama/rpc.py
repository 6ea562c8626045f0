"""ggml's RPC backend: the worker's server, the host's devices, and a handshake probe in Python.

The half of the backend (see :mod:`backend`) that reaches ggml's RPC code. Two warnings rule it:

- ggml's RPC *client* calls ``GGML_ABORT`` when a worker is absent, dies or answers garbage. So
  :func:`add_rpc_devices` (it connects) runs only inside the supervised model process
  (:mod:`remote_model`), never in a process that embeds us.
- The protocol has no authentication: a worker executes whatever graph any client sends. So the
  worker binds to loopback unless told otherwise (:mod:`worker`).

:func:`probe_worker` speaks the protocol's first message (HELLO) from Python with a timeout, so
an absent, stopped or incompatible worker is told apart from a live one without touching ggml.
"""

from __future__ import annotations

import ctypes
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..dependencies import incompatible
from ..errors import InvalidSettingError, RPCUnavailableError, WorkerLostError

# The protocol the ggml vendored by llama-cpp-python 0.3.36 speaks (ggml-rpc.h); a worker must
# have the same major and at most this minor (what ggml's own client checks).
PROTOCOL_MAJOR, PROTOCOL_MINOR = 7, 0
_HELLO = 14  # RPC_CMD_HELLO, fixed across versions
_CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE: the HELLO request's body
_HELLO_REPLY_SIZE = 4 + _CAPS_SIZE  # major, minor, patch, padding, caps
DEFAULT_PORT = 50052
REBUILD_HINT = (
    "rebuild llama-cpp-python with ggml's RPC backend: "
    "CMAKE_ARGS='-DGGML_RPC=ON' pip install --force-reinstall --no-cache-dir 'llama-cpp-python==0.3.36' "
    "(on x86_64 Linux add the -mno-amx flags of docs/install.md; or ./scripts/setup, which does both)"
)


@dataclass(frozen=True)
class Endpoint:
    """One worker's address, as ggml spells it ("host:port")."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str | Sequence[str]) -> list[Endpoint]:
    """ "h1:50052,h2:50052" (or a list of such) → endpoints; a missing port means 50052. Raises
    InvalidSettingError naming the bad item."""
    items = text.split(",") if isinstance(text, str) else list(text)
    endpoints = []
    for item in (str(item).strip() for item in items):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", str(DEFAULT_PORT))
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidSettingError(f"rpc server {item!r} is not HOST:PORT", param="rpc_servers")
        endpoints.append(Endpoint(host.strip("[]"), int(port)))
    if not endpoints:
        raise InvalidSettingError("no RPC servers given", param="rpc_servers")
    if len(set(endpoints)) != len(endpoints):
        raise InvalidSettingError("an RPC server is listed twice", param="rpc_servers")
    return endpoints


# --- the handshake, in Python --------------------------------------------------------------------


def probe_worker(endpoint: Endpoint, timeout: float) -> tuple[int, int, int]:
    """The worker's protocol version (major, minor, patch), read from its HELLO answer within
    ``timeout`` seconds. Raises :class:`WorkerLostError` naming the endpoint when nothing listens,
    it does not answer in time (stopped, overloaded, or serving another host: a worker serves one
    host at a time), or it answers in another protocol."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack("<BQ", _HELLO, _CAPS_SIZE) + bytes(_CAPS_SIZE))
            size = struct.unpack("<Q", _receive(sock, 8, endpoint))[0]
            if size != _HELLO_REPLY_SIZE:
                raise _version_error(endpoint, f"a HELLO answer of {size} bytes")
            major, minor, patch = _receive(sock, size, endpoint)[:3]
    except TimeoutError:
        raise WorkerLostError(
            f"RPC worker {endpoint} did not answer within {timeout:g} s (stopped, overloaded, or "
            "serving another host: a worker serves one host at a time)",
            endpoint=str(endpoint),
        ) from None
    except OSError as error:
        raise WorkerLostError(
            f"no RPC worker at {endpoint} ({error.strerror or error}); start one there with "
            f"`cactus-edge worker --port {endpoint.port}`",
            endpoint=str(endpoint),
        ) from None
    if major != PROTOCOL_MAJOR or minor > PROTOCOL_MINOR:
        raise _version_error(endpoint, f"protocol {major}.{minor}.{patch}")
    return major, minor, patch


def _receive(sock: socket.socket, n_bytes: int, endpoint: Endpoint) -> bytes:
    data = b""
    while len(data) < n_bytes:
        chunk = sock.recv(n_bytes - len(data))
        if not chunk:  # an older or newer server closes on a HELLO it cannot parse
            raise _version_error(endpoint, "a closed connection")
        data += chunk
    return data


def _version_error(endpoint: Endpoint, what: str) -> WorkerLostError:
    return WorkerLostError(
        f"RPC worker {endpoint} answered the handshake with {what}: it runs another version of "
        f"ggml's RPC protocol (this host speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}); run the same "
        "cactus-edge / llama-cpp-python version on host and workers",
        endpoint=str(endpoint),
    )


# --- ggml, through ctypes ------------------------------------------------------------------------

_DEVICE_TYPE_CPU, _DEVICE_TYPE_ACCEL = 0, 3  # enum ggml_backend_dev_type
_bound = None


def _ggml():
    """libggml as llama-cpp-python loaded it, with the few registry functions we call typed."""
    global _bound
    if _bound is None:
        from .library import ggml_library

        libggml = ggml_library()
        pointer = ctypes.c_void_p
        for name, argtypes, restype in (
            ("ggml_backend_reg_by_name", [ctypes.c_char_p], pointer),
            ("ggml_backend_reg_get_proc_address", [pointer, ctypes.c_char_p], pointer),
            ("ggml_backend_register", [pointer], None),
            ("ggml_backend_reg_dev_count", [pointer], ctypes.c_size_t),
            ("ggml_backend_reg_dev_get", [pointer, ctypes.c_size_t], pointer),
            ("ggml_backend_dev_count", [], ctypes.c_size_t),
            ("ggml_backend_dev_get", [ctypes.c_size_t], pointer),
            ("ggml_backend_dev_type", [pointer], ctypes.c_int),
            ("ggml_backend_dev_name", [pointer], ctypes.c_char_p),
            ("ggml_backend_dev_description", [pointer], ctypes.c_char_p),
            ("ggml_backend_dev_by_type", [ctypes.c_int], pointer),
        ):
            function = _symbol(libggml, name)
            function.argtypes, function.restype = argtypes, restype
        _bound = libggml
    return _bound


def _symbol(libggml, name: str):
    try:
        return getattr(libggml, name)
    except AttributeError as error:
        raise incompatible("llama-cpp-python", f"loads a libggml without {name}", "--rpc") from error


def rpc_registry() -> int:
    """ggml's RPC backend registry (a pointer), as llama.cpp's --rpc finds it. Raises
    :class:`RPCUnavailableError` with the rebuild command when this build lacks it."""
    registry = _ggml().ggml_backend_reg_by_name(b"RPC")
    if not registry:
        raise RPCUnavailableError(f"this llama-cpp-python has no RPC backend; {REBUILD_HINT}")
    return registry


def rpc_supported() -> bool:
    try:
        rpc_registry()
    except RPCUnavailableError:
        return False
    return True


def _proc(name: str, restype, *argtypes):
    address = _ggml().ggml_backend_reg_get_proc_address(rpc_registry(), name.encode())
    if not address:
        raise RPCUnavailableError(f"ggml's RPC backend lacks {name}; {REBUILD_HINT}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def add_rpc_devices(endpoints: Sequence[Endpoint]) -> list[int]:
    """Register each worker's devices, as llama.cpp's ``common/arg.cpp`` does for ``--rpc``, and
    return them (device pointers) in endpoint order. Connects to every worker: ggml aborts the
    process if one is absent or answers garbage, so call it only in the model process."""
    add_server = _proc("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    ggml, devices = _ggml(), []
    for endpoint in endpoints:
        registry = add_server(str(endpoint).encode())
        ggml.ggml_backend_register(registry)
        devices += [
            ggml.ggml_backend_reg_dev_get(registry, i)
            for i in range(ggml.ggml_backend_reg_dev_count(registry))
        ]
    return devices


def local_gpus() -> list[int]:
    """This machine's GPU-like devices (Metal, CUDA, Vulkan…; not the CPU, not RPC workers)."""
    ggml = _ggml()
    all_devices = [ggml.ggml_backend_dev_get(i) for i in range(ggml.ggml_backend_dev_count())]
    return [
        device
        for device in all_devices
        if ggml.ggml_backend_dev_type(device) not in (_DEVICE_TYPE_CPU, _DEVICE_TYPE_ACCEL)
        and not device_name(device).startswith("RPC")
    ]


def target_devices(endpoints: Sequence[Endpoint]) -> list[int]:
    """The devices a host offloads its target to, in llama.cpp's default order: the workers'
    first (fewer network transfers), then local GPUs. llama.cpp's own default list leaves out
    devices registered after its backend started, so the list is given explicitly."""
    return add_rpc_devices(endpoints) + local_gpus()


def worker_devices() -> list[int]:
    """What a worker serves, as llama.cpp's rpc-server picks: every GPU-like device, else the CPU."""
    return local_gpus() or [_ggml().ggml_backend_dev_by_type(_DEVICE_TYPE_CPU)]


def device_name(device: int) -> str:
    return _ggml().ggml_backend_dev_name(device).decode(errors="replace")


def describe_device(device: int) -> str:
    """ggml's name and description of a device: "Metal (Apple M2 Max)", "CUDA0 (NVIDIA RTX 4090)"."""
    description = (_ggml().ggml_backend_dev_description(device) or b"").decode(errors="replace")
    name = device_name(device)
    return f"{name} ({description})" if description and description != name else name


def serve_rpc(endpoint: Endpoint, cache_dir: str | None, n_threads: int) -> None:
    """ggml's RPC server on ``endpoint`` (blocks for good; one host at a time). Returns only if
    the server could not start (a port in use, say: ggml prints why)."""
    start = _proc(
        "ggml_backend_rpc_start_server",
        None,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p),
    )
    devices = worker_devices()
    array = (ctypes.c_void_p * len(devices))(*devices)
    cache = cache_dir.encode() if cache_dir else None
    start(str(endpoint).encode(), cache, n_threads, len(devices), array)
