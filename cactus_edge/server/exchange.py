"""One HTTP request/response over ASGI, with helpers to send JSON, text and errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

from .errors import HTTPError

# A refused request's body is read and dropped before the answer when it is this small and arrives
# this fast: closing a socket that still holds unread bytes makes the kernel reset the connection,
# and the client may lose the answer with it. A larger or slower body is not waited for.
DRAIN_MAX_BYTES = 64 * 1024
DRAIN_SECONDS = 0.5


class Exchange:
    """One HTTP request/response: the scope, the ASGI callables, and what was sent."""

    def __init__(self, scope, receive, send, cors_headers: list[tuple[bytes, bytes]]) -> None:
        self.scope, self._receive, self._send = scope, receive, send
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.cors_headers = cors_headers
        self.status: int | None = None
        self.started = False
        self.error_shape = HTTPError.body  # how an error looks on this route (Anthropic's differ)
        self.body_read = not self._has_body()

    def _has_body(self) -> bool:
        return self.headers.get("content-length", "0") != "0" or "transfer-encoding" in self.headers

    async def receive(self) -> dict:
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_read = True
        return message

    async def start(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        self.status, self.started = status, True
        if not self.body_read:
            # Answered without reading the body (refused early): close, or uvicorn would go on
            # reading it, up to the body timeout, only to throw it away.
            headers = [*headers, ("connection", "close")]
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers] + self.cors_headers
        await self._send({"type": "http.response.start", "status": status, "headers": raw})

    async def body(self, data: bytes, more: bool = False) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def send_json(self, status: int, body: Any, headers: Sequence[tuple[str, str]] = ()) -> None:
        data = json.dumps(body).encode()
        await self.start(
            status,
            [("content-type", "application/json"), ("content-length", str(len(data))), *headers],
        )
        await self.body(data)

    async def send_text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode()
        await self.start(status, [("content-type", content_type), ("content-length", str(len(data)))])
        await self.body(data)

    async def send_error(self, error: HTTPError) -> None:
        await self.drain_small_body()
        await self.send_json(error.status, self.error_shape(error), error.headers)

    async def drain_small_body(self) -> None:
        """Read and drop an unread body of at most DRAIN_MAX_BYTES declared bytes, for at most
        DRAIN_SECONDS (see DRAIN_MAX_BYTES)."""
        length = self.headers.get("content-length", "")
        if self.body_read or not length.isdigit() or int(length) > DRAIN_MAX_BYTES:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drain(), DRAIN_SECONDS)

    async def _drain(self) -> None:
        while not self.body_read:
            if (await self.receive())["type"] == "http.disconnect":
                return
