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

from cactus_edge.engine.config import GenerationConfig
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
    """The file ``name`` was saved to; without a name, the most recently written one (by time, not
    by name: a name of the user's own may sort after the timestamped ones)."""
    folder = conversations_dir()
    if name is not None:
        return folder / f"{name}.json"
    saved = list(folder.glob("*.json"))
    if not saved:
        raise ValueError(f"no saved conversations in {folder}")
    return max(saved, key=lambda path: path.stat().st_mtime_ns)


def read_transcript(path: Path) -> Transcript:
    """The conversation saved in ``path``; ValueError naming the file if it is not one (a JSON
    file of another shape, another program's file, a hand edit gone wrong)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    problem = _shape_problem(data)
    if problem:
        raise ValueError(f"{path.name} is not a saved conversation: {problem}")
    replies = [Reply([(text, bool(drafted)) for text, drafted in pieces]) for pieces in data["replies"]]
    return Transcript(data.get("system"), data["messages"], replies)


def _shape_problem(data) -> str | None:
    """What is wrong with a loaded JSON value as a saved conversation, or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if not isinstance(data.get("system"), (str, type(None))):
        return "'system' is not text"
    messages, replies = data.get("messages"), data.get("replies")
    if not isinstance(messages, list) or not isinstance(replies, list):
        return "'messages' and 'replies' must be lists"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return f"message {index} is not a user or assistant message"
        if not isinstance(message.get("content"), str):
            return f"message {index} has no text content"
    n_replies = sum(message["role"] == "assistant" for message in messages)
    if len(replies) != n_replies:
        return f"{len(replies)} replies for {n_replies} assistant messages"
    for pieces in replies:
        if not isinstance(pieces, list) or not all(
            isinstance(piece, list) and len(piece) == 2 and isinstance(piece[0], str) for piece in pieces
        ):
            return "a reply is not a list of [text, from_draft] pieces"
    return None


def export_markdown(transcript: Transcript, target: str | None = None) -> Path:
    path = Path(target) if target else conversations_dir() / f"{_timestamp()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"> system: {transcript.system}\n"] if transcript.system else []
    for message in transcript.messages:
        title = "You" if message["role"] == "user" else "Assistant"
        lines.append(f"### {title}\n\n{message['content']}\n")
    path.write_text("\n".join(lines))
    return path
