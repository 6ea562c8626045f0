"""How the server listens and what it lets through: :class:`ServerSettings`, the defaults, and
Host-header names (normalised for the DNS-rebinding check)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import GenerationConfig
from ..errors import InvalidSettingError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765  # not llama-server's 8080, llama-cpp-python's 8000, LM Studio's 1234, Ollama's 11434
DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 512  # far above what desktop clients open (a browser: 6 per host)
DEFAULT_IDLE_TIMEOUT = 5.0  # uvicorn's keep-alive default, and httpx's pool expiry
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0  # a 4 MiB body at 140 KB/s: generous for loopback or a LAN
API_KEY_ENV = "CACTUS_EDGE_API_KEY"
MODEL_ALIAS = "cactus-edge"  # always accepted as `model`, whatever the served id
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class ServerSettings:
    """How the server listens and what it lets through.

    host/port: TCP address (port 0: a free port). uds: a Unix socket path instead of TCP.
    api_key: required as ``Authorization: Bearer KEY`` on every route but /health (None: no key).
    cors_origins: browser origins allowed to call (none by default; "*" = any, never with credentials).
    allowed_hosts: Host header names accepted besides localhost, 127.0.0.1 and [::1] ("*" = any).
    max_queue: requests that may wait behind the running one; more get 503 + Retry-After.
    max_tokens_cap: the most tokens one request may generate (None: the context's room).
    metrics: serve GET /metrics (Prometheus text).
    max_body_bytes: larger request bodies get 413.
    model_name: the id /v1/models lists and requests may name (``cactus-edge`` always works too).
    base_config: generation defaults that requests override (the CLI's flags).
    default_system: a system message added to chat requests that have none.
    shutdown_grace: seconds open connections get to finish when the server stops.
    idle_timeout: seconds a connection may stay open without a request in progress (new, or
      kept alive between requests) before it is closed.
    header_timeout: seconds from a request's first byte to the end of its headers.
    body_timeout: seconds from the end of a request's headers to the end of its body.
    max_connections: open connections at most (lowered to stay below the process's descriptor
      limit, see :func:`~.connections.connection_cap`); beyond it the oldest connection with no
      request in progress is closed, or, if every one is busy, the new one is refused with 503.
    debug: check the engine's caches after every generation and serve GET /debug/caches (soak
      tests; costs a little per request).
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    uds: str | None = None
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_queue: int = DEFAULT_MAX_QUEUE
    max_tokens_cap: int | None = None
    metrics: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_name: str = MODEL_ALIAS
    base_config: GenerationConfig = field(default_factory=GenerationConfig)
    default_system: str | None = None
    shutdown_grace: float = 3.0
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    debug: bool = False

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise InvalidSettingError(f"max_queue must be >= 0, got {self.max_queue}", param="max_queue")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise InvalidSettingError(
                f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}", param="max_tokens_cap"
            )
        if self.max_body_bytes < 1024:
            raise InvalidSettingError(
                f"max_body_bytes must be >= 1024, got {self.max_body_bytes}", param="max_body_bytes"
            )
        for name in ("idle_timeout", "header_timeout", "body_timeout"):
            seconds = getattr(self, name)
            if not seconds > 0:  # NaN too
                raise InvalidSettingError(f"{name} must be > 0 seconds, got {seconds}", param=name)
        if self.max_connections < 1:
            raise InvalidSettingError(
                f"max_connections must be >= 1, got {self.max_connections}", param="max_connections"
            )
        if not 0 <= self.port <= 65535:
            raise InvalidSettingError(f"port must be in [0, 65535], got {self.port}", param="port")
        if self.api_key is not None and not self.api_key:
            raise InvalidSettingError("the API key must not be empty", param="api_key")
        for origin in self.cors_origins:
            if origin != "*" and ("://" not in origin or origin.endswith("/")):
                raise InvalidSettingError(
                    f"a CORS origin looks like scheme://host[:port] (no path, no trailing /), got {origin!r}",
                    param="cors_origin",
                )

    @property
    def accepted_hosts(self) -> frozenset[str]:
        names = {_normalize_host(name) for name in self.allowed_hosts}
        if self.uds is None and self.host not in ("0.0.0.0", "::", ""):
            names.add(_normalize_host(self.host))  # the address we bind is never a rebinding
        return LOOPBACK_HOSTS | names


def _normalize_host(name: str) -> str:
    name = name.strip().lower()
    if ":" in name and not name.startswith("["):
        return f"[{name}]"  # a bare IPv6 address
    return name


def host_name(header: str) -> str | None:
    """The host part of a Host header ("[::1]:8765" → "[::1]"); None when malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return None
        name, rest = header[: end + 1], header[end + 1 :]
    else:
        name, _, port = header.partition(":")
        rest = f":{port}" if port or header.endswith(":") else ""
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    return name or None
