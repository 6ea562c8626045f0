"""Tool calls: request validation, the Hermes grammars (compiled and run by llguidance over a small
byte-level vocabulary with Qwen2.5's call markers as special tokens), and the reply parsers, whole
and streamed, against each other and against the openai client's own stream assembly."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from cactus_edge.constraints.tools import (
    ContentDelta,
    ToolCallDelta,
    ToolCallStream,
    parse_tool_calls,
    parse_tools,
)
from cactus_edge.errors import InvalidSettingError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"properties": {"q": {}}}}}
TOOLS = [WEATHER, SEARCH]
NAMES = ["get_weather", "search"]


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


# --- validation ---------------------------------------------------------------------------------


def test_no_tools_or_choice_none_means_nothing_to_do():
    assert parse_tools(None) is None
    assert parse_tools([]) is None
    assert parse_tools(None, "none") is None
    assert parse_tools(None, "auto") is None


def test_choice_none_keeps_the_tools_to_show_but_allows_no_call():
    setup = parse_tools(TOOLS, "none")
    assert setup.tools == tuple(TOOLS) and setup.choice == "none"
    assert not setup.calls_allowed and not setup.constrained


def test_a_setup_carries_the_functions_and_the_choice():
    setup = parse_tools(TOOLS, None, None)
    assert setup.names == ("get_weather", "search")
    assert (setup.choice, setup.forced_name, setup.parallel, setup.constrained) == ("auto", None, True, False)
    assert setup.tools == tuple(TOOLS)
    assert setup.functions[1].parameters == {"type": "object", "properties": {"q": {}}}
    assert parse_tools([tool(parameters={})]).functions[0].parameters == {"type": "object"}  # {}: an object
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "search"}}, False)
    assert (named.choice, named.forced_name, named.parallel, named.constrained) == (
        "function",
        "search",
        False,
        True,
    )
    assert parse_tools(TOOLS, "required").choice == "required"


def tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


UNKNOWN_FORMAT = {"type": "object", "properties": {"when": {"type": "string", "format": "someday"}}}
NAMED_SEARCH = {"type": "function", "function": {"name": "search"}}
INVALID_SETTINGS = [
    # (tools, tool_choice, parallel_tool_calls, param, message)
    ({"type": "function"}, None, None, "tools", "tools must be a list"),
    ([WEATHER, "search"], None, None, "tools", "tools[1] must be an object"),
    ([{"type": "retrieval"}], None, None, "tools", "tools[0].type must be 'function'"),
    ([WEATHER, {"type": "function"}], None, None, "tools", "tools[1].function must be an object"),
    ([WEATHER, tool(name=7)], None, None, "tools", "tools[1].function.name must be a string"),
    ([tool(name="get weather")], None, None, "tools", "tools[0].function.name 'get weather' must be"),
    ([tool(description=3)], None, None, "tools", "tools[0].function.description must be a string"),
    ([tool(strict="yes")], None, None, "tools", "tools[0].function.strict must be a boolean"),
    ([tool(parameters=[])], None, None, "tools", "tools[0].function.parameters must be a JSON schema"),
    ([tool(parameters={"type": "array"})], None, None, "tools", "parameters must describe an object"),
    (
        [tool(parameters=UNKNOWN_FORMAT)],
        None,
        None,
        "tools",
        "tools[0].function.parameters cannot be enforced",
    ),
    (
        [WEATHER, SEARCH, WEATHER],
        None,
        None,
        "tools",
        "tools[2].function.name 'get_weather' is defined twice",
    ),
    (TOOLS, "sometimes", None, "tool_choice", "tool_choice must be 'none', 'auto', 'required'"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice", "'nope' is not one of"),
    (
        TOOLS,
        {"type": "function", "name": "x"},
        None,
        "tool_choice",
        "tool_choice.function.name must be a string",
    ),
    (TOOLS, {"type": "allowed_tools"}, None, "tool_choice", "an object with type 'function'"),
    (None, "required", None, "tool_choice", "tool_choice 'required' needs tools"),
    (None, NAMED_SEARCH, None, "tool_choice", "tool_choice.function.name 'search' is not one of the tools"),
    (TOOLS, None, "yes", "parallel_tool_calls", "parallel_tool_calls must be a boolean"),
]


@pytest.mark.parametrize(("tools", "tool_choice", "parallel", "param", "message"), INVALID_SETTINGS)
def test_invalid_settings_name_the_field(tools, tool_choice, parallel, param, message):
    with pytest.raises(InvalidSettingError, match=re.escape(message)) as caught:
        parse_tools(tools, tool_choice, parallel)
    assert caught.value.param == param


def test_unenforceable_schema_carries_the_librarys_reason():
    bad = [tool(parameters={"type": "object", "properties": {"a": {"$ref": "#/missing"}}})]
    with pytest.raises(InvalidSettingError, match="missing"):
        parse_tools(bad)


# --- grammars, run by llguidance ---------------------------------------------------------------

CALL_OPEN_ID, CALL_CLOSE_ID, EOS_ID = 256, 257, 258


class ByteVocabulary:
    """256 single-byte tokens, then ``<tool_call>``, ``</tool_call>`` and ``<|im_end|>`` as special
    tokens (the eos), like Qwen2.5's added tokens seen through llguidance's llama.cpp tokenizer."""

    tokens = [bytes([byte]) for byte in range(256)] + [b"<tool_call>", b"</tool_call>", b"<|im_end|>"]
    special_token_ids = [CALL_OPEN_ID, CALL_CLOSE_ID, EOS_ID]
    eos_token_id = EOS_ID
    bos_token_id = None

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


@pytest.fixture(scope="module")
def tokenizer() -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(ByteVocabulary()))


def ids(*parts: str | int) -> list[int]:
    """Token ids: a string is its bytes, an int a special token."""
    out: list[int] = []
    for part in parts:
        out += [part] if isinstance(part, int) else list(part.encode())
    return out


def call_ids(name: str, arguments: str) -> list[int]:
    return ids(CALL_OPEN_ID, f'\n{{"name": "{name}", "arguments": {arguments}}}\n', CALL_CLOSE_ID)


def accepts(tokenizer: LLTokenizer, grammar: str, tokens: list[int]) -> bool:
    """Whether the grammar takes ``tokens`` as a whole reply, eos included."""
    matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    tokens = [*tokens, EOS_ID]
    if matcher.validate_tokens(tokens) < len(tokens):
        return False
    assert matcher.consume_tokens(tokens)
    return matcher.is_accepting() and matcher.is_stopped()


def test_required_grammar_accepts_a_valid_call_and_refuses_a_wrong_type(tokenizer):
    grammar = parse_tools(TOOLS, "required", False).grammar()
    assert accepts(tokenizer, grammar, call_ids("get_weather", '{"city": "Paris", "days": 2}'))
    assert accepts(tokenizer, grammar, call_ids("search", '{"q": ["any", {"object": null}]}'))
    assert not accepts(tokenizer, grammar, call_ids("get_weather", '{"city": 3}'))
    assert not accepts(tokenizer, grammar, call_ids("get_weather", '{"days": 2}'))  # city is required
    assert not accepts(tokenizer, grammar, call_ids("search", '"not an object"'))
    assert not accepts(tokenizer, grammar, call_ids("delete_everything", "{}"))
    assert not accepts(tokenizer, grammar, ids("Sure! ") + call_ids("search", "{}"))
    assert not accepts(tokenizer, grammar, [])  # a call is required


def test_keywords_llguidance_does_not_implement_leave_the_rest_of_the_schema_enforced(tokenizer):
    """Claude Code's tools use propertyNames: the call is still made, the other keywords hold,
    and the setup names the tool (the server says so in a header)."""
    env = {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "propertyNames": {"pattern": "^[A-Z]+$"},
    }
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}, "env": env}, "required": ["cmd"]}
    setup = parse_tools([tool(name="run", parameters=schema)], "required", False)
    assert setup.unenforced == ("run",) and "propertyNames" in setup.functions[0].unenforced
    grammar = setup.grammar()
    assert accepts(
        tokenizer, grammar, call_ids("run", '{"cmd": "ls", "env": {"lower": "x"}}')
    )  # not enforced
    assert not accepts(tokenizer, grammar, call_ids("run", '{"env": {}}'))  # required still holds
    assert not accepts(tokenizer, grammar, call_ids("run", '{"cmd": 3}'))
    assert parse_tools(TOOLS, "required").unenforced == ()


def test_the_grammar_writes_the_markers_as_special_tokens(tokenizer):
    grammar = parse_tools(TOOLS, "required").grammar()
    plain_markers = ids('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
    assert not accepts(tokenizer, grammar, plain_markers)
    by_id = parse_tools(TOOLS, "required").grammar(call_open=CALL_OPEN_ID, call_close=CALL_CLOSE_ID)
    assert "<[256]>" in by_id and accepts(tokenizer, by_id, call_ids("search", "{}"))


def test_plain_text_markers_for_vocabularies_without_them(tokenizer):
    grammar = parse_tools(TOOLS, "required").grammar(special_markers=False)
    assert accepts(tokenizer, grammar, ids('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'))
    assert not accepts(tokenizer, grammar, call_ids("search", "{}"))


def test_the_layout_is_the_templates(tokenizer):
    """Python's json.dumps layout, as the template's example: compact JSON is refused."""
    grammar = parse_tools(TOOLS, "required").grammar()
    assert not accepts(tokenizer, grammar, call_ids("get_weather", '{"city":"Paris"}'))
    assert not accepts(
        tokenizer, grammar, ids(CALL_OPEN_ID, '{"name": "search", "arguments": {}}', CALL_CLOSE_ID)
    )


def test_parallel_calls_only_when_allowed(tokenizer):
    two = call_ids("search", '{"q": "a"}') + ids("\n") + call_ids("get_weather", '{"city": "Oslo"}')
    assert accepts(tokenizer, parse_tools(TOOLS, "required", True).grammar(), two)
    assert not accepts(tokenizer, parse_tools(TOOLS, "required", False).grammar(), two)


def test_parallel_calls_may_end_with_a_newline(tokenizer):
    # Qwen writes "\n" before <|im_end|>; if a newline could only start another call, the grammar
    # forced a 1.5B model into call after call until max_tokens (4 of 4 replies, measured).
    one = call_ids("search", '{"q": "a"}') + ids("\n")
    assert accepts(tokenizer, parse_tools(TOOLS, "required", True).grammar(), one)
    rest = ids('\n{"name": "search", "arguments": {}}\n', CALL_CLOSE_ID, "\n")
    assert accepts(tokenizer, parse_tools(TOOLS, "auto", True).grammar_after_trigger(), rest)
    assert not accepts(tokenizer, parse_tools(TOOLS, "required", True).grammar(), one + ids("more"))


def test_a_named_choice_allows_only_that_function(tokenizer):
    grammar = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}).grammar()
    assert accepts(tokenizer, grammar, call_ids("get_weather", '{"city": "Rome"}'))
    assert not accepts(tokenizer, grammar, call_ids("search", "{}"))


def test_auto_has_no_whole_reply_grammar_but_one_after_the_trigger(tokenizer):
    setup = parse_tools(TOOLS, "auto", False)
    assert setup.grammar() is None
    assert setup.trigger == "<tool_call>"
    after = setup.grammar_after_trigger()
    rest = ids('\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n', CALL_CLOSE_ID)
    assert accepts(tokenizer, after, rest)
    assert not accepts(
        tokenizer, after, ids('\n{"name": "get_weather", "arguments": {"city": 1}}\n', CALL_CLOSE_ID)
    )
    assert not accepts(tokenizer, after, rest + ids(" and more text"))
    assert not accepts(tokenizer, after, rest + ids("\n") + call_ids("search", "{}"))  # not parallel
    parallel_after = parse_tools(TOOLS, "auto", True).grammar_after_trigger()
    assert accepts(tokenizer, parallel_after, rest + ids("\n") + call_ids("search", "{}"))


def test_what_the_grammar_accepts_parses_back(tokenizer):
    text = hermes("get_weather", '{"city": "Paris", "days": 2}') + "\n" + hermes("search", '{"q": "x"}')
    tokens = ids(text.replace("<tool_call>", "\x00").replace("</tool_call>", "\x01"))
    tokens = [CALL_OPEN_ID if t == 0 else CALL_CLOSE_ID if t == 1 else t for t in tokens]
    assert accepts(tokenizer, parse_tools(TOOLS, "required").grammar(), tokens)
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("search", {"q": "x"})]


def test_special_markers_must_look_like_tokens():
    setup = parse_tools(TOOLS, "required")
    with pytest.raises(ValueError, match="must look like <token>"):
        setup.grammar(call_open="[TOOL_CALLS]")


# --- parsing a finished reply -------------------------------------------------------------------

PARIS = ("get_weather", {"city": "Paris"})
PARIS_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TRICKY_QUERY = '</tool_call> {"name": "x"} ```'
ACCEPTED_FORMS = [
    # (reply, content, calls)
    (hermes("get_weather", '{"city": "Paris"}'), None, [PARIS]),
    ("Let me check.\n" + hermes("get_weather", '{"city": "Paris"}') + "\n", "Let me check.", [PARIS]),
    (
        hermes("get_weather", '{"city": "Paris"}') + "\n" + hermes("search", '{"q": "rain"}'),
        None,
        [PARIS, ("search", {"q": "rain"})],
    ),
    ('<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>', None, [PARIS]),
    (
        '<tool_call>\n  {"name" : "get_weather" , "arguments" : {"city": "Paris"}} \n</tool_call>',
        None,
        [PARIS],
    ),
    ("```json\n" + PARIS_JSON + "\n```", None, [PARIS]),
    ("Calling:\n```\n" + PARIS_JSON + "\n```", "Calling:", [PARIS]),
    ("<tools>\n" + PARIS_JSON + "\n</tools>", None, [PARIS]),
    (PARIS_JSON, None, [PARIS]),
    ("\n  " + PARIS_JSON + '\n{"name": "search"}', None, [PARIS, ("search", {})]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None, [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("{" + PARIS_JSON + "}", None, [PARIS]),  # doubled braces, as Qwen2.5's template shows a call
    ("{ \n" + PARIS_JSON + " }\nDone.", "Done.", [PARIS]),
    ("{" + PARIS_JSON, None, [PARIS]),  # ... the reply ended before the second closing brace
    ("<tool_call>\n" + PARIS_JSON, None, [PARIS]),  # the reply ended before the closing marker
    ("<tool_call>\n" + PARIS_JSON + "\n</tool_", None, [PARIS]),  # ... or inside it
    ("```json\n" + PARIS_JSON + "\n``", None, [PARIS]),
    (hermes("search", json.dumps({"q": TRICKY_QUERY})), None, [("search", {"q": TRICKY_QUERY})]),
    ("Done: " + hermes("search", "{}") + " and then some.", "Done:  and then some.", [("search", {})]),
]


@pytest.mark.parametrize(("text", "content", "calls"), ACCEPTED_FORMS)
def test_accepted_forms(text, content, calls):
    parsed_content, parsed_calls = parse_tool_calls(text, NAMES)
    assert parsed_content == content
    assert calls_of(parsed_calls) == calls


@pytest.mark.parametrize(("text", "content", "calls"), ACCEPTED_FORMS)
def test_no_markup_leaks_into_content(text, content, calls):
    parsed_content, _ = parse_tool_calls(text, NAMES)
    for markup in ("<tool_call>", "</tool_call>", "<tools>", "```", '"name"'):
        assert markup not in (parsed_content or "")


def test_arguments_are_a_compact_json_object_string():
    _, calls = parse_tool_calls(hermes("search", '{"q": "é",  "n": [1, 2]}'), NAMES)
    assert calls[0].arguments == '{"q":"é","n":[1,2]}'
    assert calls[0].to_openai() == {
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "search", "arguments": '{"q":"é","n":[1,2]}'},
    }


def test_call_ids_are_unique():
    _, calls = parse_tool_calls("\n".join(hermes("search", "{}") for _ in range(50)), NAMES)
    assert len({call.id for call in calls}) == 50
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)


REFUSED_FORMS = [
    hermes("delete_everything", "{}"),  # not one of the tools
    '```json\n{"name": "Ada", "age": 36}\n```',  # JSON that is no call
    '```json\n{"type": "object", "name": "get_weather"}\n```',  # "name" not first
    '```python\nprint({"name": "search", "arguments": {}})\n```',
    'Example: {"name": "get_weather", "arguments": {"city": "Paris"}}',  # a bare object not at the start
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1}',
    '{"name": "get_weather", "arguments": [1]}',
    '{"name": "get_weather", "arguments": "not json"}',
    '{"name": "get_weather", "arguments": {"x": NaN}}',
    # malformed, then more text: not a call cut by the end of the reply
    '<tool_call>\n{"name": "search", "arguments": {"q": "x"} and so on',
    '{"name": "search", "arguments": {"q": "x"} and then prose',
    '<tool_call>\n{"name": "search", "arguments": {}}\nand text instead of the close',
    "<tool_call></tool_call>",
    '{"name": "search", "name": "delete_everything", "arguments": {}}',  # JSON keeps the last name
    "a < b, `x`, ``y``, <tools are fine>",
    '{{"name": "Ada", "age": 36}}',  # doubled braces around no call
    '{{"name": "search", "arguments": {}} and prose}',
    'So: {{"name": "search", "arguments": {}}}',  # not at the start
]


@pytest.mark.parametrize("text", REFUSED_FORMS)
def test_anything_else_stays_content_as_written(text):
    assert parse_tool_calls(text, NAMES) == (text.strip(), [])


# A generation cut inside a call: the call is dropped (never content), the ones before it stand.
CUT_FORMS = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),
    ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"days": 3', "Checking.", []),
    ('<tool_call>\n{"name": "search", "arguments": {"q": "a \\', None, []),
    ('<tool_call>\n{"name": "search", "arguments": {"q": "\\u00', None, []),
    ('<tool_call>\n{"name": "search", "arguments": {"n": [1, tr', None, []),
    ('<tool_call>\n{"name": "search", "arguments": {"n": -', None, []),
    ('<tool_call>\n{"name": "search", "arguments": {"q": "x", "k"', None, []),
    ('<tool_call>\n{"name": "search", "arguments": {"q": "x",', None, []),
    ('<tool_call>\n{"name": "sea', None, []),
    ("<tool_call>\n", None, []),
    ('{"name": "search", "arguments": {', None, []),
    ('```json\n{"name": "search"', None, []),
    (PARIS_JSON + '\n{"name": "search", "arguments": {"q": "x', None, [PARIS]),
    (hermes("search", "{}") + '\n<tool_call>\n{"name": "get_weather", ', None, [("search", {})]),
    ('<tools>\n{"name": "search", "arguments": {}}\n{"name": "sea', None, [("search", {})]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CUT_FORMS)
def test_a_call_the_generation_was_cut_inside_is_dropped(text, content, calls):
    parsed_content, parsed_calls = parse_tool_calls(text, NAMES, cut=True)
    assert (parsed_content, calls_of(parsed_calls)) == (content, calls)
    stream = ToolCallStream(NAMES)
    deltas = [delta for char in text for delta in stream.feed(char)] + stream.finish(cut=True)
    assert stream_result(deltas) == (content, calls)


@pytest.mark.parametrize("text", [text for text, _, calls in CUT_FORMS if not calls and "{" in text])
def test_an_unfinished_call_the_model_itself_ended_on_stays_content(text):
    """Not cut: the model wrote something malformed and stopped; the text shows what."""
    assert parse_tool_calls(text, NAMES) == (text.strip(), [])
    assert stream_result(streamed(text, list(range(len(text))))) == (text.strip(), [])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_c",
        hermes("search", "{}") + "\n<tool_ca",
        '<tool_call>\n{"name": "search", "argu',
        "<tool_call>\n",
    ],
)
def test_a_reply_constrained_to_calls_has_no_content(text):
    """Under tool_choice required (calls_only) the grammar allows nothing but calls: a marker cut
    in pieces (a tokenizer without a one-token <tool_call>) is no content either."""
    expected = [("search", {})] if text.startswith(hermes("search", "{}")) else []
    content, calls = parse_tool_calls(text, NAMES, calls_only=True)
    assert (content, calls_of(calls)) == (None, expected)
    stream = ToolCallStream(NAMES, calls_only=True)
    deltas = [delta for char in text for delta in stream.feed(char)] + stream.finish()
    assert stream_result(deltas) == (None, expected)


def test_only_known_names_count():
    text = hermes("get_weather", '{"city": "Paris"}')
    assert parse_tool_calls(text, ["search"]) == (text, [])
    assert parse_tool_calls(text, []) == (text, [])


def test_plain_text_is_content():
    assert parse_tool_calls("  Hello!\n", NAMES) == ("Hello!", [])
    assert parse_tool_calls("", NAMES) == (None, [])


# --- streaming ----------------------------------------------------------------------------------


def streamed(text: str, cuts: list[int], names=NAMES) -> list:
    stream = ToolCallStream(names)
    bounds = [0, *sorted(cuts), len(text)]
    deltas = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        deltas += stream.feed(text[start:end])
    return deltas + stream.finish()


def stream_result(deltas) -> tuple[str | None, list[tuple[str, dict]]]:
    content = "".join(delta.text for delta in deltas if isinstance(delta, ContentDelta))
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if isinstance(delta, ToolCallDelta):
            name, arguments = calls.setdefault(delta.index, [None, ""])
            calls[delta.index] = [name or delta.name, arguments + delta.arguments]
    return content or None, [(name, json.loads(arguments)) for name, arguments in calls.values()]


def openai_assembly(deltas) -> tuple[str | None, list[tuple[str, dict]]]:
    """The message the openai client builds from our deltas sent as chunks."""
    state = ChatCompletionStreamState()
    bodies = [{"role": "assistant"}] + [delta.to_openai() for delta in deltas]
    has_calls = any(isinstance(delta, ToolCallDelta) for delta in deltas)
    for number, body in enumerate(bodies + [{}]):
        finish = ("tool_calls" if has_calls else "stop") if number == len(bodies) else None
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": body, "finish_reason": finish}],
        }
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    message = state.get_final_completion().choices[0].message
    calls = [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]
    return message.content or None, calls


SEGMENTS = [
    "Sure.",
    " ",
    "\n",
    "a < b",
    "``",
    "<tool",
    "{",
    '{"name": "search"',
    "```python\nx = 1\n```",
    hermes("get_weather", '{"city": "Paris", "days": 3}'),
    hermes("search", '{"q": "a \\"quoted\\" }"}'),
    hermes("delete_everything", "{}"),
    '```json\n{"name": "search", "arguments": {"q": "fenced"}}\n```',
    '```json\n{"name": "Ada"}\n```',
    '<tools>\n{"name": "search", "arguments": "{\\"q\\": 2}"}\n</tools>',
    '{"name": "get_weather", "parameters": {"city": "Bare"}}',
    '{{"name": "search", "arguments": {"q": "doubled"}}}',
    '<tool_call>\n{"name": "search", "arguments": {"q": "unfinished"',
]


@st.composite
def chunked_replies(draw):
    text = "".join(draw(st.lists(st.sampled_from(SEGMENTS), max_size=6)))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    return text, cuts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked_replies())
def test_the_stream_agrees_with_the_whole_text_on_any_chunking(reply):
    text, cuts = reply
    content, calls = parse_tool_calls(text, NAMES)
    deltas = streamed(text, cuts)
    assert stream_result(deltas) == (content, calls_of(calls))
    assert openai_assembly(deltas) == (content, calls_of(calls))


# Every form the parser knows (accepted, refused, cut short) and plain content, whitespace included.
MIXED_FORMS = sorted(
    {text for text, _, _ in ACCEPTED_FORMS + CUT_FORMS}
    | set(REFUSED_FORMS)
    | set(SEGMENTS)
    | {"\u00a0", "\t", "Done.", "<tool_call>", "```json\n"}
)


@st.composite
def chunked_mixed_forms(draw):
    text = "".join(draw(st.lists(st.sampled_from(MIXED_FORMS), max_size=5)))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    return text, cuts


def streamed_whole(text: str, cuts: list[int], *, calls_only: bool, cut: bool) -> list:
    stream = ToolCallStream(NAMES, calls_only=calls_only)
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [
        delta
        for start, end in zip(bounds, bounds[1:], strict=False)
        for delta in stream.feed(text[start:end])
    ]
    return deltas + stream.finish(cut=cut)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked_mixed_forms(), st.booleans(), st.booleans())
def test_any_chunking_of_any_mix_of_forms_gives_the_whole_texts_content_and_calls(reply, calls_only, cut):
    """For every text made of the known forms and content, every chunking of it, with or without
    calls_only and cut: the stream's content concatenated and its calls are parse_tool_calls's."""
    text, cuts = reply
    content, calls = parse_tool_calls(text, NAMES, calls_only=calls_only, cut=cut)
    deltas = streamed_whole(text, cuts, calls_only=calls_only, cut=cut)
    assert stream_result(deltas) == (content, calls_of(calls))


@pytest.mark.parametrize(
    "text",
    ["\u00a0" + PARIS_JSON, "\u00a0" + hermes("search", "{}") + PARIS_JSON, " \n\t" + PARIS_JSON],
)
def test_whitespace_before_a_bare_object_is_judged_alike_on_every_chunking(text):
    """A bare object follows JSON whitespace only, yet any whitespace leaves the reply's start open."""
    content, calls = parse_tool_calls(text, NAMES)
    for split in range(len(text) + 1):
        deltas = streamed_whole(text, [split], calls_only=False, cut=False)
        assert stream_result(deltas) == (content, calls_of(calls))


