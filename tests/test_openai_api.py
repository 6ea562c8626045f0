"""The OpenAI layer (cactus_edge.openai_api) without a model: request parsing, messages and
prompts, error names, and the facade's response shapes over a fake engine. That the facade and the
HTTP server answer in the same shapes is tests/test_server.py's (one real generation through both)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.events import StreamEvent
from cactus_edge.engine.stats import GenerationStats
from cactus_edge.errors import InvalidSettingError, UnsupportedParameterError
from cactus_edge.openai_api import (
    NEUTRAL_ONLY,
    SETTINGS,
    SPECULATIVE_KEYS,
    ParsedRequest,
    ResponseShape,
    chat_messages,
    completion_prompt,
    create_chat_completion,
    parse_request,
)
from cactus_edge.openai_api.replies import Reply
from cactus_edge.openai_api.requests import config_for_vocabulary

MESSAGES = [{"role": "user", "content": "hello"}]


class FakeEngine:
    """Duck-typed Engine: replays fixed texts, then a final event; records what it was asked.
    ``refuse``: an error its request check raises, as Engine.stream_chat does before any event."""

    def __init__(self, texts=("Hel", "", "lo"), finish="length", refuse=None):
        self.texts, self.finish, self.refuse = texts, finish, refuse
        self.calls: list[tuple[list, GenerationConfig]] = []
        self.stats = GenerationStats(
            method="cactus",
            lossy=True,
            n_tokens=len(texts),
            n_prompt_tokens=7,
            n_prompt_decoded=5,
            n_verifier_calls=2,
            n_accepted=1,
        )

    def stream_chat(self, messages, config, cancel=None, tools=None):
        if self.refuse is not None:
            raise self.refuse
        self.calls.append((messages, config))
        return self._events()

    def _events(self):
        for index, text in enumerate(self.texts):
            yield StreamEvent(text, token=index, stats=self.stats)
        self.stats.finish_reason = self.finish
        yield StreamEvent("", None, finish_reason=self.finish, stats=self.stats)


# --- parse_request: used settings ----------------------------------------------------------------


def test_empty_request_gives_the_defaults():
    assert parse_request({}) == ParsedRequest(config=GenerationConfig())


def test_openai_settings_reach_the_config():
    request = parse_request(
        {
            "model": "qwen",
            "messages": MESSAGES,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "min_p": 0.1,
            "seed": 42,
            "stop": ["\n", "END"],
            "max_tokens": 9,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    config = request.config
    assert (config.temperature, config.top_p, config.top_k, config.min_p) == (0, 0.5, 3, 0.1)
    assert (config.seed, config.stop, config.max_tokens) == (42, ("\n", "END"), 9)
    assert (request.stream, request.include_usage, request.model) == (True, True, "qwen")
    assert request.ignored == ()  # messages is the caller's, not an ignored field


def test_stop_may_be_one_string():
    assert parse_request({"stop": "END"}).config.stop == ("END",)


@pytest.mark.parametrize(
    "body", [{"max_tokens": 5}, {"max_completion_tokens": 5}, {"max_tokens": 5, "max_completion_tokens": 5}]
)
def test_both_names_of_max_tokens(body):
    assert parse_request(body).config.max_tokens == 5


def test_disagreeing_max_tokens_are_refused():
    with pytest.raises(InvalidSettingError) as caught:
        parse_request({"max_tokens": 5, "max_completion_tokens": 6})
    assert caught.value.param == "max_completion_tokens"


def test_null_means_the_default():
    body = {name: None for name in (*SETTINGS, *NEUTRAL_ONLY)}
    assert parse_request(body).config == GenerationConfig()


def test_base_config_supplies_the_defaults():
    base = GenerationConfig(method="sps", max_tokens=99, temperature=0.2)
    config = parse_request({"temperature": 0.7}, base=base).config
    assert (config.method, config.max_tokens, config.temperature) == ("sps", 99, 0.7)


def test_negative_seed_is_folded_not_refused():
    # OpenAI allows any int64 seed; numpy's generator wants a non-negative one.
    assert parse_request({"seed": -1}).config.seed == 2**64 - 1


def test_speculative_extension():
    speculative = {
        "method": "tas",
        "delta": 0.5,
        "n_draft": 4,
        "drafter": "lookup",
        "draft_p_min": 0.1,
        "kl_budget": 3.0,
        "posterior_threshold": 0.2,
        "posterior_alpha": 0.5,
    }
    config = parse_request({"speculative": speculative}).config
    assert {key: getattr(config, key) for key in SPECULATIVE_KEYS} == speculative


# --- parse_request: accepted and ignored ---------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 1),
        ("best_of", 1),
        ("presence_penalty", 0),
        ("frequency_penalty", 0.0),
        ("repeat_penalty", 1.0),
        ("mirostat_mode", 0),
        ("logit_bias", {}),
        ("logprobs", False),
        ("top_logprobs", 0),
        ("echo", False),
        ("suffix", ""),
        ("tools", []),
        ("functions", []),
        ("tool_choice", "none"),
        ("function_call", "none"),
        ("response_format", {"type": "text"}),
        ("modalities", ["text"]),
        ("stream_options", {"include_usage": False, "include_obfuscation": True}),
    ],
)
def test_neutral_values_are_accepted(field, value):
    request = parse_request({field: value})
    assert request.config == GenerationConfig()
    assert request.ignored == ()


@pytest.mark.parametrize(
    "field, value",
    [
        ("user", "someone"),
        ("metadata", {"k": "v"}),
        ("store", True),
        ("service_tier", "auto"),
        ("some_future_field", [1, 2]),
        ("method", "sps"),  # the extension lives under "speculative", not at the top level
    ],
)
def test_harmless_fields_are_ignored_and_reported(field, value):
    request = parse_request({field: value, "messages": MESSAGES})
    assert request.config == GenerationConfig()
    assert request.ignored == (field,)


def test_the_prompt_cache_key_reaches_the_engine_and_is_checked():
    request = parse_request({"prompt_cache_key": "user-1", "messages": MESSAGES})
    assert request.config.cache_key == "user-1" and request.ignored == ()
    with pytest.raises(InvalidSettingError) as raised:
        parse_request({"prompt_cache_key": 5, "messages": MESSAGES})
    assert raised.value.param == "prompt_cache_key"


@pytest.mark.parametrize(
    "body, changes",
    [
        (
            {"presence_penalty": 0.5, "frequency_penalty": -1},
            {"presence_penalty": 0.5, "frequency_penalty": -1},
        ),
        ({"repeat_penalty": 1.1, "repeat_last_n": 32}, {"repeat_penalty": 1.1, "repeat_last_n": 32}),
        ({"logit_bias": {"50": -100}}, {"logit_bias": {50: -100}}),
        ({"logprobs": True, "top_logprobs": 2}, {"logprobs": True, "top_logprobs": 2}),
        ({"logprobs": 0}, {"logprobs": True}),  # completions' count: 0 still returns log-probabilities
        ({"logprobs": 3}, {"logprobs": True, "top_logprobs": 3}),
        ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "array"}},
                }
            },
            {"json_schema": {"type": "array"}},
        ),
        ({"grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
        ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ],
)
def test_constraints_penalties_and_logprobs_reach_the_config(body, changes):
    assert parse_request(body).config == GenerationConfig(**changes)


def test_tools_with_required_constrain_the_whole_reply_and_auto_after_the_trigger():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    required = parse_request({"tools": tools, "tool_choice": "required"})
    assert required.tools.names == ("f",) and required.config.grammar and not required.config.grammar_trigger
    auto = parse_request({"tools": tools})
    assert auto.config.grammar_trigger == "<tool_call>"
    none = parse_request({"tools": tools, "tool_choice": "none"})
    assert none.tools.tools == tuple(tools) and not none.tools.calls_allowed  # rendered, never parsed
    assert none.config.grammar is None and none.config.grammar_trigger is None


class _MarkerEngine:
    """Just enough engine for config_for_vocabulary: a target whose vocabulary spells the call
    marker in ``marker_ids``."""

    def __init__(self, marker_ids):
        self.target = type("Target", (), {"tokenize": lambda _self, text, **_: list(marker_ids)})()


def test_with_tool_choice_none_a_call_in_the_text_stays_content():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    bodies = {}
    for choice in ("none", "auto"):
        reply = Reply(
            ResponseShape.new(chat=True, model="m"),
            parse_request({"tools": tools, "tool_choice": choice}).tools,
        )
        final = StreamEvent(text, None, False, 0, "stop", GenerationStats(method="none", lossy=False))
        bodies[choice] = reply.complete(final, {})
    none, auto = (bodies[c]["choices"][0] for c in ("none", "auto"))
    assert none["message"]["content"] == text and "tool_calls" not in none["message"]
    assert none["finish_reason"] == "stop"
    assert (
        auto["finish_reason"] == "tool_calls" and auto["message"]["tool_calls"][0]["function"]["name"] == "f"
    )


@pytest.mark.parametrize(("finish", "dropped"), [("length", True), ("stop-string", True), ("stop", False)])
@pytest.mark.parametrize("stream", [False, True])
def test_an_unfinished_call_is_dropped_when_the_generation_was_cut(finish, dropped, stream):
    """With tool_choice auto, a call cut by max_tokens (or a stop string) is dropped, the calls
    before it kept; one the model itself ended on stays content, as written."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    done = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
    text = done + '<tool_call>\n{"name": "f", "arguments": {"x": '
    reply = Reply(ResponseShape.new(chat=True, model="m"), parse_request({"tools": tools}).tools)
    final = StreamEvent("", None, False, 0, finish, GenerationStats(method="none", lossy=False))
    if stream:
        chunks = reply.add(StreamEvent(text, 1)) + reply.finish(final, {"usage": {}})
        deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk.get("choices")]
        content = "".join(delta.get("content") or "" for delta in deltas)
        n_calls = sum(1 for delta in deltas for call in delta.get("tool_calls", []) if call.get("id"))
    else:
        reply.add_quietly(StreamEvent(text, 1))
        message = reply.complete(final, {})["choices"][0]["message"]
        content, n_calls = message["content"] or "", len(message.get("tool_calls", []))
    assert n_calls == 1
    assert content == ("" if dropped else '<tool_call>\n{"name": "f", "arguments": {"x":')


