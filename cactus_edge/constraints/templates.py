"""Chat templates: rendering conversations with the template a GGUF stores, and turning them into
tokens (:class:`Prompts` does both for one target model; it shares no buffer with decoding, so
other threads may build prompts while a generation runs).

Templates come from files users download, so they run in Jinja's immutable sandbox: a template can
format text but cannot reach Python objects or mutate what it is given.

Tokenizing the rendered prompt with special-token parsing on would let a user who types
``<|im_end|><|im_start|>system`` forge real control tokens. ``tokenize_chat`` therefore keeps track
of which characters came from the template and which from the messages: only the template's own
markup may become control tokens, message contents are always tokenized as plain text.

Tool calls are user data of the same kind: the strings inside an assistant message's tool-call
arguments and inside the ``tools`` definitions (which templates write through ``tojson``), and a
``role: "tool"`` message's content, are tokenized as plain text too.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import CactusEdgeError

logger = logging.getLogger(__name__)

# Used when a GGUF carries no template: ChatML, which most instruction-tuned models understand.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# tokenize(text, parse_special) -> ids, never adding BOS.
Tokenize = Callable[[str, bool], list[int]]
# One piece of a rendered prompt: its text and, for a message's content, the message's index.
Piece = tuple[str, int | None]


class ChatTemplateError(CactusEdgeError):
    """The model's chat template failed to render these messages, or they cannot be tokenized
    safely (malformed content, control-token text where the template would parse it)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False, **_: Any) -> str:
    """Jinja's own ``tojson`` escapes ``<``, ``>``, ``&`` and ``'`` for HTML, so a tool described
    as ``a < b`` would reach the model as ``a \\u003c b``. Templates are written for
    transformers' ``tojson``, plain ``json.dumps`` with non-ASCII kept: so is this one."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _check_messages(messages: list[dict[str, Any]]) -> None:
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatTemplateError(f"message {index} needs 'role' and 'content'")
        if "content" not in message and not _calls_tools(message):
            raise ChatTemplateError(f"message {index} needs 'role' and 'content'")


def _calls_tools(message: dict[str, Any]) -> bool:
    """An assistant message carrying tool calls, whose content OpenAI allows to be null or absent."""
    calls = message.get("tool_calls")
    return isinstance(calls, list) and len(calls) > 0


def _for_template(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """The message as templates expect it. A tool-call message without content gets ``""`` (a
    template writing ``message.content`` would print ``None``), and each call's arguments become
    the object they encode: OpenAI sends a JSON string, templates write ``arguments | tojson``
    (Qwen2.5, Hermes, Llama 3.x), which would quote that string a second time."""
    if not _calls_tools(message):
        return message
    content = message.get("content")
    calls = [_call_for_template(index, number, call) for number, call in enumerate(message["tool_calls"])]
    return {**message, "content": "" if content is None else content, "tool_calls": calls}


def _call_for_template(index: int, number: int, call: Any) -> dict[str, Any]:
    """One tool call, OpenAI's ``{"id", "type", "function": {"name", "arguments"}}`` or a bare
    ``{"name", "arguments"}``, with its arguments decoded."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ChatTemplateError(f"message {index}: tool call {number} must be an object with a 'function'")
    decoded = {**function, "arguments": _decoded_arguments(function.get("arguments"))}
    return {**call, "function": decoded} if "function" in call else decoded


def _decoded_arguments(arguments: Any) -> Any:
    """A JSON string that holds an object becomes that object; anything else stays as it is (an
    invalid string is then at least written as the model sent it)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return arguments
    return decoded if isinstance(decoded, dict) else arguments


def _template_or_fallback(template: str | None) -> str:
    if not template:
        logger.warning("the model has no chat template; using ChatML")
        return FALLBACK_TEMPLATE
    return template


def _render(
    messages: list[dict[str, Any]],
    template: str,
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool,
    tools: list[Any] | None = None,
) -> str:
    # Without tools the variable stays undefined, as before: templates test `tools is defined`.
    extra = {} if tools is None else {"tools": tools}
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except TemplateError as error:
        raise ChatTemplateError(f"the chat template failed: {error}") from error


def render_chat(
    messages: list[dict[str, Any]],
    template: str | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for ``messages`` (dicts with ``role`` and ``content``; an assistant message
    may carry OpenAI ``tool_calls`` with content None, a ``role: "tool"`` message gives a call's
    result) and OpenAI ``tools`` (``[{"type": "function", "function": {...}}]``, the template's
    ``tools`` variable).

    Text only: tokenizing it with special-token parsing on trusts the message contents; use
    ``tokenize_chat`` for prompts built from user input."""
    _check_messages(messages)
    return _render(
        [_for_template(index, message) for index, message in enumerate(messages)],
        _template_or_fallback(template),
        bos_token=bos_token,
        eos_token=eos_token,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
    )


