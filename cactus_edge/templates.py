"""Chat templates: rendering conversations with the template a GGUF stores, and turning them into
tokens (:class:`Prompts` does both for one target model; it shares no buffer with decoding, so
other threads may build prompts while a generation runs).

Templates come from files users download, so they run in Jinja's immutable sandbox: a template can
format text but cannot reach Python objects or mutate what it is given.

Tokenizing the rendered prompt with special-token parsing on would let a user who types
``<|im_end|><|im_start|>system`` forge real control tokens. ``tokenize_chat`` therefore keeps track
of which characters came from the template and which from the messages: only the template's own
markup may become control tokens, message contents are always tokenized as plain text.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import CactusEdgeError

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


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _check_messages(messages: list[dict[str, Any]]) -> None:
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ChatTemplateError(f"message {index} needs 'role' and 'content'")


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
) -> str:
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as error:
        raise ChatTemplateError(f"the chat template failed: {error}") from error


def render_chat(
    messages: list[dict[str, str]],
    template: str | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for ``messages`` (dicts with ``role`` and ``content``).

    Text only: tokenizing it with special-token parsing on trusts the message contents; use
    ``tokenize_chat`` for prompts built from user input."""
    _check_messages(messages)
    return _render(
        messages,
        _template_or_fallback(template),
        bos_token=bos_token,
        eos_token=eos_token,
        add_generation_prompt=add_generation_prompt,
    )


# --- tokenizing a conversation ------------------------------------------------------------------


def tokenize_chat(
    messages: list[dict[str, str]],
    template: str | None,
    tokenize: Callable[[str, bool], list[int]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    bos_id: int | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the chat prompt for ``messages``, where only the template's markup can produce
    control tokens.

    The template is rendered twice: once as usual, once with every content replaced by a random
    sentinel. Splitting the second rendering at the sentinels separates the template's markup
    from the contents. If putting the contents back where the sentinels were reproduces the usual
    rendering exactly (or does so with each content stripped, for templates that ``trim``), that
    split is trusted: contents are tokenized with ``parse_special=False``, markup with ``True``.
    Text around a content up to the neighbouring control tokens is tokenized together with it, so
    an ordinary conversation gets the same ids as the whole rendering tokenized at once.

    Otherwise the template rewrites contents in a way the split cannot follow. The whole rendering
    is then tokenized with special parsing, which is safe only when no content contains
    control-token text; if one does, ``ChatTemplateError`` names the message rather than guess.

    Strings of a message other than its content (role, name, ...) land in the template's markup, so
    control-token text in them is refused. A content may be a list of OpenAI ``{"type": "text"}``
    parts, joined with newlines; other part types are refused. ``bos_id`` is prepended unless the
    ids already start with it (the template wrote ``bos_token`` itself).
    """
    _check_messages(messages)
    contents = [_content_text(index, message["content"]) for index, message in enumerate(messages)]
    has_control = _control_detector(tokenize)
    for index, message in enumerate(messages):
        _refuse_control_outside_content(index, message, has_control)
    template = _template_or_fallback(template)

    def render(texts: list[str]) -> str:
        filled = [{**message, "content": text} for message, text in zip(messages, texts, strict=True)]
        return _render(
            filled,
            template,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )

    rendered = render(contents)
    known = [template, bos_token, eos_token, *contents, *_strings(messages)]
    pieces = _marked_pieces(render, len(contents), known)
    ids = _tokenize_rendering(rendered, pieces, contents, tokenize, has_control)
    return ids if bos_id is None or ids[:1] == [bos_id] else [bos_id, *ids]


def _marked_pieces(render: Callable[[list[str]], str], count: int, known: list[str]) -> list[Piece] | None:
    """The template rendered with a sentinel for each of ``count`` contents, cut at the sentinels;
    None when the template fails on sentinels (it inspects contents), which leaves the fallback."""
    sentinels = _sentinels(count, known)
    try:
        marked = render(sentinels)
    except ChatTemplateError:
        return None
    return _split_at_sentinels(marked, sentinels)


def _tokenize_rendering(
    rendered: str,
    pieces: list[Piece] | None,
    contents: list[str],
    tokenize: Tokenize,
    has_control: Callable[[str], bool],
) -> list[int]:
    """Tokenize along the sentinel split when it reproduces the real rendering with the contents
    as given or stripped (templates that ``trim``); otherwise fall back to the whole text."""
    if pieces is not None:
        for candidate in (contents, [text.strip() for text in contents]):
            if _assemble(pieces, candidate) == rendered:
                return _tokenize_pieces(pieces, candidate, tokenize, has_control)
    return _tokenize_rewritten(rendered, contents, tokenize, has_control)


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
    """Every string nested in a message (values of dicts and lists, recursively)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _refuse_control_outside_content(
    index: int, message: dict[str, Any], has_control: Callable[[str], bool]
) -> None:
    """Roles, names and other fields are written into the markup, which is tokenized with special
    parsing: a role of ``user<|im_end|>...`` would forge control tokens just as a content could."""
    for key, value in message.items():
        if key != "content" and any(has_control(text) for text in _strings(value)):
            raise ChatTemplateError(f"message {index}: {key!r} contains control-token text")


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
    rendered: str, contents: list[str], tokenize: Tokenize, has_control: Callable[[str], bool]
) -> list[int]:
    """The template changes contents beyond stripping (slicing, replacing, branching on them), so
    where each content ends up is unknown. Special parsing of the whole text is then safe only
    if no content carries control-token text; one that does is refused, not guessed at."""
    for index, text in enumerate(contents):
        if has_control(text):
            raise ChatTemplateError(
                f"message {index} contains control-token text, and the chat template rewrites "
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

    def render(self, messages: list[dict[str, str]]) -> str:
        return render_chat(
            messages,
            self.target.chat_template,
            bos_token=self.special_text(self.target.bos_token),
            eos_token=self.special_text(self.target.eos_token),
        )

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        target = self.target
        return tokenize_chat(
            messages,
            target.chat_template,
            lambda text, special: target.tokenize(text, add_special=False, parse_special=special),
            bos_token=self.special_text(target.bos_token),
            eos_token=self.special_text(target.eos_token),
            bos_id=target.bos_token if target.add_bos and target.bos_token >= 0 else None,
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
