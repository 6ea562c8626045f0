"""Tool calls: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, the grammars that make
a model's call well-formed, and the parsers that turn its reply back into ``message.tool_calls``.

Pure Python over llguidance's grammar syntax; nothing here touches llama.cpp. The model side is
Qwen2.5's Hermes format, the one its chat template teaches::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- :func:`parse_tools` validates a request and returns a :class:`ToolSetup` (or None).
- :meth:`ToolSetup.grammar` constrains a whole reply to calls (``tool_choice`` "required" or a
  named function); :meth:`ToolSetup.grammar_after_trigger` constrains what follows the
  ``<tool_call>`` trigger with "auto".
- :func:`parse_tool_calls` splits a finished reply into content and calls;
  :class:`ToolCallStream` does the same on a stream of text deltas. Both run one parser, the
  stream on the text it holds back at each delta, so the two agree on every chunking of a text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby
from typing import Any, NamedTuple

from llguidance import LLMatcher

from ..errors import InvalidSettingError
from .grammar import JSON_LAYOUT

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# OpenAI's rule for function names; it also keeps names free of quotes, escapes and markup, so a
# name can be written into a grammar literal and recognised in text as it is.
_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


# --- the request -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFunction:
    """One function tool: ``parameters`` is the JSON schema of its arguments, always an object
    schema (a missing or empty one becomes ``{"type": "object"}``)."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False
    # llguidance's note of the schema keywords it cannot enforce (Claude Code's tools use
    # propertyNames): the arguments then follow the rest of the schema, and the server says so.
    unenforced: str | None = None


@dataclass(frozen=True)
class ToolSetup:
    """What a request's tool settings ask of a generation.

    ``tools`` are the request's tool dicts as sent, for the chat template's ``tools`` variable.
    ``choice`` is "none" (the tools are shown to the model, no call is made or parsed), "auto",
    "required" or "function" (then ``forced_name`` names the one tool to call). ``parallel``
    allows several calls in one reply.
    """

    tools: tuple[dict[str, Any], ...]
    functions: tuple[ToolFunction, ...]
    choice: str = "auto"
    forced_name: str | None = None
    parallel: bool = True
    trigger: str = CALL_OPEN  # the text that starts a call, for "auto"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(function.name for function in self.functions)

    @property
    def unenforced(self) -> tuple[str, ...]:
        """The tools whose schemas hold keywords the grammar cannot enforce: their names."""
        return tuple(function.name for function in self.functions if function.unenforced is not None)

    @property
    def constrained(self) -> bool:
        """Whether the whole reply must be tool calls (then :meth:`grammar` applies from the start)."""
        return self.choice in ("required", "function")

    @property
    def calls_allowed(self) -> bool:
        """Whether the reply may call tools (so it is parsed for calls): not with "none"."""
        return self.choice != "none"

    def parser(self) -> ToolCallStream:
        return ToolCallStream(self.names, calls_only=self.constrained)

    def grammar(
        self,
        call_open: str | int = CALL_OPEN,
        call_close: str | int = CALL_CLOSE,
        special_markers: bool = True,
    ) -> str | None:
        """The Lark grammar (llguidance syntax) of a reply that is nothing but calls: one, or one
        or more separated by newlines when ``parallel``. None with "auto", whose reply is free
        until the trigger.

        With ``special_markers`` the call markers are single special tokens of the vocabulary:
        a ``<...>`` text is written ``<tool_call>`` and an int is a token id, written ``<[151657]>``
        (llguidance's syntax for special tokens, which is how its llama.cpp tokenizer sees
        Qwen2.5's ``<tool_call>``). Without it they are plain text, for vocabularies that lack them.
        """
        if not self.constrained:
            return None
        opener = _marker(call_open, special_markers)
        closer = _marker(call_close, special_markers)
        # A newline may end the calls: Qwen writes one before <|im_end|>; a grammar that took a
        # newline only as the start of another call forced a 1.5B model into call after call.
        start = "start: call\n" if not self.parallel else 'start: call ("\\n" call)* "\\n"?\n'
        return start + f'call: {opener} "\\n" body "\\n" {closer}\n' + self._bodies()

    def grammar_after_trigger(
        self,
        call_open: str | int = CALL_OPEN,
        call_close: str | int = CALL_CLOSE,
        special_markers: bool = True,
    ) -> str:
        """With "auto": the grammar of what follows the trigger once the reply has produced it (the
        call's JSON and closing marker, then more calls when ``parallel``, then the end). Marker
        arguments as in :meth:`grammar`."""
        closer = _marker(call_close, special_markers)
        if not self.parallel:
            return f'start: "\\n" body "\\n" {closer}\n' + self._bodies()
        opener = _marker(call_open, special_markers)
        start = f'start: "\\n" body "\\n" {closer} ("\\n" call)* "\\n"?\n'
        return start + f'call: {opener} "\\n" body "\\n" {closer}\n' + self._bodies()

    def _bodies(self) -> str:
        """``body``: one alternative per callable function, each a literal ``{"name": "<name>",
        "arguments": `` followed by that function's schema. Writing the head as a literal, not
        as a ``"name": {"const": ...}`` property, fixes the key order and spacing the template
        shows, and leaves one schema live once the name is told apart: the rest of the head is
        then forced."""
        callable_functions = [f for f in self.functions if self.forced_name in (None, f.name)]
        rules = [f"body: {' | '.join(f'fn_{i}' for i in range(len(callable_functions)))}"]
        for index, function in enumerate(callable_functions):
            head = json.dumps(f'{{"name": "{function.name}", "arguments": ')
            schema = _laid_out(function.parameters, lenient=function.unenforced is not None)
            rules.append(f'fn_{index}: {head} %json {schema} "}}"')
        return "\n".join(rules) + "\n"


