"""OpenAI's Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}) on a real server
over the tiny pair, talked to with the official `openai` client and the OpenAI Agents SDK; every
body and stream event is checked against the SDK's own types (strict pydantic validation), and
streams are also parsed by the SDK's own stream reader."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from .agent_apis import FINISHING_SCHEMA, GREEDY, KEY, MODEL, WEATHER_SCHEMA, post_events

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
TOOL_TOKENS = 200  # the tiny vocabulary spells the call's markers out, character by character
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather",
    "parameters": WEATHER_SCHEMA,
}
FINISHING = {"format": {"type": "json_schema", "name": "answer", "schema": FINISHING_SCHEMA, "strict": True}}


@pytest.fixture
def client(agent_server):
    return openai.OpenAI(base_url=f"{agent_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(agent_server):
    with httpx.Client(
        base_url=agent_server.url, headers={"authorization": f"Bearer {KEY}"}, timeout=60
    ) as http:
        yield http


def body(**extra) -> dict:
    return {"model": MODEL, "input": "the water is hot and", "max_output_tokens": 6, **GREEDY, **extra}


def sdk(**extra) -> dict:
    fields = body(**extra)
    return {**{k: v for k, v in fields.items() if k not in GREEDY}, "extra_body": GREEDY}


def stream_events(http, **extra) -> list[dict]:
    response, events = post_events(http, "/v1/responses", body(stream=True, **extra))
    assert response.status_code == 200, response.text
    for name, data in events:
        assert name == data["type"]
        EVENTS.validate_python(data)
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(events)))
    return [data for _, data in events]


def post(http, **extra) -> Response:
    response = http.post("/v1/responses", json=body(**extra))
    assert response.status_code == 200, response.text
    return Response.model_validate(response.json())


def test_a_response_has_openais_shape_usage_and_our_statistics(http):
    response = post(http)
    assert response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output_text
    usage = response.usage
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + 6
    assert response.model_extra["speculative"]["method"]  # the statistics ride along


def test_a_finished_reply_is_completed(http, client):
    response = post(http, text=FINISHING, max_output_tokens=TOOL_TOKENS)
    assert response.status == "completed" and set(json.loads(response.output_text)) == {"ok"}
    with client.responses.stream(**sdk(text=FINISHING, max_output_tokens=TOOL_TOKENS)) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text == response.output_text


def test_a_stream_comes_in_the_responses_order(http):
    events = stream_events(http, text=FINISHING, max_output_tokens=TOOL_TOKENS)
    kinds = [event["type"] for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    completed = events[-1]["response"]
    assert completed["usage"]["output_tokens"] > 0 and completed["status"] == "completed"
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert events[-4]["text"] == text == completed["output"][0]["content"][0]["text"]


def test_a_reply_cut_by_max_output_tokens_ends_incomplete(http):
    events = stream_events(http)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_forced_function_call_is_a_function_call_item(http, client):
    tools = {"tools": [WEATHER], "tool_choice": "required", "max_output_tokens": TOOL_TOKENS}
    response = post(http, **tools)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo") and response.status == "completed"
    events = stream_events(http, **tools)
    kinds = [event["type"] for event in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(event for event in events if event["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == call.arguments
    with client.responses.stream(**sdk(**tools)) as stream:
        final = stream.get_final_response()
    assert final.output[0].arguments == call.arguments


def test_previous_response_id_continues_a_stored_conversation(http, client):
    # Instructions are not carried over (as OpenAI's): a client sends them again, as the Agents SDK does.
    first = client.responses.create(**sdk(instructions="be brief"))
    second = client.responses.create(
        **sdk(instructions="be brief", input="and then", previous_response_id=first.id)
    )
    # The second prompt holds the whole first exchange, and its prompt came back from the cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_an_unknown_or_unstored_previous_response_is_a_400_never_an_empty_reply(http):
    unstored = post(http, store=False)
    for response_id in ("resp_never", unstored.id):
        response = http.post("/v1/responses", json=body(previous_response_id=response_id))
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "previous_response_id"
        assert response_id in response.json()["error"]["message"]


def test_a_history_repeated_beside_previous_response_id_is_refused(http):
    first = post(http, input=[{"type": "message", "id": "msg_1", "role": "user", "content": "the water"}])
    repeated = [{"type": "message", "id": "msg_1", "role": "user", "content": "the water"}, "and"]
    repeated[1] = {"role": "user", "content": "and"}
    response = http.post("/v1/responses", json=body(input=repeated, previous_response_id=first.id))
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"


def test_stored_responses_can_be_fetched_and_deleted(http, client):
    created = client.responses.create(**sdk())
    assert client.responses.retrieve(created.id).id == created.id
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    assert http.delete(f"/v1/responses/{created.id}").status_code == 404


def test_tools_that_are_not_functions_are_left_out_and_named(http):
    tools = [
        WEATHER,
        {"type": "web_search", "external_web_access": False},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [WEATHER]},
        {
            "type": "custom",
            "name": "apply_patch",
            "format": {"type": "grammar", "syntax": "lark", "definition": "x"},
        },
    ]
    response = http.post("/v1/responses", json=body(tools=tools))
    assert response.status_code == 200
    assert response.headers["x-cactus-edge-skipped-tools"] == "web_search, multi_agent_v1, apply_patch"
    named = http.post("/v1/responses", json=body(tools=tools, tool_choice={"type": "web_search"}))
    assert named.status_code == 400 and named.json()["error"]["param"] == "tool_choice"


def test_a_codex_style_conversation_with_a_tool_output_runs(http):
    """Developer messages instead of instructions, item ids, a call and its output, reasoning."""
    items = [
        {
            "type": "message",
            "id": "msg_a",
            "role": "developer",
            "content": [{"type": "input_text", "text": "help"}],
        },
        {
            "type": "message",
            "id": "msg_b",
            "role": "user",
            "content": [{"type": "input_text", "text": "echo hi"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xyz"},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": "{}",
        },
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "hi"},
    ]
    extra = {"store": False, "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}}
    response = post(http, input=items, tools=[WEATHER], prompt_cache_key="session-1", **extra)
    assert response.output and response.usage.input_tokens > 10


@pytest.mark.parametrize(
    "change, param",
    [
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "a"}]},
         "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "hologram"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": 5}, "input"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"background": True}, "background"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field_and_the_server_keeps_serving(http, change, param):
    response = http.post("/v1/responses", json=body(**change))
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert http.post("/v1/responses", json=body()).status_code == 200


def test_a_prompt_longer_than_the_context_is_a_400(http):
    response = http.post("/v1/responses", json=body(input="the water is hot and " * 200))
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def failing_decode(monkeypatch, engine, at_call: int = 3):
    """The target's decode raises on its ``at_call``-th call: after the prompt and a step, so the
    stream has begun."""
    real, calls = engine.target.decode, []

    def decode(tokens, output_rows=(-1,), *, copy=True):
        calls.append(1)
        if len(calls) == at_call:
            raise RuntimeError("secret internal detail")
        return real(tokens, output_rows, copy=copy)

    monkeypatch.setattr(engine.target, "decode", decode)


def test_a_generation_that_fails_mid_stream_ends_with_error_and_response_failed(
    http, agent_server, monkeypatch
):
    failing_decode(monkeypatch, agent_server.app.engine)
    events = stream_events(http, max_output_tokens=40, speculative={"method": "none"})
    kinds = [event["type"] for event in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert kinds[-2:] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert events[-2]["code"] == "internal"  # ours, in the error event
    assert "secret" not in json.dumps(events)  # the details stay in the server's log
    monkeypatch.undo()
    assert http.post("/v1/responses", json=body()).status_code == 200
