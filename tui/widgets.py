"""Widgets of the chat screen: messages, the assistant reply with its acceptance view, status bar."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static

from cactus_edge.config import DEFAULT_DRAFTER

# Accepted draft tokens are underlined in the accent colour; target tokens stay plain. One colour
# and an underline stay readable on light and dark themes and without colour at all.
DRAFT_STYLE = "underline #4fb286"
LEGEND = Text.assemble(
    ("underlined", DRAFT_STYLE), ": drafted and accepted · plain: written by the target · ctrl+t toggles"
)


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


class UserMessage(Static):
    DEFAULT_CLASSES = "message user"

    def __init__(self, content: str) -> None:
        super().__init__(content)
        self.border_title = "you"


class AssistantMessage(Vertical):
    """A streamed reply, as Markdown or, in the acceptance view, as text coloured by origin."""

    DEFAULT_CLASSES = "message assistant"

    def __init__(self, reply: Reply | None = None, *, acceptance_view: bool = False) -> None:
        super().__init__()
        self.reply = reply or Reply()
        self.acceptance_view = acceptance_view
        self.border_title = "assistant"

    def compose(self) -> ComposeResult:
        yield Markdown(self.reply.text, classes="markdown")
        yield Static(self.reply.styled(), classes="tokens")

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
            self.query_one(".tokens", Static).update(self.reply.styled())
        else:
            self.query_one(".markdown", Markdown).update(self.reply.text)

    def set_acceptance_view(self, on: bool) -> None:
        self.acceptance_view = on
        self._show_view()
        self.refresh_content()

    def _show_view(self) -> None:
        self.query_one(".markdown", Markdown).display = not self.acceptance_view
        self.query_one(".tokens", Static).display = self.acceptance_view


class StatusBar(Static):
    """Live figures of the current reply."""

    def show(self, config, stats=None, streaming: bool = False) -> None:
        """One line that fits 80 columns: the method, then the live figures of the reply (or the
        sampling settings between replies)."""
        method = f"cactus δ={config.delta:g}" if config.method == "cactus" else config.method
        draft_length = f"k={config.n_draft}"
        if config.n_draft == "auto" and stats is not None and stats.steps:
            draft_length += f"({stats.steps[-1].n_draft})"  # what auto chose last
        parts = [method, draft_length]
        if config.drafter != DEFAULT_DRAFTER:  # the usual drafter goes without saying
            parts.append(config.drafter)
        if stats is not None and stats.n_verifier_calls:
            parts += [
                f"{stats.tokens_per_second:.1f} tok/s",
                f"AL {stats.acceptance_length:.2f}",
                f"calls saved: {stats.n_tokens - stats.n_verifier_calls}",
            ]
            if stats.kl_mean is not None and stats.lossy:
                parts.append(f"KL {stats.kl_mean:.3f}")
        else:
            parts.append(f"T={config.temperature:g} top-k {config.top_k} top-p {config.top_p:g}")
        if streaming:
            parts.append("esc stops")
        self.update(" · ".join(parts))