def _marker(marker: str | int, special: bool) -> str:
    """A call marker in grammar syntax: a special token (by text or id) or a string literal."""
    if not special:
        if not isinstance(marker, str):
            raise ValueError("a plain-text marker must be a string")
        return json.dumps(marker)
    if isinstance(marker, int):
        return f"<[{marker}]>"
    if not (marker.startswith("<") and marker.endswith(">")) or any(c in marker[1:-1] for c in "<>\n"):
        raise ValueError(f"special marker {marker!r} must look like <token> (or be a token id)")
    return marker


def _laid_out(schema: dict[str, Any], lenient: bool = False) -> str:
    """The arguments' schema as the grammar embeds it: closed (:func:`closed`) and with our
    layout options (llguidance reads them from a top-level ``x-guidance`` key; ours win over the
    caller's, since the parser relies on nothing but JSON). ``lenient``: keywords llguidance
    does not implement are ignored instead of refused."""
    given = schema.get("x-guidance")
    options = {**(given if isinstance(given, dict) else {}), **JSON_LAYOUT, "lenient": lenient}
    return json.dumps({**closed(schema), "x-guidance": options})


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains", "additionalProperties")


def closed(schema: Any) -> Any:
    """``schema`` with every object schema that says nothing about extra keys refusing them, as
    llama.cpp's converter reads tool schemas: a call then holds only its declared parameters, and
    a function without parameters is called with ``{}``. JSON Schema's own default (any extra key
    allowed) let models invent arguments the function rejects. An object combined from others
    (``allOf``, ``anyOf``, ``oneOf``, ``$ref``) and the ``allOf`` branches are left open: closing
    them would refuse the keys the other parts declare."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            result[key] = {name: closed(sub) for name, sub in result[key].items()}
    for key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMAS):
        if isinstance(result.get(key), (dict, list)):
            result[key] = closed(result[key])
    is_object = result.get("type") == "object" or "properties" in result
    if is_object and not _SAYS_WHICH_KEYS & result.keys():
        result["additionalProperties"] = False
    return result


# Keys after which an object schema's keys are not its own properties alone: left open.
_SAYS_WHICH_KEYS = {
    "additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "anyOf", "oneOf", "$ref"
}  # fmt: skip


def parse_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolSetup | None:
    """Validate OpenAI's tool settings: ``tools`` a list of ``{"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}}``, ``tool_choice`` "none" | "auto" |
    "required" | ``{"type": "function", "function": {"name": ...}}`` (default "auto"), and
    ``parallel_tool_calls`` a bool (default true).

    Returns None when there are no tools. With ``tool_choice`` "none", as with OpenAI, the tools
    are still rendered into the prompt (so the model knows them, and a conversation that used
    them reads the same), but the reply is all content: nothing parses it for calls, and where
    the call marker is one token the server bans it (``openai_api.requests.config_for_vocabulary``).

    Raises :class:`InvalidSettingError` naming the field (``tools[1].function.name must be a
    string``), with ``param`` "tools", "tool_choice" or "parallel_tool_calls". Each schema is
    compiled once by llguidance here, so a schema it cannot enforce is refused up front rather
    than run unconstrained.
    """
    parallel = _parallel(parallel_tool_calls)
    functions = _functions(tools)
    choice, forced_name = _choice(tool_choice, functions)
    if not functions:
        return None
    return ToolSetup(
        tools=tuple(tools),
        functions=functions,
        choice=choice,
        forced_name=forced_name,
        parallel=parallel,
    )


def _parallel(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise InvalidSettingError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return value


def _functions(tools: Any) -> tuple[ToolFunction, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidSettingError("tools must be a list", param="tools")
    functions = tuple(_function(index, tool) for index, tool in enumerate(tools))
    seen: set[str] = set()
    for index, function in enumerate(functions):
        if function.name in seen:
            raise InvalidSettingError(
                f"tools[{index}].function.name {function.name!r} is defined twice", param="tools"
            )
        seen.add(function.name)
    return functions


def _function(index: int, tool: Any) -> ToolFunction:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise InvalidSettingError(f"{where} must be an object", param="tools")
    if tool.get("type") != "function":
        raise InvalidSettingError(f"{where}.type must be 'function'", param="tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidSettingError(f"{where}.function must be an object", param="tools")
    parameters, unenforced = _parameters(f"{where}.function.parameters", function.get("parameters"))
    return ToolFunction(
        name=_function_name(f"{where}.function.name", function.get("name")),
        description=_optional(f"{where}.function.description", function.get("description"), str, "a string"),
        parameters=parameters,
        strict=bool(_optional(f"{where}.function.strict", function.get("strict"), bool, "a boolean")),
        unenforced=unenforced,
    )


def _function_name(where: str, name: Any) -> str:
    if not isinstance(name, str):
        raise InvalidSettingError(f"{where} must be a string", param="tools")
    if not _NAME_PATTERN.fullmatch(name):
        raise InvalidSettingError(
            f"{where} {name!r} must be 1 to 64 letters, digits, underscores or dashes", param="tools"
        )
    return name


def _optional(where: str, value: Any, kind: type, described: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise InvalidSettingError(f"{where} must be {described}", param="tools")
    return value


def _parameters(where: str, schema: Any) -> tuple[dict[str, Any], str | None]:
    """The arguments' schema, made an object schema (arguments are always a JSON object), and
    llguidance's note of the keywords it cannot enforce (None: all are). A schema that cannot be
    enforced otherwise is refused."""
    if schema is None:
        return {"type": "object"}, None
    if not isinstance(schema, dict):
        raise InvalidSettingError(f"{where} must be a JSON schema object", param="tools")
    kind = schema.get("type", "object")
    if kind != "object":
        raise InvalidSettingError(
            f"{where} must describe an object (type 'object'), not {kind!r}", param="tools"
        )
    schema = {**schema, "type": "object"}
    try:
        schema_json = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as error:
        raise InvalidSettingError(f"{where} must be JSON: {error}", param="tools") from error
    problem = _schema_problem(schema_json, lenient=False)
    if problem and "Unimplemented keys" in problem and not _schema_problem(schema_json, lenient=True):
        return schema, problem
    if problem:
        raise InvalidSettingError(f"{where} cannot be enforced: {problem}", param="tools")
    return schema, None


@lru_cache(maxsize=256)
def _schema_problem(schema_json: str, lenient: bool) -> str:
    """llguidance's complaint about a schema laid out as the grammar embeds it ("" when none).
    Cached on the schema's text: agents send the same tools with every turn."""
    grammar = LLMatcher.grammar_from_json_schema(_laid_out(json.loads(schema_json), lenient))
    return LLMatcher.validate_grammar(grammar).strip()


