"""What the Responses and Messages APIs share on the way in: their conversations become chat
messages (the one form the chat template and the rest of this layer take), their tool calls
OpenAI's ``tool_calls``, and their errors name the field as the client spelled it
(``input[2].call_id``, ``messages[0].content[1].type``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidSettingError, UnsupportedParameterError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def refuse(message: str, param: str) -> InvalidSettingError:
    return InvalidSettingError(message, param=param)


def unsupported(message: str, param: str) -> UnsupportedParameterError:
    return UnsupportedParameterError(message, param=param)


def expect_object(value: Any, param: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise refuse(f"{param} must be an object, got {_kind(value)}", param)
    return value


def expect_list(value: Any, param: str) -> list:
    if not isinstance(value, list):
        raise refuse(f"{param} must be an array, got {_kind(value)}", param)
    return value


def expect_str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise refuse(f"{param} must be a string, got {_kind(value)}", param)
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def text_of_parts(content: Any, param: str, text_types: frozenset[str]) -> str:
    """A string, or an array of text parts (``{"type": one of text_types, "text"}``) joined by
    newlines; any other part (an image, a file, audio) is refused naming it: this server runs
    text models."""
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(expect_list(content, param)):
        where = f"{param}[{index}]"
        part = expect_object(part, where)
        kind = part.get("type")
        if kind not in text_types:
            raise unsupported(
                f"{where} is a {kind!r} part; this server reads text only ({', '.join(sorted(text_types))})",
                f"{where}.type",
            )
        key = "refusal" if kind == "refusal" else "text"  # a refusal part keeps its text there
        texts.append(expect_str(part.get(key), f"{where}.{key}"))
    return "\n".join(texts)


def tool_call(call_id: str, name: str, arguments: Any) -> dict:
    """OpenAI's chat ``tool_calls`` entry; ``arguments`` a JSON string or an object."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def add_tool_call(messages: list[dict], call: dict) -> None:
    """Append a call to the conversation: to the last assistant message when the conversation ends
    with one (parallel calls, or text then calls), else in a new assistant message."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def check_tool_results(messages: list[dict], where: dict[int, str]) -> None:
    """Every tool result answers a call made earlier in the conversation; ``where`` names each
    tool message's field in the request (by its index in ``messages``)."""
    called: set[str] = set()
    for index, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            called.add(call["id"])
        if message["role"] == "tool" and message["tool_call_id"] not in called:
            raise refuse(
                f"{where[index]} answers the tool call {message['tool_call_id']!r}, which no earlier "
                "message makes",
                where[index],
            )


def decoded_arguments(arguments: str) -> dict:
    """A call's arguments as an object: the tool grammar makes them JSON; anything else (a call cut
    short) is an empty object, as a client must still get a ``tool_use`` block's ``input``."""
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


class ChunkTranslator:
    """A chat reply's stream chunks as another API's events: subclasses write ``_text`` (a piece
    of text) and ``_call`` (a tool-call delta: a call's start or its arguments) and ``_close``
    (the events that end the block or item being written)."""

    def add(self, chunk: dict) -> list[tuple[str, dict]]:
        """The events for one chat chunk."""
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
        return events

    def ending(self, final_chunks: list[dict]) -> tuple[list[tuple[str, dict]], str, dict]:
        """(the events of the chat stream's finishing chunks, the open block's end included; the
        finish reason; the last chunk, which with include_usage carries usage and our blocks)."""
        events = []
        for chunk in final_chunks:
            events += self.add(chunk)
        events += self._close()
        finish = [c["choices"][0]["finish_reason"] for c in final_chunks if c.get("choices")][-1]
        return events, finish, final_chunks[-1]

    def _text(self, text: str) -> list[tuple[str, dict]]:
        raise NotImplementedError

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        raise NotImplementedError

    def _close(self) -> list[tuple[str, dict]]:
        raise NotImplementedError