def test_tool_choice_none_bans_a_one_token_call_marker_over_the_callers_bias():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = parse_request({"tools": tools, "tool_choice": "none", "logit_bias": {"7": 50, "3": 2}})
    config = config_for_vocabulary(request, _MarkerEngine([7]))
    assert dict(config.logit_bias) == {7: -100.0, 3: 2.0}
    assert config.grammar is None
    spelled_out = config_for_vocabulary(request, _MarkerEngine([1, 2, 3]))
    assert spelled_out == request.config  # nothing to ban: the text stays all content


# --- parse_request: refused ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"mirostat_mode": 2}, "mirostat_mode"),
        ({"echo": True}, "echo"),
        ({"suffix": "}"}, "suffix"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"speculative": {"foo": 1}}, "speculative.foo"),
    ],
)
def test_meaning_changing_values_are_refused_by_name(body, param):
    with pytest.raises(UnsupportedParameterError) as caught:
        parse_request(body)
    assert caught.value.param == param
    assert param in str(caught.value)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": "1"}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"seed": "7"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_completion_tokens": 2.0}, "max_completion_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": True}, "stream_options"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"model": 3}, "model"),
        ({"n": 0}, "n"),
        ({"n": "1"}, "n"),
        ({"logprobs": "no"}, "logprobs"),
        ({"logprobs": 9}, "logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "missing"}}, "tools": []}, "tool_choice"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"logit_bias": []}, "logit_bias"),
        ({"tools": {}}, "tools"),
        ({"presence_penalty": "0"}, "presence_penalty"),
        ({"speculative": "fast"}, "speculative"),
        ({"speculative": {"method": "magic"}}, "speculative.method"),
        ({"speculative": {"method": 1}}, "speculative.method"),
        ({"speculative": {"delta": -0.1}}, "speculative.delta"),
        ({"speculative": {"delta": "big"}}, "speculative.delta"),
        ({"speculative": {"n_draft": "many"}}, "speculative.n_draft"),
        ({"speculative": {"n_draft": 1000}}, "speculative.n_draft"),
        ({"speculative": {"drafter": "oracle"}}, "speculative.drafter"),
        ({"speculative": {"draft_p_min": 1}}, "speculative.draft_p_min"),
    ],
)
def test_wrong_values_are_invalid_settings_by_name(body, param):
    with pytest.raises(InvalidSettingError) as caught:
        parse_request(body)
    assert not isinstance(caught.value, UnsupportedParameterError)
    assert caught.value.param == param


