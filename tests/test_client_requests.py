"""What the client libraries apps are built on really send, replayed against `cactus-edge serve`.

tests/fixtures/clients/ holds request bodies recorded from instructor, LangChain, pydantic-ai, the
OpenAI Agents SDK (over chat completions) and simonw's `llm`, each run for real against the server
with the default pair (the library versions are in each file). Here every body is sent as recorded,
over loopback with httpx, to a server on SmolLM2 135M (a real instruct model, small enough for CI:
its strings end, so a reply finishes within the cap) drafting for itself, with two changes: a seed,
so each reply is the same on every run, and a cap on the reply's length. The answers must have the
shapes the libraries parse: OpenAI's types validate them, a schema's reply is JSON, a required call
is a call, a stream is chunks then [DONE].
"""

import json
from pathlib import Path

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

pytestmark = pytest.mark.slow

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "clients").glob("*.json"))
WAIT = 120
MAX_TOKENS = 200


def replayed(body: dict) -> dict:
    """The recorded body with a seed and a length cap (the recorded one if smaller)."""
    body = {**body, "seed": 0}
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body:
            body[key] = min(body[key], MAX_TOKENS)
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    return body


def stream_chunks(response: httpx.Response) -> list[ChatCompletionChunk]:
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [ChatCompletionChunk.model_validate(json.loads(event)) for event in events[:-1]]


def check_tools(body: dict, message, finish: str) -> None:
    """A required or named tool choice gets calls whose arguments are JSON objects."""
    required = body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict)
    if required and finish != "length":
        assert message.tool_calls and finish == "tool_calls"
    for call in message.tool_calls or ():
        assert isinstance(json.loads(call.function.arguments), dict)
        assert call.function.name in {tool["function"]["name"] for tool in body.get("tools", ())}


def check_schema(body: dict, content: str | None, finish: str) -> None:
    """A reply under response_format is JSON (when not cut by the length cap)."""
    if body.get("response_format", {}).get("type") in ("json_schema", "json_object") and finish == "stop":
        assert isinstance(json.loads(content), dict), content


@pytest.mark.parametrize("fixture", FIXTURES, ids=[path.stem for path in FIXTURES])
def test_each_recorded_request_gets_the_shape_its_library_parses(smollm2_server, fixture):
    recorded = json.loads(fixture.read_text())
    assert recorded["requests"], fixture
    with httpx.Client(base_url=smollm2_server.url, timeout=WAIT) as http:
        for request in recorded["requests"]:
            body = replayed(request["body"])
            headers = {key: value for key, value in request["headers"].items() if key != "user-agent"}
            response = http.post(request["path"], json=body, headers=headers)
            assert response.status_code == 200, response.text[:500]
            if body.get("stream"):
                chunks = stream_chunks(response)
                finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
                if body.get("stream_options", {}).get("include_usage"):  # OpenAI's usage chunk: no choices
                    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                check_schema(body, content, finish)
            else:
                completion = ChatCompletion.model_validate(response.json())
                choice = completion.choices[0]
                check_tools(body, choice.message, choice.finish_reason)
                check_schema(body, choice.message.content, choice.finish_reason)


def test_the_fixtures_cover_every_library_and_shape():
    """Structured output, tools, tool results and streams, from each library."""
    bodies = [r["body"] for path in FIXTURES for r in json.loads(path.read_text())["requests"]]
    libraries = {path.stem.split("-")[0] for path in FIXTURES}
    assert libraries >= {"instructor", "langchain", "pydantic", "agents", "llm"}
    assert any(b.get("response_format", {}).get("type") == "json_schema" for b in bodies)
    assert any(b.get("tool_choice") == "required" or isinstance(b.get("tool_choice"), dict) for b in bodies)
    assert any(m.get("role") == "tool" for b in bodies for m in b["messages"])  # a tool result turn
    assert any(b.get("stream") and b.get("tools") for b in bodies)
