"""Slash commands: a prompt that starts with ``/`` is a command, not a message.

A command that fails (a bad argument, a setting GenerationConfig refuses, a missing file) becomes
a notification naming it; the chat goes on. Commands that change the conversation (/new, /drop,
/load) go through the app, which stops a streaming reply first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from .conversations import export_markdown, read_transcript, saved_path

if TYPE_CHECKING:
    from .app import CactusChatApp

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

# The commands that change one generation setting, each with how its argument becomes the change.
# A malformed number raises ValueError here; GenerationConfig refuses values out of range.
SETTING_COMMANDS: dict[str, Callable[[str], dict[str, object]]] = {
    "method": lambda argument: {"method": argument},
    "delta": lambda argument: {"delta": float(argument)},
    "budget": lambda argument: {"kl_budget": None if argument in ("", "off") else float(argument)},
    "k": lambda argument: {"n_draft": argument if argument == "auto" else int(argument)},
    "drafter": lambda argument: {"drafter": argument},
    "temp": lambda argument: {"temperature": float(argument)},
}


def parse_command(line: str) -> tuple[str, str]:
    """``"/delta 0.5"`` → ``("delta", "0.5")``: the name, then the rest of the line, trimmed."""
    name, _, argument = line[1:].partition(" ")
    return name, argument.strip()


class SlashCommands:
    """Runs the commands typed into one app's prompt."""

    def __init__(self, app: CactusChatApp) -> None:
        self.app = app

    async def run(self, line: str) -> None:
        name, argument = parse_command(line)
        command = self._command(name, argument)
        if command is None:
            self.app.notify(f"unknown command /{name}; /help lists them", severity="warning")
            return
        try:
            result = command()
            if inspect.isawaitable(result):
                await result
        except (ValueError, OSError) as error:
            self.app.notify(f"/{name}: {error}", severity="error")

    def _command(self, name: str, argument: str) -> Callable[[], object] | None:
        """The command ``name`` bound to its argument, not yet run (so its errors are caught)."""
        if name in SETTING_COMMANDS:
            return lambda: self.set_config(**SETTING_COMMANDS[name](argument))
        app = self.app
        commands = {
            "system": lambda: self.set_system(argument),
            "help": app.action_help,
            "new": app.action_new_chat,
            "drop": app.session.drop_oldest,
            "save": lambda: app.action_save_conversation(argument or None),
            "load": lambda: self.load(argument or None),
            "export": lambda: self.export(argument or None),
        }
        return commands.get(name)

    def set_config(self, **changes) -> None:
        app = self.app
        if app.generating:
            raise ValueError("wait for the reply to finish (esc stops it)")
        app.config = replace(app.config, **changes)  # validates: ValueError names the setting
        app.status_bar.show(app.config, app.last_stats)
        app.notify(", ".join(f"{k} = {v}" for k, v in changes.items()))

    def set_system(self, text: str) -> None:
        self.app.session.system = text or None
        self.app.notify(f"system message {'set' if text else 'cleared'}")

    async def load(self, name: str | None) -> None:
        path = saved_path(name)
        transcript = read_transcript(path)  # read before stopping anything: a typo costs no reply
        await self.app.session.switch_to(transcript)
        self.app.notify(f"Loaded {path.name}")

    def export(self, target: str | None) -> None:
        path = export_markdown(self.app.session.transcript(), target)
        self.app.notify(f"Exported {path}")
