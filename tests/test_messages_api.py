"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on a real server over
the tiny pair, talked to with the official `anthropic` client; every body and stream event is
checked against the SDK's own types (strict pydantic validation), and streams are also parsed by
the SDK itself."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pydantic
import pytest
from anthropic.types import ErrorResponse, Message, MessageTokensCount, RawMessageStreamEvent

from .agent_apis import (
    FINISHING_SCHEMA,
    GREEDY,
    KEY,
    MODEL,
    WEATHER_SCHEMA,
    post_events,
)

USER = [{"role": "user", "content": "the water is hot and"}]
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
TOOL_TOKENS = 200  # the tiny vocabulary spells the call's markers out, character by character
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}


@pytest.fixture
def client(agent_server):
    return anthropic.Anthropic(base_url=agent_server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(agent_server):
    with httpx.Client(base_url=agent_server.url, headers={"x-api-key": KEY}, timeout=60) as http:
        yield http


def body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 6, "messages": USER, **GREEDY, **extra}


def sdk(**extra) -> dict:
    """body() as the SDK's keyword arguments (it takes no temperature: that goes as extra_body)."""
    fields = body(**extra)
    return {**{k: v for k, v in fields.items() if k not in GREEDY}, "extra_body": GREEDY}


def stream_events(http, **extra) -> list[dict]:
    response, events = post_events(http, "/v1/messages", body(stream=True, **extra))
    assert response.status_code == 200, response.text
    assert all(name == data["type"] for name, data in events)  # each event line names its data
    for _, data in events:
        if data["type"] == "error":  # the SDK's reader raises it as an APIError
            ErrorResponse.model_validate(data)
        elif data["type"] != "ping":  # not in the SDK's union of stream events: its reader skips it
            EVENTS.validate_python(data)
    return [data for _, data in events]


def test_a_message_has_anthropics_shape_and_our_statistics(http):
    response = http.post("/v1/messages", json=body())
    assert response.status_code == 200
    message = Message.model_validate(response.json())
    assert message.role == "assistant" and message.model == MODEL
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    assert message.content[0].type == "text" and message.content[0].text
    usage = response.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    assert response.json()["speculative"]["method"]  # the statistics ride along


def test_a_stream_comes_in_anthropics_order_and_the_sdk_reads_it(http, client):
    events = stream_events(http)
    kinds = [event["type"] for event in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    delta = events[-2]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 6
    with client.messages.stream(**sdk()) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"


def test_a_forced_tool_call_is_a_tool_use_block(http, client):
    tools = {
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "max_tokens": TOOL_TOKENS,
    }
    message = Message.model_validate(http.post("/v1/messages", json=body(**tools)).json())
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input["city"] in ("Paris", "Oslo") and message.stop_reason == "tool_use"
    events = stream_events(http, **tools)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [start["type"] for start in starts] == ["tool_use"]
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == block.input
    with client.messages.stream(**sdk(**tools)) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == block.input and final.stop_reason == "tool_use"


def test_a_tool_result_continues_the_conversation(client):
    conversation = [
        *USER,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold"},
                                     {"type": "text", "text": "and so"}]},
    ]  # fmt: skip
    message = client.messages.create(**sdk(messages=conversation, tools=[WEATHER]))
    assert message.content and message.usage.output_tokens > 0


def test_count_tokens_counts_what_the_message_would_run(http, client):
    counted = client.messages.count_tokens(model=MODEL, messages=USER, tools=[WEATHER], system="be brief")
    assert isinstance(counted, MessageTokensCount) and counted.input_tokens > 0
    usage = http.post("/v1/messages", json=body(tools=[WEATHER], system="be brief")).json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted.input_tokens


def test_the_billing_header_block_is_left_out_so_the_prompt_cache_holds(http, client):
    def system(text):
        billing = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=1; cch={text};"}
        cached = {"cache_control": {"type": "ephemeral"}}
        prompt = {"type": "text", "text": "You are a helpful assistant.", **cached}
        return [billing, prompt]

    plain = client.messages.count_tokens(model=MODEL, messages=USER, system="You are a helpful assistant.")
    assert client.messages.count_tokens(model=MODEL, messages=USER, system=system("a1")) == plain
    http.post("/v1/messages", json=body(system=system("a1")))
    again = http.post("/v1/messages", json=body(system=system("b2"))).json()["usage"]
    assert again["input_tokens"] == 1  # all but the last prompt token came from the cache


