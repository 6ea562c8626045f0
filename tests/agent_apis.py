"""What the tests of the agents' APIs (Messages, Responses) share (their server is
conftest's ``agent_server``): server-sent events read raw (``event:`` and ``data:`` lines), and
a tool whose arguments a tiny model can fill."""

from __future__ import annotations

import json

import httpx

KEY = "agent-key"
MODEL = "tiny"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
# A schema that makes any model finish: the grammar ends the reply after one boolean.
FINISHING_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0, "seed": 0}


def read_events(response: httpx.Response) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of each server-sent event, in order."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            text = line[len("data: ") :]
            events.append((name, text if text == "[DONE]" else json.loads(text)))
            name = None
    return events


def post_events(http: httpx.Client, path: str, body: dict, **headers) -> tuple[httpx.Response, list]:
    with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            return response, []
        return response, read_events(response)
