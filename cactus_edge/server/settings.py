"""How the server listens and what it lets through: :class:`ServerSettings`, the defaults, the
`serve` flags generated from its fields (:func:`setting_flags`), and Host-header names
(normalised for the DNS-rebinding check)."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from ..engine.config import GenerationConfig
from ..errors import InvalidSettingError
from ..openai_api import MODEL_ALIAS  # the id every server accepts, whatever it serves

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765  # not llama-server's 8080, llama-cpp-python's 8000, LM Studio's 1234, Ollama's 11434
DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 512  # far above what desktop clients open (a browser: 6 per host)
DEFAULT_IDLE_TIMEOUT = 5.0  # uvicorn's keep-alive default, and httpx's pool expiry
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0  # a 4 MiB body at 140 KB/s: generous for loopback or a LAN
DEFAULT_SHUTDOWN_GRACE = 3.0
DEFAULT_RESPONSES_STORE_MIB = 64  # thousands of agent turns' responses and conversations
API_KEY_ENV = "CACTUS_EDGE_API_KEY"
# Host names of this machine, as a Host header writes them (an IPv6 address in brackets); a bound
# address is normalised the same way (_normalize_host) before it is looked up here.
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
RETRY_AFTER_SECONDS = 1


def _flag(default: Any, help: str, **flag: Any) -> Any:
    """A ServerSettings field that `cactus-edge serve` offers as a flag: its default is the
    flag's, ``help`` the flag's help. ``flag`` may give ``name`` (default: ``--`` and the field's
    name with dashes), ``metavar``, ``envvar``, and ``command_default``: what `serve` uses when
    the flag is not given, instead of the field's default (the flag's default is then None)."""
    return field(default=default, metadata={"flag": {"help": help, **flag}})


@dataclass(frozen=True)
class ServerSettings:
    """How the server listens and what it lets through. Each field's meaning is the help of its
    `serve` flag (the ``help`` in its metadata); ``base_config`` holds the generation defaults
    that requests override (the CLI's sampling flags) and ``default_system`` a system message
    added to chat requests that have none (``--system``)."""

    host: str = _flag(DEFAULT_HOST, "Address to bind (loopback by default).")
    port: int = _flag(DEFAULT_PORT, "TCP port; 0 picks a free one.")
    uds: str | None = _flag(None, "Listen on this Unix socket instead of TCP.", metavar="PATH")
    api_key: str | None = _flag(
        None,
        f"Require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on every route but /health "
        f"(default: ${API_KEY_ENV}, else no key).",
        envvar=API_KEY_ENV,
        metavar="KEY",
    )
    cors_origins: tuple[str, ...] = _flag(
        (),
        "Browser origin allowed to call (repeatable; none by default; '*' = any, never with credentials).",
        name="--cors-origin",
        metavar="ORIGIN",
    )
    allowed_hosts: tuple[str, ...] = _flag(
        (),
        "Host header accepted besides localhost/127.0.0.1/[::1] (repeatable; '*' = any; "
        "DNS-rebinding protection).",
        name="--allowed-host",
        metavar="NAME",
    )
    max_queue: int = _flag(DEFAULT_MAX_QUEUE, "Requests that may wait behind the running one; more get 503.")
    max_tokens_cap: int | None = _flag(
        None, "Most tokens one request may generate (default: the context's room)."
    )
    metrics: bool = _flag(False, "Serve Prometheus metrics at GET /metrics.")
    max_body_bytes: int = _flag(DEFAULT_MAX_BODY_BYTES, "Largest request body, in bytes; larger get 413.")
    model_name: str = _flag(
        MODEL_ALIAS,
        f"Model id /v1/models lists and requests may name ('{MODEL_ALIAS}' always works too).",
        command_default="the target's registered name, or its file name without .gguf",
        metavar="ID",
    )
    base_config: GenerationConfig = field(default_factory=GenerationConfig)
    default_system: str | None = None
    shutdown_grace: float = _flag(
        DEFAULT_SHUTDOWN_GRACE, "Seconds open connections get to finish when the server stops."
    )
    idle_timeout: float = _flag(
        DEFAULT_IDLE_TIMEOUT,
        "Seconds a connection may stay open without a request in progress (new, or kept alive "
        "between requests) before it is closed.",
    )
    header_timeout: float = _flag(
        DEFAULT_HEADER_TIMEOUT, "Seconds from a request's first byte to the end of its headers (else 408)."
    )
    body_timeout: float = _flag(
        DEFAULT_BODY_TIMEOUT, "Seconds from the end of a request's headers to the end of its body (else 408)."
    )
    max_connections: int = _flag(
        DEFAULT_MAX_CONNECTIONS,
        "Open connections at most (lowered to stay below the descriptor limit); beyond it the oldest "
        "idle one is closed, or, if every one is busy, the new one gets 503.",
    )
    responses_store_mib: int = _flag(
        DEFAULT_RESPONSES_STORE_MIB,
        "Memory for stored /v1/responses answers (store: true), which previous_response_id continues, "
        "in MiB; least recently used out first; 0 stores none.",
        metavar="MIB",
    )
    debug: bool = _flag(
        False,
        "Check the engine's caches after every generation and serve GET /debug/caches (soak tests; "
        "costs a little per request).",
    )

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise InvalidSettingError(f"max_queue must be >= 0, got {self.max_queue}", param="max_queue")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise InvalidSettingError(
                f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}", param="max_tokens_cap"
            )
        if self.responses_store_mib < 0:
            raise InvalidSettingError(
                f"responses_store_mib must be >= 0, got {self.responses_store_mib}",
                param="responses_store_mib",
            )
        if self.max_body_bytes < 1024:
            raise InvalidSettingError(
                f"max_body_bytes must be >= 1024, got {self.max_body_bytes}", param="max_body_bytes"
            )
        for name in ("idle_timeout", "header_timeout", "body_timeout"):
            seconds = getattr(self, name)
            if not seconds > 0:  # NaN too
                raise InvalidSettingError(f"{name} must be > 0 seconds, got {seconds}", param=name)
        if not self.shutdown_grace >= 0:
            raise InvalidSettingError(
                f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}", param="shutdown_grace"
            )
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
    def exposed(self) -> bool:
        """Whether it listens beyond this machine: TCP on an address that is not loopback."""
        return self.uds is None and _normalize_host(self.host) not in LOOPBACK_HOSTS

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


@dataclass(frozen=True)
class SettingFlag:
    """One `serve` flag, made from a ServerSettings field (:func:`setting_flags`).

    field: the field it sets (and the command's parameter name). name: "--max-queue".
    type: int, float, str or bool (bool: a flag without a value). repeatable: a tuple field, the
    flag given once per item. default: the flag's default (None: none; the help says what then).
    """

    field: str
    name: str
    help: str
    type: type
    repeatable: bool
    default: Any
    metavar: str | None = None
    envvar: str | None = None


def setting_flags() -> list[SettingFlag]:
    """The `serve` flags of ServerSettings' fields, in field order: type from the annotation
    (``X | None`` is X, ``tuple[X, ...]`` a repeatable X), default and help from the field."""
    hints = typing.get_type_hints(ServerSettings)
    flags = []
    for spec in fields(ServerSettings):
        options = spec.metadata.get("flag")
        if options is None:
            continue
        value_type, repeatable = _flag_type(hints[spec.name])
        default = None if "command_default" in options else spec.default
        text = options["help"]
        if "command_default" in options:
            text = f"{text} Default: {options['command_default']}."
        flags.append(
            SettingFlag(
                field=spec.name,
                name=options.get("name", "--" + spec.name.replace("_", "-")),
                help=text,
                type=value_type,
                repeatable=repeatable,
                default=default,
                metavar=options.get("metavar"),
                envvar=options.get("envvar"),
            )
        )
    return flags


def _flag_type(hint: Any) -> tuple[type, bool]:
    """(the value type, repeatable) of a field's annotation."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False