def test_body_must_be_an_object():
    with pytest.raises(InvalidSettingError):
        parse_request(["not", "a", "dict"])


ODD_VALUES = [True, False, 0, 1, -1, 2.5, math.nan, math.inf, 10**30, "", "x", [], ["x"], [1], {}, {"a": 1}]


@pytest.mark.parametrize("field", [*SETTINGS, *NEUTRAL_ONLY, "speculative.*", "stream_options.*"])
def test_no_value_raises_anything_but_a_named_setting_error(field):
    for value in ODD_VALUES:
        if field.endswith(".*"):
            outer = field[:-2]
            keys = SPECULATIVE_KEYS if outer == "speculative" else ("include_usage",)
            bodies = [{outer: {key: value}} for key in keys]
        else:
            bodies = [{field: value}]
        for body in bodies:
            try:
                parse_request(body)
            except InvalidSettingError as error:  # anything else (TypeError …) fails the test
                assert error.param, f"{body!r} raised without naming the parameter: {error}"


# --- messages and prompts ----------------------------------------------------------------------


def test_chat_messages_as_the_template_takes_them():
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": None}]
    assert chat_messages(messages) == [
        {"role": "system", "content": "be brief"},  # OpenAI's newer name for the system role
        {"role": "user", "content": ""},
    ]
    assert chat_messages(MESSAGES, "sys")[0] == {"role": "system", "content": "sys"}
    assert chat_messages(messages, "sys")[0]["content"] == "be brief"  # a system message is kept


