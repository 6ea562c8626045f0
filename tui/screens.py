"""The app's screens: loading (while the models load), chat, and help over either."""

from __future__ import annotations

import time

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Header, Input, LoadingIndicator, Static

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.events import StreamEvent
from cactus_edge.engine.stats import GenerationStats

from .commands import HELP
from .widgets import LEGEND, AssistantMessage, Reply, StatusBar, UserMessage


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark", "app.pop_screen", "close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help-text")


class LoadingScreen(Screen):
    """Shown while the models load (or while the default pair is fetched)."""

    def compose(self) -> ComposeResult:
        with Vertical(id="loading"):
            yield Static("Loading models…", id="loading-text")
            yield LoadingIndicator()

    def say(self, text: str) -> None:
        self.query_one("#loading-text", Static).update(text)


class ChatScreen(Screen):
    """Shows the conversation; the app's :class:`ChatSession` holds it and says what changed."""

    # The actions run on the app (its message queue keeps conversation changes in order); the
    # screen binds keys.
    BINDINGS = [
        Binding("escape", "app.stop_generation", "stop"),
        Binding("ctrl+n", "app.new_chat", "new chat"),
        Binding("ctrl+r", "app.regenerate", "regenerate"),
        Binding("ctrl+y", "app.copy_last_reply", "copy reply"),
        Binding("ctrl+t", "app.toggle_acceptance_view", "acceptance view"),
        Binding("ctrl+s", "app.save_conversation", "save"),
        Binding("f1", "app.help", "help"),
    ]

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield VerticalScroll(id="conversation")
        yield Static(LEGEND, id="legend")
        yield StatusBar(id="status")
        yield Input(placeholder="Message (/help for commands)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#legend").display = self.app.acceptance_view
        self.query_one(StatusBar).show(self.app.config)
        self.query_one(Input).focus()

    @on(Input.Submitted, "#prompt")
    def submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        event.input.value = ""
        if text:  # handled on the app's queue, in turn with key actions and the reply's messages
            self.app.call_later(self.app.submit, text)

    @property
    def conversation(self) -> VerticalScroll:
        return self.query_one("#conversation", VerticalScroll)

    @property
    def status_bar(self) -> StatusBar:
        return self.query_one(StatusBar)

    def show_user_message(self, text: str) -> None:
        self.conversation.mount(UserMessage(text))

    def show_reply_starting(self, reply: AssistantMessage, config: GenerationConfig) -> None:
        self.conversation.mount(reply)
        self.conversation.scroll_end(animate=False)
        self.status_bar.show(config, streaming=True)

    def show_streamed(self, reply: AssistantMessage, event: StreamEvent, config: GenerationConfig) -> None:
        scroll = self.conversation
        at_bottom = scroll.scroll_y >= scroll.max_scroll_y - 1
        reply.append(event.text, event.from_draft)
        if event.stats is not None:
            self._throttled_status(config, event.stats)
        if at_bottom:  # follow the reply unless the user scrolled up to read
            scroll.scroll_end(animate=False)

    _last_status = 0.0  # tokens come faster than anyone reads figures: refresh them 5 times a second

    def _throttled_status(self, config: GenerationConfig, stats: GenerationStats) -> None:
        now = time.monotonic()
        if now - self._last_status > 0.2:
            self._last_status = now
            self.status_bar.show(config, stats, streaming=True)

    def withdraw_exchange(self, reply: AssistantMessage) -> None:
        """Remove an exchange that is not kept: the reply, and the user message it answered."""
        reply.remove()
        self.conversation.query(UserMessage).last().remove()

    def remove_last_reply(self) -> None:
        self.conversation.query(AssistantMessage).last().remove()

    def give_back(self, text: str) -> None:
        """Put a withdrawn message back into the prompt, unless something new is being typed."""
        prompt = self.query_one("#prompt", Input)
        prompt.value = prompt.value or text

    def show_acceptance_view(self, on: bool) -> None:
        for message in self.query(AssistantMessage):
            message.set_acceptance_view(on)
        self.query_one("#legend").display = on

    async def show_conversation(self, messages: list[dict[str, str]], replies: list[Reply]) -> None:
        """Show these turns instead of the ones shown: ``replies`` holds one per assistant turn."""
        await self.conversation.remove_children()
        replies_in_order = iter(replies)
        await self.conversation.mount_all(
            UserMessage(message["content"])
            if message["role"] == "user"
            else AssistantMessage(next(replies_in_order), acceptance_view=self.app.acceptance_view)
            for message in messages
        )
