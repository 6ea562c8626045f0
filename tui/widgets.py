"""Widgets of the chat screen: messages, the assistant reply with its acceptance view, status bar."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static

from cactus_edge.engine.config import DEFAULT_DRAFTER

# Accepted draft tokens are underlined in the accent colour; target tokens stay plain. One colour
# and an underline stay readable on light and dark themes and without colour at all.
DRAFT_STYLE = "underline #4fb286"
LEGEND = Text.assemble(
    ("underlined", DRAFT_STYLE), ": drafted and accepted · plain: written by the target · ctrl+t toggles"
)
# A fenced code block's opening line, indentation stripped (list items indent theirs): 3+ backticks
# or tildes, then an info string whose first word is the language (no backtick in it after
# backticks). A line of at least as many of the same character, and nothing else, closes it.
FENCE = re.compile(r"^(`{3,}(?!.*`)|~{3,})[ \t]*(\S*)")
CODE_THEME = "monokai"  # the acceptance view's code blocks: a dark block reads on light themes too


@dataclass
class Reply:
    """What the assistant has written so far: the text pieces with where each came from."""

    pieces: list[tuple[str, bool]] = field(default_factory=list)  # (text, from_draft)

    @property
    def text(self) -> str:
        return "".join(piece for piece, _ in self.pieces)

    def styled(self) -> Text:
        text = Text()
        for piece, from_draft in self.pieces:
            text.append(piece, style=DRAFT_STYLE if from_draft else "")
        return text

    def rendered(self) -> RenderableType:
        """The acceptance view: the styled text, with fenced code as highlighted blocks (the fence
        lines hidden) whose draft tokens stay underlined."""
        styled = self.styled()  # its plain text has no "\r" (rich drops control codes): split that
        parts = fenced_parts(styled.plain)
        if all(language is None for _, _, language in parts):
            return styled
        blocks: list[RenderableType] = []
        for start, end, language in parts:
            if language is not None:
                blocks.append(code_block(styled[start:end], language))
                continue
            plain = styled.plain[start:end]  # prose, without the newlines next to a block
            lead, kept = len(plain) - len(plain.lstrip("\n")), len(plain.rstrip("\n"))
            if kept > lead:
                blocks.append(styled[start + lead : start + kept])
        return Group(*[part for block in blocks for part in (Text(), block)][1:])  # a blank line between


def fenced_parts(text: str) -> list[tuple[int, int, str | None]]:
    """(start, end, language) for the prose and fenced code parts of text, in order; language is
    None for prose and the fence's ("" when it names none) for code. The fence lines belong to no
    part. A fence still open (the reply is streaming) runs to the end."""
    parts: list[tuple[int, int, str | None]] = []
    start = offset = 0
    fence, language = "", None
    for line in text.splitlines(keepends=True):
        bare, offset = line.strip(" \t\r\n"), offset + len(line)
        opening = None if fence else FENCE.match(bare)
        closing = fence and bare.startswith(fence) and not bare.strip(fence[0])
        if opening or closing:
            parts.append((start, offset - len(line), language))
            start = offset
            fence, language = (opening[1], opening[2]) if opening else ("", None)
    parts.append((start, len(text), language))
    return [part for part in parts if part[2] is not None or part[0] < part[1]]


def code_block(code: Text, language: str) -> Padding:
    """Fenced code on its own background, highlighted; the draft tokens stay underlined (in the
    highlighter's colours)."""
    code = code[: len(code.plain.removesuffix("\n"))]  # the newline before the closing fence
    block = _highlighted(code.plain, language).copy()
    for span in code.spans:
        block.stylize("underline", span.start, span.end)
    return Padding(block, (0, 1), style=block.style, expand=True)


@lru_cache(maxsize=64)
def _highlighted(code: str, language: str) -> Text:
    """A finished block is highlighted once, not at every token of the reply."""
    try:  # no newline added, no tabs expanded: the draft spans' offsets stay right
        lexer = get_lexer_by_name(language or "text", stripnl=False, ensurenl=False)
    except ClassNotFound:
        lexer = get_lexer_by_name("text", stripnl=False, ensurenl=False)
    text = Syntax(code, lexer, theme=CODE_THEME, word_wrap=True).highlight(code)
    return text if text.plain == code else Text(code, style=text.style)  # the lexer changed the text


class UserMessage(Static):
    DEFAULT_CLASSES = "message user"

    def __init__(self, content: str) -> None:
        super().__init__(content)
        self.border_title = "you"


class AssistantMessage(Vertical):
    """A streamed reply, as Markdown or, in the acceptance view, as text marked by origin (fenced
    code as highlighted blocks in both)."""

    DEFAULT_CLASSES = "message assistant"

    def __init__(self, reply: Reply | None = None, *, acceptance_view: bool = False) -> None:
        super().__init__()
        self.reply = reply or Reply()
        self.acceptance_view = acceptance_view
        self.border_title = "assistant"

    def compose(self) -> ComposeResult:
        yield Markdown(self.reply.text, classes="markdown")
        yield Static(self.reply.rendered(), classes="tokens")

    def on_mount(self) -> None:
        self._show_view()

    def append(self, text: str, from_draft: bool) -> None:
        if text:
            self.reply.pieces.append((text, from_draft))
            self.refresh_content()

    def show_reply(self, reply: Reply) -> None:
        """Show this reply instead: the whole of it, when pieces were still on their way here."""
        self.reply = reply
        self.refresh_content()

    def refresh_content(self) -> None:
        if self.acceptance_view:
            self.query_one(".tokens", Static).update(self.reply.rendered())
        else:
            self.query_one(".markdown", Markdown).update(self.reply.text)

    def set_acceptance_view(self, on: bool) -> None:
        self.acceptance_view = on
        self._show_view()
        self.refresh_content()

    def _show_view(self) -> None:
        self.query_one(".markdown", Markdown).display = not self.acceptance_view
        self.query_one(".tokens", Static).display = self.acceptance_view


def calls_saved(stats) -> int:
    """Target calls the drafts saved against plain decoding, which makes one call per token it
    generates (the prompt's prefill call gives the first). A verifier call gives its accepted drafts
    and one token of its own, so each accepted draft saved one call: n_accepted, never negative.
    (n_tokens - n_verifier_calls is not it: n_tokens counts shown tokens, and the end-of-generation
    token takes a call without being shown.) Drafts accepted past that token in the last block
    saved nothing: a reply that stopped there took n_tokens + 1 calls to decode plainly."""
    saved = stats.n_accepted
    if stats.finish_reason == "stop":
        saved = min(saved, stats.n_tokens + 1 - stats.n_verifier_calls)
    return max(saved, 0)


class StatusBar(Static):
    """Live figures of the current reply."""

    WIDTH = 80

    def show(self, config, stats=None, streaming: bool = False) -> None:
        """One line that fits 80 columns: the method, then the live figures of the reply (or the
        sampling settings between replies); figures that do not fit are left out, the last first."""
        method = f"cactus δ={config.delta:g}" if config.method == "cactus" else config.method
        draft_length = f"k={config.n_draft}"
        if config.n_draft == "auto" and stats is not None and stats.steps:
            draft_length += f"({stats.steps[-1].n_draft})"  # what auto chose last
        parts = [method, draft_length]
        if config.drafter != DEFAULT_DRAFTER:  # the usual drafter goes without saying
            parts.append(config.drafter)
        optional = []
        if stats is not None and stats.n_verifier_calls:
            parts += [f"{stats.tokens_per_second:.1f} tok/s", f"AL {stats.acceptance_length:.2f}"]
            optional += [first_token(stats), f"calls saved: {calls_saved(stats)}"]
            if stats.kl_mean is not None and stats.lossy:
                optional.append(f"KL {stats.kl_mean:.3f}")
        else:
            parts.append(f"T={config.temperature:g} top-k {config.top_k} top-p {config.top_p:g}")
        ending = ["esc stops"] if streaming else []
        for part in optional:
            if len(" · ".join([*parts, part, *ending])) <= self.WIDTH:
                parts.append(part)
        self.update(" · ".join([*parts, *ending]))


def first_token(stats) -> str:
    """How long the reply's first token took, and where its prompt came back from when it did."""
    seconds = stats.first_token_ms / 1000
    kept = f" ({stats.prompt_cache})" if stats.prompt_cache in ("memory", "disk") else ""
    return f"first token {seconds:.1f} s{kept}"
