"""Structured output, tool calls, logprobs and penalties as apps reach them: the real `openai`
client over loopback against `cactus-edge serve` on the tiny pair (random weights: the grammar,
not the model, makes the answers valid)."""

import asyncio
import json

import openai
import pydantic
import pytest

from cactus_edge.server import ServerSettings, create_server

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "the water is hot and"}]
SPEC = {"speculative": {"method": "sps", "n_draft": 3}}
WAIT = 120


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int
    admin: bool


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def server(engine):
    server = create_server(engine, ServerSettings(port=0, api_key=KEY, model_name="tiny"))
    server.start()
    yield server
    assert server.stop(timeout=WAIT)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=WAIT, max_retries=0)


def test_parse_with_a_pydantic_model(client):
    completion = client.beta.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Person, max_tokens=200, seed=0, extra_body=SPEC
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    person = choice.message.parsed
    assert isinstance(person, Person) and len(person.name) <= 6


def test_json_object_is_a_json_object(client):
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
        extra_body=SPEC,
    )
    text = completion.choices[0].message.content
    assert text.lstrip().startswith("{")
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_required_or_named_tool_call_always_parses_and_validates(client, tool_choice):
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=120,
        seed=1,
        extra_body=SPEC,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city"} and len(arguments["city"]) <= 8
    assert not choice.message.content


def test_tool_choice_none_shows_the_tools_and_answers_in_content(client):
    def ask(**tools):
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, seed=4, **tools)

    auto = ask(tools=[WEATHER, TIME])
    none = ask(tools=[WEATHER, TIME], tool_choice="none")
    # The same prompt as with "auto" (the tiny template shows no tools; Qwen's do), no call parsed.
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens
    choice = none.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content


def test_a_streamed_tool_call_assembles_into_the_same_shape(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        seed=2,
        stream=True,
        extra_body=SPEC,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for fragment in delta.tool_calls or []:
            call = calls.setdefault(fragment.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = fragment.id or call["id"]
            if fragment.function is not None:
                call["name"] = fragment.function.name or call["name"]
                call["arguments"] += fragment.function.arguments or ""
        assert not delta.content, "tool-call markup leaked into the content"
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert "city" in json.loads(calls[0]["arguments"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_dropped_not_left_in_content(client, stream):
    """A required call cut short: finish_reason length, no call, and none of its markup in the
    content (the unfinished call is neither), streamed or whole."""
    settings = dict(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="required", seed=2)
    cut = client.chat.completions.create(**settings, max_tokens=6, stream=stream, extra_body=SPEC)
    if stream:
        chunks = [chunk.choices[0] for chunk in cut if chunk.choices]
        content = "".join(choice.delta.content or "" for choice in chunks)
        calls = [fragment for choice in chunks for fragment in choice.delta.tool_calls or []]
        finish = chunks[-1].finish_reason
    else:
        message, finish = cut.choices[0].message, cut.choices[0].finish_reason
        content, calls = message.content, message.tool_calls or []
    assert finish == "length" and calls == [] and content == ""
    whole = client.chat.completions.create(**settings, max_tokens=120, extra_body=SPEC)
    assert whole.choices[0].finish_reason == "tool_calls"  # the same call, let finish


def test_the_engine_checks_a_request_off_the_event_loop(server, client, monkeypatch):
    """Engine.check_request compiles a new grammar (seconds for a big schema, more on the first
    with the tokenizer index): it must not run on the loop that serves every other stream."""
    engine, on_the_loop = server.app.engine, []
    check = engine.check_request

    def recording_check(prompt_tokens, config):
        try:
            asyncio.get_running_loop()
            on_the_loop.append(True)
        except RuntimeError:  # no loop runs in this thread
            on_the_loop.append(False)
        return check(prompt_tokens, config)

    monkeypatch.setattr(engine, "check_request", recording_check)
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=schema, max_tokens=8, extra_body=SPEC
    )
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert on_the_loop and not any(on_the_loop)  # the admission check, then stream()'s own


def test_a_tool_result_round_trip_renders_and_answers(client):
    first = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=120, seed=3
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=8, seed=3
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_logprobs_come_back_in_openais_shape(client):
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=SPEC,
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_an_invalid_schema_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
    assert caught.value.body["param"] == "response_format"


def test_penalties_are_accepted_and_change_the_output(client):
    settings = {"model": "tiny", "messages": MESSAGES, "max_tokens": 20, "temperature": 0, "extra_body": SPEC}
    plain = client.chat.completions.create(**settings).choices[0].message.content
    penalised = client.chat.completions.create(**settings, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].message.content != plain