def test_character_by_character_matches_too():
    text = "Checking.\n" + "".join(SEGMENTS[9:16]) + "\nDone."
    content, calls = parse_tool_calls(text, NAMES)
    assert len(calls) == 4
    deltas = streamed(text, list(range(len(text))))
    assert openai_assembly(deltas) == (content, calls_of(calls))


def test_a_prefix_of_the_trigger_is_held_back_until_it_is_settled():
    stream = ToolCallStream(NAMES)
    assert stream.feed("Let me look <tool") == [ContentDelta("Let me look")]
    assert stream.feed("_call>\n") == []
    assert stream.feed('{"name": "search", "arguments": {"q": "x"}}\n</tool') == []
    deltas = stream.feed("_call>")
    assert [type(delta) for delta in deltas] == [ToolCallDelta, ToolCallDelta]
    assert stream.finish() == []

    stream = ToolCallStream(NAMES)
    assert stream.feed("a <to") == [ContentDelta("a")]
    assert stream.feed("p>") == [ContentDelta(" <top>")]


def test_a_leading_brace_or_fence_is_held_until_its_head_tells():
    stream = ToolCallStream(NAMES)
    assert stream.feed('{"na') == []
    assert stream.feed('me": "Ada"') == [ContentDelta('{"name": "Ada"')]  # no tool of that name
    stream = ToolCallStream(NAMES)  # a brace alone may be the first of two around a call
    assert stream.feed("{") == []
    assert stream.feed(" \n") == []
    deltas = stream.feed(PARIS_JSON + "}") + stream.finish()
    assert stream_result(deltas) == (None, [PARIS])
    stream = ToolCallStream(NAMES)
    assert stream.feed("``") == []
    assert stream.feed("`pyth") == []
    assert stream.feed("on\n") == [ContentDelta("```python")]