@pytest.mark.parametrize("messages", [None, [], "hello", [{"content": "no role"}], [3]])
def test_chat_messages_that_are_not_messages_name_messages(messages):
    with pytest.raises(InvalidSettingError) as caught:
        chat_messages(messages)
    assert caught.value.param == "messages"


@pytest.mark.parametrize(
    "prompt, expected",
    [("hi", "hi"), (["hi"], "hi"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2]), ([10**9], [10**9])],
)
def test_completion_prompts(prompt, expected):
    assert completion_prompt(prompt) == expected  # whether ids exist is Engine.check_request's


@pytest.mark.parametrize(
    "prompt, error",
    [
        ("", InvalidSettingError),
        (5, InvalidSettingError),
        ([], InvalidSettingError),
        ([1, True], InvalidSettingError),
        (["a", "b"], UnsupportedParameterError),
    ],
)
def test_completion_prompts_refused_name_prompt(prompt, error):
    with pytest.raises(error) as caught:
        completion_prompt(prompt)
    assert caught.value.param == "prompt"


# --- the facade over a fake engine ----------------------------------------------------------------


def test_completion_shape():
    engine = FakeEngine()
    completion = create_chat_completion(engine, MESSAGES, stream=False, model="m", max_tokens=3)
    assert completion["object"] == "chat.completion"
    assert completion["id"].startswith("chatcmpl-")
    assert completion["model"] == "m"
    assert completion["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert completion["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    speculative = completion["speculative"]
    assert speculative["acceptance_length"] == 0.5 and speculative["lossless"] is False
    assert (speculative["n_draft"], speculative["delta"]) == ("auto", 1.0)  # the config's
    assert completion["timings"]["cache_n"] == 2 and completion["stats"]["time_to_first_token"] >= 0
    assert engine.calls == [(MESSAGES, GenerationConfig(max_tokens=3))]


@pytest.mark.parametrize("finish", ["cancelled", "stop-string", "stop"])
def test_every_end_on_our_side_reads_as_stop(finish):
    completion = create_chat_completion(FakeEngine(finish=finish), MESSAGES, stream=False, model="m")
    assert completion["choices"][0]["finish_reason"] == "stop"  # OpenAI has no other name for them
    assert completion["stats"]["stop_reason"] == finish  # LM Studio's block says which


def test_stream_shape_without_usage():
    engine = FakeEngine()
    chunks = list(create_chat_completion(engine, MESSAGES, stream=True, model="m"))
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)
    assert all("usage" not in c for c in chunks[:-1])
    last = chunks[-1]
    assert last["usage"]["completion_tokens"] == 3  # every response carries usage
    assert {"timings", "stats", "speculative"} <= last.keys()