def test_a_stop_sequence_ends_the_reply_and_is_named(http):
    text = http.post("/v1/messages", json=body(max_tokens=12)).json()["content"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop in {text!r}"
    message = http.post("/v1/messages", json=body(max_tokens=12, stop_sequences=[stop])).json()
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == stop
    assert stop not in message["content"][0]["text"]
    delta = stream_events(http, max_tokens=12, stop_sequences=[stop])[-2]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_unknown_fields_and_beta_headers_are_accepted(http):
    extra = {
        "metadata": {"user_id": "u1"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []},
        "output_config": {"effort": "low"},
    }
    headers = {
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "anthropic-version": "2023-06-01",
    }
    response = http.post("/v1/messages?beta=true", json=body(**extra), headers=headers)
    assert response.status_code == 200 and Message.model_validate(response.json())


def test_anthropic_tools_that_are_not_custom_are_left_out_and_named(http):
    tools = [WEATHER, {"type": "web_search_20250305", "name": "web_search"}]
    response = http.post("/v1/messages", json=body(tools=tools))
    assert response.status_code == 200 and response.headers["x-cactus-edge-skipped-tools"] == "web_search"


def test_max_tokens_beyond_the_context_is_clamped_and_said(http):
    response = http.post("/v1/messages", json=body(max_tokens=100_000))
    assert response.status_code == 200
    assert response.headers["x-cactus-edge-max-tokens"].startswith("100000 clamped to ")


def anthropic_error(response: httpx.Response, status: int, kind: str = "invalid_request_error") -> str:
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    return error["error"]["message"]


@pytest.mark.parametrize(
    "change, named",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "hologram"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
         "messages[0].content[0].tool_use_id"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": "hi"}, "messages"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"temperature": "warm"}, "temperature"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_in_anthropics_shape_and_the_server_keeps_serving(http, change, named):
    request = {key: value for key, value in {**body(), **change}.items() if value is not None}
    assert named in anthropic_error(http.post("/v1/messages", json=request), 400)
    assert http.post("/v1/messages", json=body()).status_code == 200


def test_a_prompt_longer_than_the_context_is_a_400_the_sdk_does_not_retry(client, agent_server, caplog):
    long = [{"role": "user", "content": "the water is hot and " * 200}]
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic.Anthropic(base_url=agent_server.url, api_key=KEY, timeout=60).messages.create(
            **sdk(messages=long)
        )  # the SDK's default retries would retry a 5xx
    assert "prompt is too long" in str(raised.value)
    counted = client.messages.count_tokens(model=MODEL, messages=long)
    assert counted.input_tokens > 512  # counting a prompt that does not fit still answers
    needed = int(re.search(r"--n-ctx (\d+)", str(raised.value)).group(1))
    assert needed > counted.input_tokens  # the error says what context would hold it
    # and so does the server's log: agents show their own words for this error, not ours
    assert any(f"--n-ctx {needed}" in record.getMessage() for record in caplog.records)


def test_the_key_is_taken_from_x_api_key_and_a_wrong_one_is_refused(agent_server):
    with httpx.Client(base_url=agent_server.url, timeout=60) as http:
        wrong = http.post("/v1/messages", json=body(), headers={"x-api-key": "nope"})
        assert "API key" in anthropic_error(wrong, 401, "authentication_error")
        assert (
            http.post("/v1/messages", json=body(), headers={"authorization": f"Bearer {KEY}"}).status_code
            == 200
        )


def test_an_unknown_model_is_anthropics_not_found(http):
    anthropic_error(http.post("/v1/messages", json=body(model="claude-opus-4")), 404, "not_found_error")


def test_a_stream_cut_by_the_client_leaves_the_server_serving(http):
    with http.stream("POST", "/v1/messages", json=body(stream=True, max_tokens=200)) as response:
        next(response.iter_lines())
    assert http.post("/v1/messages", json=body()).status_code == 200


def test_structured_output_is_json_that_ends_the_turn(http):
    """output_config.format (what Claude Code's title requests send): the grammar closes the JSON
    and the reply ends there."""
    config = {"format": {"type": "json_schema", "schema": FINISHING_SCHEMA}, "effort": "low"}
    message = http.post("/v1/messages", json=body(max_tokens=TOOL_TOKENS, output_config=config)).json()
    assert message["stop_reason"] == "end_turn"
    assert set(json.loads(message["content"][0]["text"])) == {"ok"}


def test_system_messages_between_the_turns_join_the_conversation(http, client):
    """Claude Code sends role "system" messages inside messages[], as blocks or a string."""
    between = [*USER, {"role": "system", "content": [{"type": "text", "text": "be brief"}]}]
    counted = client.messages.count_tokens(model=MODEL, messages=between)
    plain = client.messages.count_tokens(model=MODEL, messages=USER)
    assert counted.input_tokens > plain.input_tokens
    assert http.post("/v1/messages", json=body(messages=between)).status_code == 200


def test_a_forced_call_with_a_closed_schema_finishes(http):
    tool = {"name": "answer", "input_schema": FINISHING_SCHEMA}
    message = http.post("/v1/messages", json=body(max_tokens=TOOL_TOKENS, tools=[tool],
                                                  tool_choice={"type": "any"})).json()  # fmt: skip
    assert message["stop_reason"] == "tool_use" and set(message["content"][-1]["input"]) == {"ok"}


def test_a_generation_that_fails_mid_stream_ends_with_an_error_event(http, agent_server, monkeypatch):
    from .test_responses_api import failing_decode

    failing_decode(monkeypatch, agent_server.app.engine)
    events = stream_events(http, max_tokens=40, speculative={"method": "none"})
    kinds = [event["type"] for event in events]
    assert kinds[0] == "message_start" and "content_block_delta" in kinds
    assert kinds[-1] == "error" and "message_stop" not in kinds
    assert events[-1]["error"]["type"] == "api_error" and "secret" not in json.dumps(events)
    monkeypatch.undo()
    assert http.post("/v1/messages", json=body()).status_code == 200
