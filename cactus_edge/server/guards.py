"""The checks every request passes before its route runs: Host (DNS rebinding), Origin (CORS),
the API key, and CORS preflight answers."""

from __future__ import annotations

import hmac

from .errors import HTTPError
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
            f"Host {header!r} is not allowed (DNS rebinding protection); "
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
            f"Origin {origin!r} is not allowed; start the server with --cors-origin {origin} to allow it",
            code="origin_not_allowed",
        )


def check_api_key(settings: ServerSettings, exchange: Exchange) -> None:
    key = settings.api_key
    if key is None:
        return
    scheme, _, token = exchange.headers.get("authorization", "").strip().partition(" ")
    given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
    if not hmac.compare_digest(given, key.encode()):
        raise HTTPError(
            401,
            "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
            code="invalid_api_key",
            headers=[("www-authenticate", "Bearer")],
        )


async def preflight(exchange: Exchange) -> None:
    requested = exchange.headers.get("access-control-request-headers", "authorization, content-type")
    headers = [("allow", "GET, POST, OPTIONS"), ("content-length", "0")]
    if exchange.cors_headers:
        headers += [
            ("access-control-allow-methods", "GET, POST, OPTIONS"),
            ("access-control-allow-headers", requested),
            ("access-control-max-age", "600"),
        ]
    await exchange.start(204, headers)
    await exchange.body(b"")