def test_stream_fragments_have_openais_shape():
    stream = ToolCallStream(NAMES)
    deltas = stream.feed(hermes("search", '{"q": "x"}') + hermes("get_weather", '{"city": "Oslo"}'))
    first, arguments, second, _ = (delta.to_openai() for delta in deltas)
    call_id = first["tool_calls"][0]["id"]
    assert call_id.startswith("call_")
    assert first == {
        "tool_calls": [
            {"index": 0, "id": call_id, "type": "function", "function": {"name": "search", "arguments": ""}}
        ]
    }
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": '{"q":"x"}'}}]}
    assert (
        second["tool_calls"][0]["index"] == 1 and second["tool_calls"][0]["function"]["name"] == "get_weather"
    )
    assert ContentDelta("hi").to_openai() == {"content": "hi"}


def test_a_setup_gives_a_parser_for_its_tools():
    parser = parse_tools(TOOLS).parser()
    assert isinstance(parser, ToolCallStream)
    assert [type(d) for d in parser.feed(hermes("search", "{}"))] == [ToolCallDelta, ToolCallDelta]


def test_arguments_hold_only_the_declared_parameters_unless_the_schema_allows_more(tokenizer):
    """As llama.cpp's converter reads tool schemas: an object schema silent on extra keys refuses
    them, nested ones too, so a function without parameters is called with {}."""
    no_params = tool(name="llm_version", parameters={"type": "object", "properties": {}})
    grammar = parse_tools([no_params, WEATHER], "required").grammar()
    assert accepts(tokenizer, grammar, call_ids("llm_version", "{}"))
    assert not accepts(tokenizer, grammar, call_ids("llm_version", '{"version": "1"}'))
    assert not accepts(tokenizer, grammar, call_ids("get_weather", '{"city": "Oslo", "unit": "C"}'))
    when = {"type": "object", "properties": {"day": {}}}
    nested = tool(name="book", parameters={"properties": {"when": when}})
    open_ = tool(name="log", parameters={"type": "object", "additionalProperties": True})
    grammar = parse_tools([nested, open_], "required").grammar()
    assert accepts(tokenizer, grammar, call_ids("book", '{"when": {"day": 3}}'))
    assert not accepts(tokenizer, grammar, call_ids("book", '{"when": {"day": 3, "hour": 9}}'))
    assert accepts(tokenizer, grammar, call_ids("log", '{"anything": [1, 2]}'))  # the schema allows it


def test_closing_leaves_what_the_schema_says_and_allof_branches_alone():
    from cactus_edge.constraints.tools import closed

    schema = {
        "type": "object",
        "properties": {"a": {"type": "object"}, "b": {"type": "array", "items": {"properties": {"c": {}}}}},
        "$defs": {"d": {"type": "object", "additionalProperties": {"type": "integer"}}},
    }
    result = closed(schema)
    assert result["additionalProperties"] is False
    assert result["properties"]["a"]["additionalProperties"] is False
    assert result["properties"]["b"]["items"]["additionalProperties"] is False
    assert result["$defs"]["d"]["additionalProperties"] == {"type": "integer"}  # said: kept
    assert schema["properties"]["a"] == {"type": "object"}  # the caller's schema is not changed
    combined = {"type": "object", "properties": {"y": {}}, "allOf": [{"properties": {"x": {}}}]}
    assert closed(combined) == combined  # closing either part would refuse the other's keys