def _choice(tool_choice: Any, functions: tuple[ToolFunction, ...]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "function", the forced function's name or None)."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise InvalidSettingError(
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if tool_choice == "required" and not functions:
            raise InvalidSettingError("tool_choice 'required' needs tools", param="tool_choice")
        return tool_choice, None
    return "function", _forced_name(tool_choice, functions)


def _forced_name(tool_choice: Any, functions: tuple[ToolFunction, ...]) -> str:
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise InvalidSettingError(
            "tool_choice must be a string or an object with type 'function'", param="tool_choice"
        )
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidSettingError("tool_choice.function.name must be a string", param="tool_choice")
    if name not in {f.name for f in functions}:
        raise InvalidSettingError(
            f"tool_choice.function.name {name!r} is not one of the tools", param="tool_choice"
        )
    return name


# --- what the model wrote -----------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``arguments`` is a compact JSON object string, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """``message.tool_calls[]`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ContentDelta:
    """Reply text outside any call."""

    text: str

    def to_openai(self) -> dict[str, Any]:
        """The chunk's ``delta``."""
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of call ``index``: the first carries ``id`` and ``name`` (and empty arguments),
    later ones only ``arguments``; the fragments' arguments concatenated are the call's."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The chunk's ``delta``: ``{"tool_calls": [fragment]}`` in OpenAI's stream shape."""
        fragment: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            fragment.update(
                id=self.id, type="function", function={"name": self.name, "arguments": self.arguments}
            )
        else:
            fragment["function"] = {"arguments": self.arguments}
        return {"tool_calls": [fragment]}


Delta = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_tool_calls(
    text: str, tool_names: Iterable[str], *, calls_only: bool = False, cut: bool = False
) -> tuple[str | None, list[ToolCall]]:
    """A finished reply as (content, calls), in OpenAI's message shape.

    Calls are recognised in the Hermes form (``<tool_call>{json}</tool_call>``, any number,
    anywhere) and in the looser forms Qwen2.5-Coder emits: a fenced JSON block (```` ```json ````
    or a bare fence), a ``<tools>...</tools>`` wrapping, and a bare ``{"name": ...}`` object at the
    start of the reply (before any other text; calls may precede it), also inside doubled braces
    (``{{"name": ...}}``, as Qwen2.5's template spells its example). Each object must read
    ``{"name": "<one of tool_names>", "arguments": {...}}``, "name" first; "arguments" may be a
    JSON string or be called "parameters", and may be missing (no arguments). A block with
    anything else in it, an unknown name included, is not a call and stays in the content as
    written. A closing marker may be missing, or cut short, at the very end of the reply.

    ``cut``: the generation was cut (max_tokens, a full context, a stop string, a cancel), not
    ended by the model. A call it cut is dropped: the calls before it count, and its unfinished
    text is neither a call nor content. It cut a call when the held object starts
    ``{"name": "<known tool>"`` and is the start of some valid JSON, or when a ``<tool_call>``
    marker (or an earlier call of the block) is followed only by the start of such a head, or by
    nothing. A reply the model itself ended inside an unfinished object keeps it as content: the
    model wrote something malformed, and the text shows what.

    Content is the text around the calls, stripped, or None when nothing else remains.
    ``calls_only``: the reply was constrained to calls (``tool_choice`` "required" or a named
    function), so whatever is not a complete call is one cut short (even inside its marker, where
    a tokenizer spells it in pieces): no content at all.
    """
    pieces, _ = _parse(text, frozenset(tool_names), cut=cut)
    content = "" if calls_only else "".join(piece for piece in pieces if isinstance(piece, str)).strip()
    return content or None, [piece for piece in pieces if isinstance(piece, ToolCall)]


class ToolCallStream:
    """:func:`parse_tool_calls` over a stream: ``feed(text_delta)`` and ``finish()`` return
    :class:`ContentDelta` and :class:`ToolCallDelta` items.

    The text from the first position that may still begin a call is held, and each feed parses
    it again with the same parser as :func:`parse_tool_calls`: what that parse decides is sent and
    dropped, so every chunking of a reply gives the whole reply's content and calls, and markup
    never reaches the content. A call is sent once its block is complete: a first fragment with id
    and name, then one with all its arguments. The content's whitespace is held too: dropped at
    the start and the end of the reply, as :func:`parse_tool_calls` strips it.
    """

    def __init__(self, tool_names: Iterable[str], *, calls_only: bool = False) -> None:
        self._names = frozenset(tool_names)
        self._calls_only = calls_only
        self._held = ""
        self._leading = True  # no content yet, so a bare object may still be a call
        self._space = ""  # the content's trailing whitespace, sent only before more content
        self._sent = False
        self._calls = 0

    def feed(self, text_delta: str) -> list[Delta]:
        return self._advance(text_delta, final=False)

    def finish(self, cut: bool = False) -> list[Delta]:
        """The rest, the reply being over; ``cut`` as in :func:`parse_tool_calls`."""
        return self._advance("", final=True, cut=cut)

    def _advance(self, text_delta: str, *, final: bool, cut: bool = False) -> list[Delta]:
        """Parse the held text and ``text_delta``; send what the parse decides, hold the rest."""
        text = self._held + text_delta
        pieces, end = _parse(text, self._names, leading=self._leading, final=final, cut=cut)
        self._held = text[end:]
        self._leading = _still_leading(self._leading, pieces)
        deltas: list[Delta] = []
        for is_call, group in groupby(pieces, key=lambda piece: isinstance(piece, ToolCall)):
            run = list(group)
            deltas += self._call_deltas(run) if is_call else self._content("".join(run))
        return deltas

    def _content(self, text: str) -> list[Delta]:
        """The delta for decided content: none under ``calls_only``, whitespace held at the ends."""
        if self._calls_only:
            return []
        pending = self._space + text
        body = pending.rstrip()
        self._space = pending[len(body) :]
        body = body if self._sent else body.lstrip()
        self._sent = self._sent or bool(body)
        return [ContentDelta(body)] if body else []

    def _call_deltas(self, calls: list[ToolCall]) -> list[Delta]:
        """Two fragments per call: its id and name, then all its arguments."""
        deltas: list[Delta] = []
        for call in calls:
            deltas += [
                ToolCallDelta(self._calls, call.id, call.name, ""),
                ToolCallDelta(self._calls, None, None, call.arguments),
            ]
            self._calls += 1
        return deltas


# --- the parser ----------------------------------------------------------------------------------

# The markup a call block may open with, and what closes it. A bare object has neither.
_OPENERS = {CALL_OPEN: CALL_CLOSE, "<tools>": "</tools>", "```": "```"}
_FENCE_TAG = re.compile(r"[A-Za-z_]*")
_FENCE_LANGUAGES = ("", "json", "tool_call")
_SPACES = re.compile(r"[ \t\r\n]*")
# A JSON string (its closing quote captured, absent when the text ends inside it) or a bracket.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(")?|[{}\[\]]', re.DOTALL)


class _Block(NamedTuple):
    """A verdict on a candidate call block: its calls and where it ends, or ``calls`` None when it
    is no call (then it ends after its opener: only that is content for sure)."""

    end: int
    calls: list[ToolCall] | None


def _parse(
    text: str, names: frozenset[str], *, leading: bool = True, final: bool = True, cut: bool = False
) -> tuple[list[str | ToolCall], int]:
    """``text`` as content strings and calls, and where its undecided rest (a possible call; none when
    ``final``) begins. ``leading``: no content came before, so a bare object may be a call."""
    pieces: list[str | ToolCall] = []
    pos = 0
    while pos < len(text):
        leading = _still_leading(leading, pieces)
        start, opener = _next_opener(text, pos, leading=leading, final=final)
        block = None if opener is None else _read_block(text, start, opener, names, final=final, cut=cut)
        pieces += [text[pos:start]] if start > pos else []
        if block is None:
            return pieces, start
        pieces += [text[start : block.end]] if block.calls is None else block.calls
        pos = block.end
    return pieces, pos


def _still_leading(leading: bool, pieces: list[str | ToolCall]) -> bool:
    """Whether no content but whitespace came before the text after ``pieces``."""
    return leading and not any(isinstance(piece, str) and piece.strip() for piece in pieces)


def _next_opener(text: str, pos: int, *, leading: bool, final: bool) -> tuple[int, str | None]:
    """Where the first possible call block from ``pos`` starts and its opener ("" for a bare object);
    else where text that may still begin one (an opener's prefix, whitespace before a bare object) starts."""
    found = [(index, opener) for opener in _OPENERS if (index := text.find(opener, pos)) >= 0]
    first = _skip_space(text, pos)
    if leading and text.startswith("{", first):
        found.append((first, ""))
    if found:
        return min(found)
    if final:
        return len(text), None
    if leading and text[pos:].isspace():
        return pos, None
    longest = max(map(len, _OPENERS))
    starts = range(max(pos, len(text) - longest + 1), len(text))
    return next((i for i in starts if any(o.startswith(text[i:]) for o in _OPENERS)), len(text)), None


def _skip_space(text: str, pos: int) -> int:
    return _SPACES.match(text, pos).end()


def _read_block(
    text: str, start: int, opener: str, names: frozenset[str], *, final: bool, cut: bool
) -> _Block | None:
    """The verdict on the block at ``start`` (its opener, call objects apart by whitespace, its
    closer), or None while the text so far cannot tell."""
    not_a_call = _Block(start + (len(opener) or 1), None)
    pos, closer = _open(text, start, opener)
    if pos == len(text) and not final:
        return None
    if opener == "```" and text[start + 3 : pos].lower() not in _FENCE_LANGUAGES:
        return not_a_call
    calls: list[ToolCall] = []
    while text.startswith("{", pos := _skip_space(text, pos)):
        marked = opener == CALL_OPEN or bool(calls)
        read = _read_call(text, pos, names, marked=marked, final=final, cut=cut)
        if read is None:
            return None
        if read.calls is None:
            return not_a_call
        calls += read.calls
        if not read.calls or not closer:  # a call cut short, or a bare object's one call
            return _Block(read.end, calls)
        pos = read.end
    rest = text[pos:]
    if calls and closer and rest.startswith(closer):
        return _Block(pos + len(closer), calls)
    if rest and not (calls and closer.startswith(rest)):
        return not_a_call
    # The text ends: the closer of calls is missing, or a marker was cut before its call began.
    return _ended(text, final, bool(calls) or (cut and opener == CALL_OPEN), calls, not_a_call)


def _open(text: str, start: int, opener: str) -> tuple[int, str]:
    """Where the block's first object may begin (past the opener and a fence's language tag, or
    past a bare object's outer brace when it is doubled), and the closer that ends the block."""
    if opener == "```":
        return _FENCE_TAG.match(text, start + 3).end(), "```"
    if opener:
        return start + len(opener), _OPENERS[opener]
    inner = _skip_space(text, start + 1)
    if inner == len(text) or text[inner] == "{":  # Qwen2.5's template shows a call as {{"name": ...}}
        return inner, "}"
    return start, ""


def _read_call(
    text: str, pos: int, names: frozenset[str], *, marked: bool, final: bool, cut: bool
) -> _Block | None:
    """The verdict on the object at ``pos``: one call, or none, or None while the text so far cannot
    tell. ``marked``: a ``<tool_call>`` marker or a call precedes it, so a head cut short is a call's."""
    not_a_call = _Block(pos, None)
    head = _head_verdict(text, pos, names)
    if head is None:
        return _ended(text, final, cut and marked, [], not_a_call)
    if not head:
        return not_a_call
    end, in_string, closers = _scan_object(text, pos)
    if end is None:
        return _ended(text, final, cut and _is_cut_json(text[pos:], in_string, closers), [], not_a_call)
    call = _call_from_json(text[pos:end], names)
    return not_a_call if call is None else _Block(end, [call])


def _ended(text: str, final: bool, kept: bool, calls: list[ToolCall], not_a_call: _Block) -> _Block | None:
    """The verdict when the text ends first: none yet unless ``final``; then, when ``kept``, the block
    ends with the text and keeps ``calls`` (dropping what it cut short), else it is no call."""
    if not final:
        return None
    return _Block(len(text), calls) if kept else not_a_call


def _head_verdict(text: str, pos: int, names: frozenset[str]) -> bool | None:
    """Whether the object at ``pos`` begins ``{"name": "<one of names>"`` (whitespace allowed between
    tokens): True, False, or None when the text ends too soon to tell."""
    for piece in ("{", '"name"', ":", '"'):
        pos = _skip_space(text, pos)
        chunk = text[pos : pos + len(piece)]
        if not piece.startswith(chunk):
            return False
        if len(chunk) < len(piece):
            return None
        pos += len(piece)
    end = text.find('"', pos)
    if end < 0:
        return None if any(name.startswith(text[pos:]) for name in names) else False
    return text[pos:end] in names


def _scan_object(text: str, pos: int) -> tuple[int | None, bool, str]:
    """Where the JSON object at ``pos`` ends (strings and nesting tracked), or None and what the end of
    the text leaves open: whether a string, and the closers of the open brackets, innermost first."""
    closers = ""
    for token in _JSON_TOKEN.finditer(text, pos):
        mark = token.group()
        if mark[0] == '"' and token.group(1) is None:
            return None, True, closers
        if mark in ("{", "["):
            closers = ("}" if mark == "{" else "]") + closers
        elif mark in ("}", "]"):
            closers = closers[1:]
        if not closers:
            return token.end(), False, ""
    return None, False, closers


def _is_cut_json(text: str, in_string: bool, closers: str) -> bool:
    """Whether the unfinished object ``text`` is the start of valid JSON (some completion a cut can need
    parses), so a cut call rather than malformed text the model went on after."""
    string_ends = _STRING_ENDS if in_string else ("",)
    return any(
        _parses(text + string_end + value_end + closers)
        for string_end in string_ends
        for value_end in _VALUE_ENDS
    )


# What a valid JSON text cut at any point needs before its brackets close: inside a string, an
# escape's rest and the quote; then nothing, a key's colon and value, a value, or a cut literal's
# or number's rest.
_STRING_ENDS = ('"', 'n"', '0000"', '000"', '00"', '0"')
_VALUE_ENDS = ("", ":0", '"":0', "0", "rue", "ue", "e", "ull", "ll", "l", "alse", "lse", "se")


def _parses(text: str) -> bool:
    try:
        json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        return False
    return True


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _call_from_json(text: str, names: frozenset[str]) -> ToolCall | None:
    """The call ``text`` spells if it is a call object of a known tool, with compact arguments."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    given = [key for key in ("arguments", "parameters") if key in value]
    if set(value) - {"name", "arguments", "parameters"} or len(given) > 1:
        return None
    arguments = _arguments_object(value[given[0]]) if given else {}
    if arguments is None:
        return None
    compact = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
    return ToolCall(new_call_id(), value["name"], compact)


def _arguments_object(arguments: Any) -> dict[str, Any] | None:
    """Arguments as an object; a JSON string holding an object is decoded (OpenAI's own shape,
    which models copy from their prompts); "" means none."""
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments, parse_constant=_refuse_constant)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None
