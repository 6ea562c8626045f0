"""The checks every request passes before its route runs: Host (DNS rebinding), Origin (CORS),
the API key, and CORS preflight answers.

Order (ServerApp._handle): Host, then Origin, then a preflight for a known route is answered
(browsers send preflights without credentials), then the API key on every path but /health,
known or not (so routes cannot be probed without it), then 404/405."""

from __future__ import annotations

import hmac

from .errors import HTTPError, quote
from .exchange import Exchange
from .settings import ServerSettings, host_name


def check_host(settings: ServerSettings, exchange: Exchange, accepted: frozenset[str]) -> None:
    """``accepted``: ``settings.accepted_hosts``, computed once by the app."""
    header = exchange.headers.get("host")
    if header is None or "*" in settings.allowed_hosts:
        return  # HTTP/1.0 without Host: not a browser, so not a rebinding attack
    name = host_name(header)
    if name is None or name not in accepted:
        raise HTTPError(
            403,
            f"Host {quote(header)} is not allowed (DNS rebinding protection); "
            "start the server with --allowed-host NAME to accept it",
            code="host_not_allowed",
        )


def check_origin(settings: ServerSettings, exchange: Exchange) -> None:
    origin = exchange.headers.get("origin")
    if origin is None:
        return
    origins = settings.cors_origins
    if "*" in origins:
        exchange.cors_headers = [(b"access-control-allow-origin", b"*")]
    elif origin in origins:
        exchange.cors_headers = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"vary", b"Origin"),
        ]
    else:
        raise HTTPError(
            403,
            f"Origin {quote(origin)} is not allowed; start the server with --cors-origin ORIGIN to allow it",
            code="origin_not_allowed",
        )


def check_api_key(settings: ServerSettings, exchange: Exchange) -> None:
    key = settings.api_key
    if key is None:
        return
    scheme, _, token = exchange.headers.get("authorization", "").strip().partition(" ")
    given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
    if "x-api-key" in exchange.headers and not given:  # Anthropic's clients send it so
        given = exchange.headers["x-api-key"].strip().encode("latin-1")
    if not hmac.compare_digest(given, key.encode()):
        raise HTTPError(
            401,
            "missing or wrong API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
            code="invalid_api_key",
            headers=[("www-authenticate", "Bearer")],
        )


def is_preflight(exchange: Exchange) -> bool:
    """A CORS preflight from an allowed origin (``check_origin`` set the CORS headers; without
    --cors-origin any Origin was refused before)."""
    return (
        exchange.scope["method"] == "OPTIONS"
        and bool(exchange.cors_headers)
        and "access-control-request-method" in exchange.headers
    )


async def preflight(exchange: Exchange, methods: str) -> None:
    """204 with what the route accepts; ``methods`` like "POST" or "GET, HEAD"."""
    requested = exchange.headers.get("access-control-request-headers", "authorization, content-type")
    await exchange.start(
        204,
        [
            ("allow", f"{methods}, OPTIONS"),
            ("content-length", "0"),
            ("access-control-allow-methods", f"{methods}, OPTIONS"),
            ("access-control-allow-headers", requested),
            ("access-control-max-age", "600"),
        ],
    )
    await exchange.body(b"")
