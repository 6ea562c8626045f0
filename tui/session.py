"""The conversation of the chat and the reply streaming into it.

Each reply is a :class:`Turn` streamed by a worker thread; the thread shows its tokens through
messages. Escape sets the turn's cancel event, and the engine stops at the end of its step. Every
change to the conversation (new chat, /load, /drop, regenerate, quit) first stops a streaming reply
and waits for its thread, so the reply lands in the conversation it belongs to and never in the
next one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from textual.message import Message

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.events import StreamEvent
from cactus_edge.engine.stats import GenerationStats
from cactus_edge.errors import ContextLengthError

from .conversations import Transcript
from .widgets import AssistantMessage, Reply

if TYPE_CHECKING:
    from .app import CactusChatApp
    from .screens import ChatScreen

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

    def stream(self, engine, messages, config: GenerationConfig, post: Callable[[Message], object]) -> None:
        """The worker thread's part: stream the reply, posting each event, then the end."""
        try:
            for event in engine.stream_chat(messages, config, cancel=self.cancel):
                self.record(event)
                post(Streamed(self, event))
        except Exception as error:  # reported when the turn ends; the app keeps running
            self.error = error
        finally:
            self.done.set()
            post(Ended(self))

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


def failure_notice(error: Exception) -> str:
    """What to tell the user when a reply failed: for a full context, how to go on."""
    if isinstance(error, ContextLengthError):
        return f"{error}. Start a new chat (ctrl+n) or drop the oldest exchange (/drop)."
    return f"Generation failed: {error}"


class ChatSession:
    """The conversation of one app, and the reply streaming into it.

    ``messages`` alternates user and assistant turns (chat templates expect that, and /drop and
    regenerate work on pairs); ``replies`` holds one :class:`Reply` per assistant turn. While a
    reply streams, ``messages`` ends with its user turn. A reply that fails, or is stopped before
    any text, withdraws its whole exchange rather than leave an empty assistant turn or an
    unanswered user turn; when esc stopped it, the message goes back into the prompt.

    Every method runs on the app's message queue (key actions do, and the prompt and the worker
    forward there), one at a time, so a change never interleaves with another or with a reply
    ending. The chat screen shows what changed.
    """

    def __init__(self, app: CactusChatApp, system: str | None) -> None:
        self.app = app
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.replies: list[Reply] = []
        self.last_stats: GenerationStats | None = None
        self.turn: Turn | None = None

    @property
    def generating(self) -> bool:
        return self.turn is not None

    @property
    def screen(self) -> ChatScreen:
        return self.app.chat_screen

    def prompt_messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def transcript(self) -> Transcript:
        """The conversation to save or export: without an exchange whose reply still streams."""
        settled = self.messages[:-1] if self.generating else list(self.messages)
        return Transcript(self.system, settled, self.replies)

    # --- a reply's life ------------------------------------------------------------------------

    def send(self, text: str) -> None:
        if self.generating:
            self.app.notify("A reply is still streaming: esc stops it.", severity="warning")
            return
        self.messages.append({"role": "user", "content": text})
        self.screen.show_user_message(text)
        self.start_reply()

    def start_reply(self) -> None:
        app = self.app
        turn = self.turn = Turn(AssistantMessage(acceptance_view=app.acceptance_view))
        self.screen.show_reply_starting(turn.widget, app.config)
        app.generate(turn, app.engine, self.prompt_messages(), app.config)

    def show_streamed(self, message: Streamed) -> None:
        if message.turn is self.turn:  # a late message of a settled or dropped turn shows nothing
            self.screen.show_streamed(message.turn.widget, message.event, self.app.config)

    def end_reply(self, message: Ended) -> None:
        turn = message.turn
        if turn is not self.turn:  # already settled or dropped by the change that stopped it
            return
        withdrawn = self.settle()
        if turn.error is not None:
            self.app.notify(failure_notice(turn.error), severity="error", timeout=10)
        elif turn.finish_reason == "cancelled" and withdrawn is None:
            self.app.notify("Stopped; the reply so far is kept.")
        elif turn.finish_reason == "cancelled":
            self.screen.give_back(withdrawn)
            self.app.notify("Stopped before the first token; your message is back in the prompt.")

    def settle(self) -> str | None:
        """End the current turn: its reply joins the conversation, or, when it is not kept, its
        exchange is withdrawn. Returns the withdrawn user text."""
        turn, self.turn = self.turn, None
        if turn is None:
            return None
        withdrawn = self.record(turn)
        self.screen.status_bar.show(self.app.config, self.last_stats)
        if withdrawn is None:
            turn.widget.show_reply(turn.reply)  # pieces may still have been queued for display
        else:
            self.screen.withdraw_exchange(turn.widget)
        return withdrawn

    def record(self, turn: Turn) -> str | None:
        """The data half of settling: append the reply, or pop its user turn and return the text."""
        self.last_stats = turn.stats if turn.done.is_set() else None
        if not turn.kept:
            return self.messages.pop()["content"]
        self.messages.append({"role": "assistant", "content": turn.reply.text})
        self.replies.append(turn.reply)
        return None

    def cancel_reply(self) -> None:
        if self.turn is not None:
            self.turn.cancel.set()

    async def stop_reply(self) -> None:
        """Cancel the streaming reply and wait for its thread to end, off the event loop and for at
        most STOP_TIMEOUT; a reply still running then is given up (it will not be kept)."""
        turn = self.turn
        if turn is None:
            return
        turn.cancel.set()
        if not await asyncio.to_thread(turn.done.wait, STOP_TIMEOUT):
            self.app.notify("The engine did not stop in time; its reply is dropped.", severity="warning")

    async def end(self) -> None:
        """When the app ends: stop the reply, which still joins ``messages`` (the screens are gone:
        no display), so the conversation is whole after ``run()``."""
        turn, self.turn = self.turn, None
        if turn is not None:
            turn.cancel.set()
            await asyncio.to_thread(turn.done.wait, STOP_TIMEOUT)
            self.record(turn)

    # --- changes: each stops the streaming reply first -----------------------------------------

    async def switch_to(self, transcript: Transcript) -> None:
        """Continue this conversation instead. A stopped reply is dropped with the one it was in."""
        await self.stop_reply()
        self.turn = None
        self.system, self.messages, self.replies = transcript.system, transcript.messages, transcript.replies
        await self.screen.show_conversation(self.messages, self.replies)
        self.screen.status_bar.show(self.app.config)

    async def regenerate(self) -> None:
        await self.stop_reply()
        if self.turn is not None:  # stopped mid-reply: drop that reply, keep its user turn
            self.turn.widget.remove()
            self.turn = None
        elif self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
            self.replies.pop()
            self.screen.remove_last_reply()
        else:
            return
        self.start_reply()

    async def drop_oldest(self) -> None:
        if not self.messages:
            raise ValueError("nothing to drop")
        await self.stop_reply()
        self.settle()  # a stopped reply completes (or withdraws) its exchange before pairs are cut
        del self.messages[:2]
        del self.replies[:1]
        await self.screen.show_conversation(self.messages, self.replies)
        self.app.notify("Dropped the oldest exchange.")
