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
  :class:`ToolCallStream` does the same on a stream of text deltas, and the two agree on every
  chunking of the same text (one is the other fed in one piece).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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
            rules.append(f'fn_{index}: {head} %json {_laid_out(function.parameters)} "}}"')
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


def _laid_out(schema: dict[str, Any]) -> str:
    """The schema as JSON with our layout options (llguidance reads them from a top-level
    ``x-guidance`` key; ours win over the caller's, since the parser relies on nothing but JSON)."""
    given = schema.get("x-guidance")
    options = {**(given if isinstance(given, dict) else {}), **JSON_LAYOUT}
    return json.dumps({**schema, "x-guidance": options})


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
    return ToolFunction(
        name=_function_name(f"{where}.function.name", function.get("name")),
        description=_optional(f"{where}.function.description", function.get("description"), str, "a string"),
        parameters=_parameters(f"{where}.function.parameters", function.get("parameters")),
        strict=bool(_optional(f"{where}.function.strict", function.get("strict"), bool, "a boolean")),
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


def _parameters(where: str, schema: Any) -> dict[str, Any]:
    """The arguments' schema, made an object schema: arguments are always a JSON object."""
    if schema is None:
        return {"type": "object"}
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
    problem = _schema_problem(schema_json)
    if problem:
        raise InvalidSettingError(f"{where} cannot be enforced: {problem}", param="tools")
    return schema


@lru_cache(maxsize=256)
def _schema_problem(schema_json: str) -> str:
    """llguidance's complaint about a schema laid out as the grammar embeds it ("" when none).
    Cached on the schema's text: agents send the same tools with every turn."""
    grammar = LLMatcher.grammar_from_json_schema(_laid_out(json.loads(schema_json)))
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
    stream = ToolCallStream(tool_names, calls_only=calls_only)
    events = stream._settle(text, final=True, cut=cut)
    content = "".join(event for event in events if isinstance(event, str))
    return content or None, [event for event in events if isinstance(event, ToolCall)]


class ToolCallStream:
    """:func:`parse_tool_calls` over a stream: ``feed(text_delta)`` and ``finish()`` return
    :class:`ContentDelta` and :class:`ToolCallDelta` items.

    Text that may begin a call (a prefix of an opener, or a block not yet closed) is held back
    until it is settled, so markup never reaches the content. A call is emitted once its block is
    complete: a first fragment with id and name, then one with all its arguments. Whitespace
    is held too: dropped at the start and the end of the reply, so the concatenated content is
    exactly :func:`parse_tool_calls`'s (``calls_only`` as there).
    """

    def __init__(self, tool_names: Iterable[str], *, calls_only: bool = False) -> None:
        self._names = frozenset(tool_names)
        self._calls_only = calls_only
        self._text = ""  # received, not yet settled
        self._block: _Block | None = None  # the candidate call block _text starts with
        self._space = ""  # trailing whitespace of the content so far, held
        self._content_seen = False  # has any non-space content been emitted?
        self._calls = 0

    def feed(self, text_delta: str) -> list[Delta]:
        return self._deltas(self._settle(text_delta, final=False))

    def finish(self, cut: bool = False) -> list[Delta]:
        """The rest, the reply being over; ``cut`` as in :func:`parse_tool_calls`."""
        return self._deltas(self._settle("", final=True, cut=cut))

    def _settle(self, text_delta: str, *, final: bool, cut: bool = False) -> list[str | ToolCall]:
        """Settled content strings and calls after appending ``text_delta``; ``final`` settles
        everything (the reply is over; ``cut``: not by the model)."""
        self._text += text_delta
        events: list[str | ToolCall] = []
        while self._text:
            if self._block is None and not self._start_block(events, final):
                break
            outcome = self._block.advance(self._text, final, cut)
            if outcome is _MORE:
                break
            if outcome is _NOT_A_CALL:
                # Only the opener is content for sure: the rest is scanned again, and may hold a call.
                self._content(self._block.opener or self._text[0], events)
                self._text = self._text[len(self._block.opener) or 1 :]
            else:
                events += [ToolCall(new_call_id(), name, arguments) for name, arguments in self._block.calls]
                self._text = self._text[outcome:]
            self._block = None
        return events

    def _start_block(self, events: list[str | ToolCall], final: bool) -> bool:
        """Emit the content before the next possible call and start reading it there; False when
        there is none yet (the rest is content, or a prefix of an opener held for more text)."""
        start, opener = _next_candidate(self._text, leading=not self._content_seen, final=final)
        self._content(self._text[:start], events)
        self._text = self._text[start:]
        if opener is None:
            return False
        self._block = _Block(opener, self._names)
        return True

    def _content(self, text: str, events: list[str | ToolCall]) -> None:
        if self._calls_only:
            # The grammar allowed nothing but calls: this is one cut short. It still counts as
            # seen, so a later bare object is judged alike on every chunking.
            self._content_seen = self._content_seen or bool(text.strip())
            return
        pending = self._space + text
        body = pending.rstrip()
        if not body:
            self._space = pending
            return
        if not self._content_seen:
            body = body.lstrip()
        self._space = pending[len(pending.rstrip()) :]
        self._content_seen = True
        if events and isinstance(events[-1], str):
            events[-1] += body  # one delta per feed, not one per settled piece
        else:
            events.append(body)

    def _deltas(self, events: list[str | ToolCall]) -> list[Delta]:
        deltas: list[Delta] = []
        for event in events:
            if isinstance(event, str):
                deltas.append(ContentDelta(event))
                continue
            deltas.append(ToolCallDelta(self._calls, event.id, event.name, ""))
            deltas.append(ToolCallDelta(self._calls, None, None, event.arguments))
            self._calls += 1
        return deltas


# --- recognising call blocks --------------------------------------------------------------------

# The markup a call block may open with, and what closes it. A bare object has neither.
_CLOSERS = {CALL_OPEN: CALL_CLOSE, "<tools>": "</tools>", "```": "```"}
_FENCE_LANGUAGES = ("", "json", "tool_call")
_MORE = object()  # cannot tell yet
_NOT_A_CALL = object()
_CUT = object()  # the generation was cut inside a call: drop it
_SPACE = " \t\r\n"


def _next_candidate(text: str, *, leading: bool, final: bool) -> tuple[int, str | None]:
    """Where the next call block may start in ``text``, and its opener ("" for a bare object);
    (index, None) when none starts there: ``text[index:]`` is a proper prefix of an opener held
    for more text, or the end of the text."""
    found = [(index, opener) for opener in _CLOSERS if (index := text.find(opener)) >= 0]
    if leading:
        first = len(text) - len(text.lstrip(_SPACE))
        if text[first : first + 1] == "{":
            found.append((first, ""))
    if found:
        return min(found, key=lambda item: item[0])
    if final:
        return len(text), None
    return _held_prefix(text), None


def _held_prefix(text: str) -> int:
    """The start of the longest tail of ``text`` that an opener begins with (len(text) if none)."""
    for start in range(max(0, len(text) - max(map(len, _CLOSERS)) + 1), len(text)):
        if any(opener.startswith(text[start:]) for opener in _CLOSERS):
            return start
    return len(text)


class _Block:
    """One candidate call block read from the start of the held text: its opener, one or more
    call objects separated by whitespace, and its closer (a bare object is one object alone, or
    the objects inside a second pair of braces up to its closing one).

    ``advance(text, final, cut)`` is called with the same text growing; it returns _MORE,
    _NOT_A_CALL, or the length of the block, with ``calls`` then holding (name, arguments) pairs. Every
    verdict depends only on the text it has seen, so feeding the text in any chunks gives the
    same verdicts as feeding it whole.
    """

    def __init__(self, opener: str, names: frozenset[str]) -> None:
        self.opener = opener
        self.closer = _CLOSERS.get(opener, "")
        self.names = names
        self.calls: list[tuple[str, str]] = []
        self.pos = 0
        self.reader: _ObjectReader | None = None
        self.opened = False
        self.doubled = False  # a bare object inside a second pair of braces

    def advance(self, text: str, final: bool, cut: bool = False) -> Any:
        if not self.opened:
            opened = self._open(text, final)
            if opened is not True:
                return opened
        while True:
            if self.reader is not None:
                outcome = self.reader.advance(text, final, cut)
                if outcome is _CUT:
                    return len(text)  # the calls before it stand; the rest goes
                if not isinstance(outcome, tuple):
                    return outcome
                self.pos, call = outcome
                self.calls.append(call)
                self.reader = None
                if not self.opener and not self.doubled:
                    return self.pos
            outcome = self._between_objects(text, final, cut)
            if outcome is not None:
                return outcome

    def _open(self, text: str, final: bool) -> Any:
        """Match the opener (and a fence's language tag); True once past it."""
        if len(text) < len(self.opener):
            return _NOT_A_CALL if final or not self.opener.startswith(text) else _MORE
        if not text.startswith(self.opener):
            return _NOT_A_CALL
        self.pos = len(self.opener)
        if self.opener == "```":
            language = re.match(r"[A-Za-z_]*", text[self.pos :]).group()
            if self.pos + len(language) == len(text) and not final:
                return _MORE  # the tag may go on
            if language.lower() not in _FENCE_LANGUAGES:
                return _NOT_A_CALL
            self.pos += len(language)
        self.opened = True
        return True

    def _between_objects(self, text: str, final: bool, cut: bool) -> Any:
        """After the opener or an object: the next object starts (None: go on reading it), the
        closer ends the block, or something else means this is no call block."""
        position = self.pos
        while position < len(text) and text[position] in _SPACE:
            position += 1
        rest = text[position:]
        if not self.opener and not self.calls and not self.doubled and rest.startswith("{"):
            inner = rest[1:].lstrip(_SPACE)
            if not inner and not final:
                return _MORE  # a brace alone: an object, or the first of two
            if inner.startswith("{"):
                # Qwen2.5's template shows a call as {{"name": ...}}, and small models copy it.
                self.doubled, self.closer = True, "}"
                position = len(text) - len(inner)
                rest = inner
        if rest.startswith("{"):
            self.pos = position
            marked = self.opener == CALL_OPEN or bool(self.calls)
            self.reader = _ObjectReader(position, self.names, marked=marked)
            return None
        if self.calls and self.closer and rest.startswith(self.closer):
            return position + len(self.closer)
        if not final and (not rest or (self.calls and self.closer.startswith(rest))):
            return _MORE
        # A call whose closing marker never came (or came cut short) at the very end of the reply
        # still counts; a call marker with nothing after it is a call cut before it began.
        if final and self.calls and self.closer.startswith(rest):
            return len(text)
        if final and not rest and cut and self.opener == CALL_OPEN:
            return position
        return _NOT_A_CALL


class _ObjectReader:
    """Reads one JSON object starting at ``start``: refuses it as soon as its head cannot be
    ``{"name": "<known tool>"``, and finds its end incrementally (strings and nesting tracked).
    ``marked``: the object follows a ``<tool_call>`` marker or a call, so a head cut short is a
    call's."""

    _STRUCTURE = re.compile(r'["{}\[\]]')
    _IN_STRING = re.compile(r'["\\]')

    def __init__(self, start: int, names: frozenset[str], *, marked: bool = False) -> None:
        self.start = start
        self.names = names
        self.marked = marked
        self.pos = start
        self.open = ""  # the brackets open at pos, innermost last
        self.in_string = False
        self.head_known = False

    def advance(self, text: str, final: bool, cut: bool = False) -> Any:
        """_MORE, _NOT_A_CALL, _CUT (only when ``final`` and ``cut``), or (end, (name, arguments))."""
        if not self.head_known:
            verdict = _head_verdict(text[self.start :], self.names)
            if verdict is None:
                return (_CUT if self.marked and cut else _NOT_A_CALL) if final else _MORE
            if not verdict:
                return _NOT_A_CALL
            self.head_known = True
        end = self._scan(text)
        if end is None:
            if not final:
                return _MORE
            return _CUT if cut and self._is_cut_json(text[self.start :]) else _NOT_A_CALL
        call = _call_from_json(text[self.start : end], self.names)
        return _NOT_A_CALL if call is None else (end, call)

    def _scan(self, text: str) -> int | None:
        """The index just past the object's closing brace, or None if it has not come yet."""
        while True:
            pattern = self._IN_STRING if self.in_string else self._STRUCTURE
            match = pattern.search(text, self.pos)
            if match is None:
                return None
            char, self.pos = match.group(), match.end()
            if self.in_string:
                if char == "\\":
                    if self.pos >= len(text):
                        self.pos -= 1  # the escaped character has not arrived: look again later
                        return None
                    self.pos += 1
                else:
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.open += char
            else:
                self.open = self.open[:-1]
                if not self.open:
                    return self.pos

    def _is_cut_json(self, text: str) -> bool:
        """Whether ``text`` (scanned to its end, no object end found) is the start of some valid
        JSON: one of the few completions a cut can need, then the open strings and brackets
        closed, parses. Malformed text the model went on after is no cut call."""
        closers = "".join("}" if bracket == "{" else "]" for bracket in reversed(self.open))
        string_ends = _STRING_ENDS if self.in_string else ("",)
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


def _head_verdict(head: str, names: frozenset[str]) -> bool | None:
    """Whether an object starting ``head`` begins ``{"name": "<one of names>"`` (whitespace
    allowed between tokens): True, False, or None when ``head`` is too short to tell."""
    position = 0
    for piece in ("{", '"name"', ":", '"'):
        while position < len(head) and head[position] in _SPACE:
            position += 1
        chunk = head[position : position + len(piece)]
        if not piece.startswith(chunk):
            return False
        if len(chunk) < len(piece):
            return None
        position += len(piece)
    end = head.find('"', position)
    if end < 0:
        partial = head[position:]
        return None if any(name.startswith(partial) for name in names) else False
    return head[position:end] in names


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _call_from_json(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, compact arguments) if ``text`` is a call object of a known tool, else None."""
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
    return value["name"], json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)


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