def test_stream_with_include_usage_ends_with_a_usage_chunk():
    chunks = list(
        create_chat_completion(
            FakeEngine(), MESSAGES, stream=True, model="m", stream_options={"include_usage": True}
        )
    )
    *body, last = chunks
    assert last["choices"] == []
    assert last["usage"]["total_tokens"] == 10 and {"timings", "stats", "speculative"} <= last.keys()
    assert all(c["usage"] is None for c in body)  # OpenAI: null on every earlier chunk
    assert body[-1]["choices"][0]["finish_reason"] == "length"


def test_closing_the_stream_closes_the_engine_stream():
    engine = FakeEngine(texts=("a", "b", "c"))
    closed, held = [], []

    def events():
        try:
            yield from FakeEngine._events(engine)
        finally:
            closed.append(True)

    def stream_chat(messages, config, cancel=None, tools=None):
        held.append(events())  # a reference elsewhere: closing must not wait for the collector
        return held[-1]

    engine.stream_chat = stream_chat
    chunks = create_chat_completion(engine, MESSAGES, stream=True, model="m")
    next(chunks), next(chunks)  # the role chunk, then "a"
    chunks.close()
    assert closed == [True]


def test_shapes_take_their_id_and_time():
    shape = ResponseShape(chat=True, model="m", include_usage=False, id="chatcmpl-1", created=7)
    assert shape.text_chunk("x") == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}],
    }
    fresh = ResponseShape.new(chat=False, model="m")
    assert fresh.id.startswith("cmpl-") and fresh.role_chunk() is None


def test_settings_are_parsed_like_a_request():
    engine = FakeEngine()
    create_chat_completion(
        engine,
        MESSAGES,
        stream=False,
        model="m",
        max_completion_tokens=4,
        stop=["x"],
        speculative={"method": "sps"},
        user="u",
        logit_bias={},
        some_future_field=1,
    )
    assert engine.calls[0][1] == GenerationConfig(max_tokens=4, stop=("x",), method="sps")


def test_flat_speculative_settings_still_work():
    engine = FakeEngine()
    create_chat_completion(
        engine, MESSAGES, stream=False, model="m", method="exact", n_draft=3, drafter="lookup"
    )
    assert engine.calls[0][1] == GenerationConfig(method="exact", n_draft=3, drafter="lookup")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "settings, error, param",
    [
        ({"n": 2}, UnsupportedParameterError, "n"),
        ({"functions": [{"name": "f"}]}, UnsupportedParameterError, "functions"),
        ({"temperature": "hot"}, InvalidSettingError, "temperature"),
        ({"method": "magic"}, InvalidSettingError, "speculative.method"),
    ],
)
def test_bad_settings_raise_before_the_engine_runs(stream, settings, error, param):
    engine = FakeEngine()
    with pytest.raises(error) as caught:
        create_chat_completion(engine, MESSAGES, stream=stream, model="m", **settings)
    assert caught.value.param == param
    assert engine.calls == []


@pytest.mark.parametrize(
    "param, openai_param",
    [("drafter", "speculative.drafter"), ("n_draft", "speculative.n_draft"), ("prompt", "messages")],
)
def test_the_engines_errors_name_the_request_field(param, openai_param):
    """Engine.check_request names GenerationConfig's field; the facade says the request's."""
    engine = FakeEngine(refuse=InvalidSettingError("refused", param=param))
    with pytest.raises(InvalidSettingError) as caught:
        create_chat_completion(engine, MESSAGES)
    assert caught.value.param == openai_param and str(caught.value) == "refused"


def test_importing_the_layer_loads_no_llama_cpp_and_no_engine():
    code = (
        "import cactus_edge.openai_api, sys; "
        "assert 'llama_cpp' not in sys.modules, 'llama_cpp loaded'; "
        "assert 'cactus_edge.engine.engine' not in sys.modules, 'engine loaded'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
