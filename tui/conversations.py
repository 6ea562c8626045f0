"""Conversation files: /save and ctrl+s write JSON, /load reads it back, /export writes Markdown.

A saved conversation is one JSON object: ``system`` (the system message or null), ``messages``
(alternating user and assistant turns), ``replies`` (per assistant turn, its ``[text, from_draft]``
pieces, so a loaded reply keeps its acceptance view) and ``config`` (the settings it was written
with, for the reader: loading does not restore them). Nothing here touches the screen.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from cactus_edge.config import GenerationConfig
from cactus_edge.files import user_data_folder, write_text_atomically

from .widgets import Reply


def conversations_dir() -> Path:
    return user_data_folder("conversations")


@dataclass
class Transcript:
    """A settled conversation (no reply still streaming in it): what is saved, loaded, exported."""

    system: str | None
    messages: list[dict[str, str]]
    replies: list[Reply]


def _timestamp() -> str:
    """The name of a file saved or exported without one."""
    return time.strftime("%Y%m%d-%H%M%S")


def save_transcript(transcript: Transcript, config: GenerationConfig, name: str | None = None) -> Path:
    folder = conversations_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name or _timestamp()}.json"
    data = {
        "system": transcript.system,
        "messages": transcript.messages,
        "replies": [reply.pieces for reply in transcript.replies],
        "config": {k: v for k, v in config.__dict__.items() if k != "stop"},
    }
    # Saving under the name of an earlier save replaces it: never with half a file.
    write_text_atomically(path, json.dumps(data, indent=2))
    return path


def saved_path(name: str | None = None) -> Path:
    """The file ``name`` was saved to; without a name, the last by file name (saves named by their
    timestamp sort by age, but a name of the user's own may sort after them)."""
    folder = conversations_dir()
    if name is not None:
        return folder / f"{name}.json"
    saved = sorted(folder.glob("*.json"))
    if not saved:
        raise ValueError(f"no saved conversations in {folder}")
    return saved[-1]


def read_transcript(path: Path) -> Transcript:
    data = json.loads(path.read_text())
    replies = [Reply([(text, bool(drafted)) for text, drafted in pieces]) for pieces in data["replies"]]
    return Transcript(data.get("system"), data["messages"], replies)


def export_markdown(transcript: Transcript, target: str | None = None) -> Path:
    path = Path(target) if target else conversations_dir() / f"{_timestamp()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"> system: {transcript.system}\n"] if transcript.system else []
    for message in transcript.messages:
        title = "You" if message["role"] == "user" else "Assistant"
        lines.append(f"### {title}\n\n{message['content']}\n")
    path.write_text("\n".join(lines))
    return path