# --- tokenizing a conversation ------------------------------------------------------------------


def tokenize_chat(
    messages: list[dict[str, Any]],
    template: str | None,
    tokenize: Callable[[str, bool], list[int]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    bos_id: int | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the chat prompt for ``messages`` (and OpenAI ``tools``, as in ``render_chat``),
    where only the template's markup can produce control tokens.

    The template is rendered twice: once as usual, once with every user text replaced by a random
    sentinel. User texts are the message contents, and the strings inside tool-call arguments and
    tool definitions. Splitting the second rendering at the sentinels separates the template's
    markup from the user texts. If putting the texts back where the sentinels were reproduces the
    usual rendering exactly (contents as given or each stripped, for templates that ``trim``;
    strings of JSON values escaped as ``tojson`` writes them, or as they are), that split is
    trusted: user texts are tokenized with ``parse_special=False``, markup with ``True``. Text
    around a user text up to the neighbouring control tokens is tokenized together with it, so an
    ordinary conversation gets the same ids as the whole rendering tokenized at once.

    Otherwise the template rewrites user texts in a way the split cannot follow. The whole
    rendering is then tokenized with special parsing, which is safe only when no user text
    contains control-token text; if one does, ``ChatTemplateError`` names it rather than guess.

    Other strings of a message (role, name, a tool call's name and id, keys, ...) and of the tools
    land in the template's markup, so control-token text in them is refused. A content may be a
    list of OpenAI ``{"type": "text"}`` parts, joined with newlines; other part types are refused.
    ``bos_id`` is prepended unless the ids already start with it (the template wrote
    ``bos_token`` itself).
    """
    _check_messages(messages)
    conversation = _Conversation(messages, tools)
    has_control = _control_detector(tokenize)
    for index, message in enumerate(conversation.messages):
        _refuse_control_outside_content(index, message, has_control)
    _refuse_control_in_tools(conversation.tools, has_control)
    template = _template_or_fallback(template)

    def render(texts: list[str]) -> str:
        filled_messages, filled_tools = conversation.filled(texts)
        return _render(
            filled_messages,
            template,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            tools=filled_tools,
        )

    texts = [user_text.text for user_text in conversation.texts]
    rendered = render(texts)
    known = [template, bos_token, eos_token, *texts, *_strings(messages), *_strings(tools)]
    pieces = _marked_pieces(render, len(texts), known)
    ids = _tokenize_rendering(rendered, pieces, conversation.texts, tokenize, has_control)
    return ids if bos_id is None or ids[:1] == [bos_id] else [bos_id, *ids]


@dataclass(frozen=True)
class _UserText:
    """A string of user data that the template writes: a message content (``in_json`` False), or
    a string inside tool-call arguments or tool definitions (``in_json``: templates write those
    through ``tojson``, escaped). ``owner`` names it in errors."""

    text: str
    owner: str
    in_json: bool


@dataclass(frozen=True)
class _Slot:
    """The place of user text ``index`` in the conversation handed to the template."""

    index: int


class _Conversation:
    """Messages and tools as the template gets them, each user text replaced by a :class:`_Slot`;
    ``texts`` holds the user texts in slot order. Empty strings stay as they are: they carry
    nothing, and templates test contents for truthiness (``if message.content``), which a sentinel
    would answer differently."""

    def __init__(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> None:
        self.texts: list[_UserText] = []
        self.messages = [self._message(index, message) for index, message in enumerate(messages)]
        self.tools = (
            None if tools is None else [self._json(tool, f"tools[{n}]") for n, tool in enumerate(tools)]
        )

    def filled(self, texts: list[str]) -> tuple[list[dict[str, Any]], list[Any] | None]:
        """(messages, tools) with ``texts[i]`` in slot i."""
        return _fill(self.messages, texts), _fill(self.tools, texts)

    def _slot(self, text: str, owner: str, in_json: bool) -> _Slot | str:
        if not text:
            return text
        self.texts.append(_UserText(text, owner, in_json))
        return _Slot(len(self.texts) - 1)

    def _message(self, index: int, message: dict[str, Any]) -> dict[str, Any]:
        message = _for_template(index, message)
        content = self._slot(_content_text(index, message["content"]), f"message {index}", False)
        if not _calls_tools(message):
            return {**message, "content": content}
        calls = [self._call(index, number, call) for number, call in enumerate(message["tool_calls"])]
        return {**message, "content": content, "tool_calls": calls}

    def _call(self, index: int, number: int, call: dict[str, Any]) -> dict[str, Any]:
        """A tool call with the strings of its arguments as slots; its name and id are markup."""
        function = call.get("function", call)
        arguments = self._json(function.get("arguments"), f"message {index} tool call {number}")
        replaced = {**function, "arguments": arguments}
        return {**call, "function": replaced} if "function" in call else replaced

    def _json(self, value: Any, owner: str) -> Any:
        """A JSON value with each string value a slot (keys stay: they are refused if they hold
        control-token text, like the rest of the markup)."""
        if isinstance(value, str):
            return self._slot(value, owner, True)
        if isinstance(value, dict):
            return {key: self._json(item, owner) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._json(item, owner) for item in value]
        return value


def _fill(value: Any, texts: list[str]) -> Any:
    if isinstance(value, _Slot):
        return texts[value.index]
    if isinstance(value, dict):
        return {key: _fill(item, texts) for key, item in value.items()}
    if isinstance(value, list):
        return [_fill(item, texts) for item in value]
    return value


def _marked_pieces(render: Callable[[list[str]], str], count: int, known: list[str]) -> list[Piece] | None:
    """The template rendered with a sentinel for each of ``count`` user texts, cut at the
    sentinels; None when the template fails on sentinels (it inspects contents), which leaves the
    fallback."""
    sentinels = _sentinels(count, known)
    try:
        marked = render(sentinels)
    except ChatTemplateError:
        return None
    return _split_at_sentinels(marked, sentinels)


def _tokenize_rendering(
    rendered: str,
    pieces: list[Piece] | None,
    user_texts: list[_UserText],
    tokenize: Tokenize,
    has_control: Callable[[str], bool],
) -> list[int]:
    """Tokenize along the sentinel split when it reproduces the real rendering with the user texts
    written in one of the ways templates write them; otherwise fall back to the whole text."""
    if pieces is not None:
        for shown in _written_forms(user_texts):
            if _assemble(pieces, shown) == rendered:
                return _tokenize_pieces(pieces, shown, tokenize, has_control)
    return _tokenize_rewritten(rendered, user_texts, tokenize, has_control)


def _written_forms(user_texts: list[_UserText]) -> Iterator[list[str]]:
    """The user texts as a template may have written them: contents as given or stripped
    (templates that ``trim``), strings of JSON values escaped as ``tojson`` escapes them, or
    as they are (templates that write an argument's value directly)."""
    for strip_contents, escape_json in ((False, True), (True, True), (False, False)):
        yield [_written(user_text, strip_contents, escape_json) for user_text in user_texts]


def _written(user_text: _UserText, strip_contents: bool, escape_json: bool) -> str:
    if user_text.in_json:
        return _json_escaped(user_text.text) if escape_json else user_text.text
    return user_text.text.strip() if strip_contents else user_text.text


def _json_escaped(text: str) -> str:
    """``text`` as it appears inside a JSON string written by ``tojson``."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _content_text(index: int, content: Any) -> str:
    """A message's content as one string: OpenAI clients may send a list of typed parts, and
    only text parts mean anything to a text model."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"message {index}: content must be a string or a list of text parts, not {type(content).__name__}"
        )
    return "\n".join(_part_text(index, number, part) for number, part in enumerate(content))


def _part_text(index: int, number: int, part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind != "text":
        raise ChatTemplateError(
            f"message {index}: content part {number} is {kind!r}; only text parts are supported"
        )
    if not isinstance(part.get("text"), str):
        raise ChatTemplateError(f"message {index}: content part {number} has no string 'text'")
    return part["text"]


def _control_detector(tokenize: Tokenize) -> Callable[[str], bool]:
    """Whether a text contains control-token text: only then does special parsing change its ids,
    because llama.cpp's plain tokenization differs from the special one only by not cutting
    control-token text out first."""

    @lru_cache(maxsize=4096)
    def has_control(text: str) -> bool:
        return text != "" and tokenize(text, True) != tokenize(text, False)

    return has_control


def _strings(value: Any) -> Iterator[str]:
    """Every string nested in a value: dict keys and values, list items, recursively."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _refuse_control_outside_content(
    index: int, message: dict[str, Any], has_control: Callable[[str], bool]
) -> None:
    """Roles, names and other fields are written into the markup, which is tokenized with special
    parsing: a role of ``user<|im_end|>...`` would forge control tokens just as a content could.
    ``message`` is the template's view, user texts already replaced by slots."""
    for key, value in message.items():
        if key != "content" and any(has_control(text) for text in _strings({key: value})):
            raise ChatTemplateError(f"message {index}: {key!r} contains control-token text")


def _refuse_control_in_tools(tools: list[Any] | None, has_control: Callable[[str], bool]) -> None:
    """The tools' keys land in the markup too (their string values are slots)."""
    for number, tool in enumerate(tools or []):
        if any(has_control(text) for text in _strings(tool)):
            raise ChatTemplateError(f"tools[{number}] contains control-token text")


def _sentinels(count: int, texts: list[str]) -> list[str]:
    """One marker per message, absent from the template and every message string. Digits between
    private-use characters survive case changes and stripping, so a template's harmless string
    filters leave them recognisable."""
    while True:
        nonce = f"{secrets.randbits(64):020d}"
        if not any(nonce in text for text in texts):
            return [f"\ue000{nonce}:{index}\ue001" for index in range(count)]


def _split_at_sentinels(marked: str, sentinels: list[str]) -> list[Piece]:
    """The sentinel rendering cut into markup pieces (index None) and content slots (index)."""
    if not sentinels:
        return [(marked, None)]
    slot = {sentinel: index for index, sentinel in enumerate(sentinels)}
    pattern = "(" + "|".join(re.escape(sentinel) for sentinel in sentinels) + ")"
    parts = re.split(pattern, marked)
    # re.split with one group alternates: markup, sentinel, markup, ..., markup.
    return [(part, slot[part] if odd else None) for odd, part in _alternating(parts) if part]


def _alternating(parts: list[str]) -> Iterator[tuple[bool, str]]:
    for position, part in enumerate(parts):
        yield position % 2 == 1, part


def _assemble(pieces: list[Piece], contents: list[str]) -> str:
    return "".join(text if index is None else contents[index] for text, index in pieces)


def _tokenize_pieces(
    pieces: list[Piece], contents: list[str], tokenize: Tokenize, has_control: Callable[[str], bool]
) -> list[int]:
    """Tokenize markup with special parsing and contents without.

    llama.cpp cuts a prompt at control tokens and tokenizes each stretch of text between them on
    its own (SentencePiece vocabularies even prefix each stretch with a space). Cutting at the
    content's edges instead would tokenize ``user\\n`` and ``hello`` apart; so the plain text of
    the markup up to the nearest control token joins the content's stretch."""
    segments: list[tuple[str, bool]] = []
    for text, index in pieces:
        if index is not None:
            segments.append((contents[index], False))
            continue
        span = _control_span(text, has_control)
        if span is None:
            segments.append((text, False))
        else:
            start, end = span
            segments += [(text[:start], False), (text[start:end], True), (text[end:], False)]
    ids: list[int] = []
    for text, parse_special in _merge_plain(segments):
        ids += tokenize(text, parse_special)
    return ids


def _merge_plain(segments: list[tuple[str, bool]]) -> Iterator[tuple[str, bool]]:
    """Adjacent plain segments as one text, empty ones dropped."""
    plain = ""
    for text, parse_special in segments:
        if not parse_special:
            plain += text
            continue
        if plain:
            yield plain, False
            plain = ""
        if text:
            yield text, True
    if plain:
        yield plain, False


def _control_span(text: str, has_control: Callable[[str], bool]) -> tuple[int, int] | None:
    """Where a piece of markup's first control token starts and its last one ends, or None.

    Containing control-token text is monotone (a longer string contains what a shorter one does),
    so each edge is a binary search over a few tokenizations."""
    if not has_control(text):
        return None
    first_end = _first_true(1, len(text), lambda k: has_control(text[:k]))
    first_start = _last_true(0, first_end - 1, lambda s: has_control(text[s:first_end]))
    last_start = _last_true(first_start, len(text) - 1, lambda s: has_control(text[s:]))
    last_end = _first_true(last_start + 1, len(text), lambda k: has_control(text[last_start:k]))
    return first_start, last_end


def _first_true(low: int, high: int, predicate: Callable[[int], bool]) -> int:
    """Smallest k in [low, high] with predicate(k), for a predicate false then true; high if none."""
    while low < high:
        middle = (low + high) // 2
        if predicate(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _last_true(low: int, high: int, predicate: Callable[[int], bool]) -> int:
    """Largest k in [low, high] with predicate(k), for a predicate true then false; low if none."""
    while low < high:
        middle = (low + high + 1) // 2
        if predicate(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _tokenize_rewritten(
    rendered: str, user_texts: list[_UserText], tokenize: Tokenize, has_control: Callable[[str], bool]
) -> list[int]:
    """The template changes user texts beyond stripping (slicing, replacing, branching on them), so
    where each ends up is unknown. Special parsing of the whole text is then safe only if no user
    text carries control-token text (as given or as ``tojson`` writes it); one that does is
    refused, not guessed at."""
    for user_text in user_texts:
        written = [user_text.text, _json_escaped(user_text.text)] if user_text.in_json else [user_text.text]
        if any(has_control(text) for text in written):
            raise ChatTemplateError(
                f"{user_text.owner} contains control-token text, and the chat template rewrites "
                "message contents, so it cannot be kept apart from the template's markup"
            )
    logger.debug("the chat template rewrites message contents; tokenizing the whole prompt")
    return tokenize(rendered, True)


class Prompts:
    """Rendering and tokenization over one target model (a LlamaModel or anything with the same
    vocabulary methods)."""

    def __init__(self, target) -> None:
        self.target = target

    def special_text(self, token: int) -> str:
        return self.target.detokenize([token], special=True) if token >= 0 else ""

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None) -> str:
        return render_chat(
            messages,
            self.target.chat_template,
            bos_token=self.special_text(self.target.bos_token),
            eos_token=self.special_text(self.target.eos_token),
            tools=tools,
        )

    def tokenize_chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        target = self.target
        return tokenize_chat(
            messages,
            target.chat_template,
            lambda text, special: target.tokenize(text, add_special=False, parse_special=special),
            bos_token=self.special_text(target.bos_token),
            eos_token=self.special_text(target.eos_token),
            bos_id=target.bos_token if target.add_bos and target.bos_token >= 0 else None,
            tools=tools,
        )

    def tokenize_prompt(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Raw prompt ids. With ``chat`` (text the caller rendered itself, or a `--raw` prompt)
        control-token text such as ``<|im_start|>`` becomes the control token; without it, it
        stays text. Token ids pass through."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        bos = self.special_text(self.target.bos_token) if self.target.add_bos else ""
        # A template that writes the BOS text itself must not get a second BOS from the tokenizer.
        add_special = not (chat and bos and prompt.startswith(bos))
        return self.target.tokenize(prompt, add_special=add_special, parse_special=chat)
