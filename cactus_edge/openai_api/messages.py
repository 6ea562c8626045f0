"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a conversion
over chat completions: a request becomes a chat request (:func:`read_messages_request`), and the
chat reply's chunks become Anthropic's stream events or message (:class:`MessagesReply`).

How each request field is treated (docs/server.md has the table):

* Used: ``model``, ``max_tokens`` (required), ``system`` (a string or text blocks; a block whose
  text starts with ``x-anthropic-billing-header`` is left out: it changes every request and would
  defeat the prompt cache), ``messages`` (text, ``tool_use``, ``tool_result``; ``thinking``
  blocks dropped), ``tools`` (custom tools with ``input_schema``; Anthropic's own tool types are
  left out and reported), ``tool_choice``, ``stop_sequences``, ``temperature``, ``top_p``,
  ``top_k``, ``stream``, ``output_config.format`` (a JSON schema: our grammars), and our
  ``speculative``, ``seed``, ``min_p``. System messages inside ``messages`` (Claude Code sends
  them) join the conversation where they stand.
* Refused (400): image and document blocks, unknown block types.
* Accepted and ignored: ``metadata``, ``thinking`` (these models do not think), ``service_tier``,
  ``context_management``, ``output_config.effort``, ``container``, ``mcp_servers``,
  ``safeguards`` and any other field, and unknown keys of blocks (``cache_control``, ``caller``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..checks import is_int
from .items import (
    ChunkTranslator,
    add_tool_call,
    check_tool_results,
    decoded_arguments,
    expect_list,
    expect_object,
    expect_str,
    new_id,
    refuse,
    text_of_parts,
    tool_call,
    unsupported,
)

BILLING_HEADER = "x-anthropic-billing-header"
TEXT_BLOCKS = frozenset({"text"})
SAME_NAME = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "speculative")
# The Messages name of a chat field an error names.
PARAMS = {
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice",
    "response_format": "output_config.format",
}
STOP_REASONS = {"length": "max_tokens"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error envelope for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass
class MessagesRequest:
    chat_body: dict
    skipped_tools: list[str]  # Anthropic's tool types, left out of the prompt
    max_tokens: int


def read_messages_request(body: Any, *, counting: bool = False) -> MessagesRequest:
    """A Messages request as a chat request; InvalidSettingError naming the Messages field.
    ``counting``: a count_tokens request, which has no max_tokens."""
    body = expect_object(body, "body")
    max_tokens = body.get("max_tokens")
    if not counting and not (is_int(max_tokens) and max_tokens >= 1):
        raise refuse(
            f"max_tokens is required: a whole number of tokens >= 1, got {max_tokens!r}", "max_tokens"
        )
    messages = system_messages(body.get("system"))
    offset = len(messages)
    conversation, where = chat_messages_of(body.get("messages"))
    messages += conversation
    check_tool_results(messages, {offset + index: name for index, name in where.items()})
    tools, skipped = custom_tools(body.get("tools"))
    chat_body = {name: body[name] for name in SAME_NAME if body.get(name) is not None}
    chat_body.update(
        messages=messages, stream=bool(body.get("stream")), stream_options={"include_usage": True}
    )
    if not counting:
        chat_body["max_tokens"] = max_tokens
    if body.get("stop_sequences"):
        chat_body["stop"] = body["stop_sequences"]
    if tools:
        chat_body["tools"] = tools
    chat_body.update(chat_tool_choice(body.get("tool_choice"), bool(tools)))
    response_format = output_format(body.get("output_config"))
    if response_format is not None:
        chat_body["response_format"] = response_format
    return MessagesRequest(chat_body, skipped, max_tokens if is_int(max_tokens) else 0)


def system_messages(system: Any, param: str = "system") -> list[dict]:
    """A system prompt (a string or text blocks) as chat messages, the billing header left out."""
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    texts = []
    for index, block in enumerate(expect_list(system, param)):
        where = f"{param}[{index}]"
        block = expect_object(block, where)
        if block.get("type") != "text":
            raise unsupported(
                f"{where} is a {block.get('type')!r} block; a system prompt takes text", f"{where}.type"
            )
        text = expect_str(block.get("text"), f"{where}.text")
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return [{"role": "system", "content": "\n\n".join(texts)}] if texts else []


def chat_messages_of(value: Any) -> tuple[list[dict], dict[int, str]]:
    """(chat messages, the request field of each tool message by its index)."""
    messages: list[dict] = []
    where: dict[int, str] = {}
    for index, message in enumerate(expect_list(value, "messages")):
        param = f"messages[{index}]"
        message = expect_object(message, param)
        role = message.get("role")
        if role == "system":  # Claude Code sends some between the turns
            messages += system_messages(message.get("content"), f"{param}.content")
            continue
        if role not in ("user", "assistant"):
            raise refuse(f"{param}.role must be user, assistant or system, got {role!r}", f"{param}.role")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        for number, block in enumerate(expect_list(content, f"{param}.content")):
            _add_block(
                messages,
                where,
                role,
                expect_object(block, f"{param}.content[{number}]"),
                f"{param}.content[{number}]",
            )
    if not messages:
        raise refuse("messages must hold at least one message", "messages")
    return messages, where


def _add_block(messages: list[dict], where: dict[int, str], role: str, block: Mapping, param: str) -> None:
    kind = block.get("type")
    if kind == "text":
        _add_text(messages, role, expect_str(block.get("text"), f"{param}.text"))
    elif kind == "tool_use" and role == "assistant":
        name = expect_str(block.get("name"), f"{param}.name")
        call = tool_call(
            expect_str(block.get("id"), f"{param}.id"),
            name,
            expect_object(block.get("input", {}), f"{param}.input"),
        )
        add_tool_call(messages, call)
    elif kind == "tool_result" and role == "user":
        call_id = expect_str(block.get("tool_use_id"), f"{param}.tool_use_id")
        content = block.get("content", "")
        text = text_of_parts(content, f"{param}.content", TEXT_BLOCKS) if content else ""
        if block.get("is_error"):
            text = f"Error: {text}"
        where[len(messages)] = f"{param}.tool_use_id"
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    elif kind in ("thinking", "redacted_thinking"):
        return  # another model's reasoning: ours do not read it back
    else:
        raise unsupported(
            f"{param} is a {kind!r} block in a {role} message; this server reads text, tool_use (assistant) "
            "and tool_result (user) blocks",
            f"{param}.type",
        )


def _add_text(messages: list[dict], role: str, text: str) -> None:
    """Text joins the message before it when that is the same role's text (blocks of one message)."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == role and not last.get("tool_calls"):
        last["content"] = f"{last['content']}\n\n{text}" if last["content"] else text
    else:
        messages.append({"role": role, "content": text})


def output_format(config: Any) -> dict | None:
    """``output_config.format`` (structured outputs: ``{"type": "json_schema", "schema"}``) as
    chat's response_format; the rest of output_config (effort) means nothing here."""
    if not isinstance(config, Mapping) or config.get("format") is None:
        return None
    fmt = expect_object(config["format"], "output_config.format")
    if fmt.get("type") != "json_schema":
        raise refuse(
            f"output_config.format.type must be json_schema, got {fmt.get('type')!r}",
            "output_config.format.type",
        )
    schema = expect_object(fmt.get("schema"), "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def custom_tools(value: Any) -> tuple[list[dict], list[str]]:
    """(chat tools for the custom tools, names of Anthropic's own tool types, left out)."""
    if value is None:
        return [], []
    tools, skipped = [], []
    for index, tool in enumerate(expect_list(value, "tools")):
        tool = expect_object(tool, f"tools[{index}]")
        name = expect_str(tool.get("name"), f"tools[{index}].name")
        if tool.get("type") not in (None, "custom"):
            skipped.append(name)
            continue
        function = {
            "name": name,
            "parameters": expect_object(tool.get("input_schema"), f"tools[{index}].input_schema"),
        }
        if tool.get("description"):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools, skipped


def chat_tool_choice(choice: Any, has_tools: bool) -> dict:
    """Anthropic's tool_choice (auto, any, tool, none; disable_parallel_tool_use) as chat fields."""
    if choice is None:
        return {}
    choice = expect_object(choice, "tool_choice")
    kind = choice.get("type")
    fields: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    if kind == "auto" or (kind == "none" and not has_tools):
        return {**fields, "tool_choice": "auto"} if has_tools else {}
    if kind == "none":
        return {"tool_choice": "none"}
    if kind == "any":
        return {**fields, "tool_choice": "required"}
    if kind == "tool":
        name = expect_str(choice.get("name"), "tool_choice.name")
        return {**fields, "tool_choice": {"type": "function", "function": {"name": name}}}
    raise refuse(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


# --- the response ------------------------------------------------------------------------------


class MessagesReply(ChunkTranslator):
    """A chat reply's chunks as Anthropic's stream events (:meth:`opening`, :meth:`add`,
    :meth:`finish`, :meth:`failure`), or its whole body as a message (:meth:`complete`)."""

    def __init__(self, model: str, n_prompt: int) -> None:
        self.model, self.n_prompt = model, n_prompt
        self.id = new_id("msg")
        self.index = -1  # the content block being written
        self.open: str | None = None  # its type
        self.calls: dict[int, int] = {}  # chat tool-call index -> content block index
        self.arguments: dict[int, str] = {}

    def message(
        self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict
    ) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def complete(self, chat: dict, stop_string: str | None) -> dict:
        choice = chat["choices"][0]
        message = choice["message"]
        content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        for call in message.get("tool_calls") or ():
            function = call["function"]
            content.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                            "input": decoded_arguments(function["arguments"])})  # fmt: skip
        reason, sequence = _stop_reason(choice["finish_reason"], stop_string)
        body = self.message(content, reason, sequence, _usage(chat["usage"]))
        return {**body, **_blocks(chat)}

    # events

    def opening(self, n_cached: int = 0) -> list[tuple[str, dict]]:
        """message_start (its usage as far as known: the prompt computed and reused) and a ping."""
        usage = {
            "input_tokens": self.n_prompt - n_cached,
            "cache_read_input_tokens": n_cached,
            "output_tokens": 0,
        }
        start = {"type": "message_start", "message": self.message([], None, None, usage)}
        return [("message_start", start), ("ping", {"type": "ping"})]

    def finish(self, final_chunks: list[dict], stop_string: str | None) -> list[tuple[str, dict]]:
        events, finish, blocks = self.ending(final_chunks)
        reason, sequence = _stop_reason(finish, stop_string)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": _usage(blocks["usage"]), **_blocks(blocks)}  # fmt: skip
        return [*events, ("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def failure(self, status: int, message: str) -> list[tuple[str, dict]]:
        return [("error", error_body(status, message))]

    def _text(self, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open != "text":
            events += self._close()
            events += self._start({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [
            *events,
            ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}),
        ]

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        events = []
        number = call.get("index", 0)
        function = call.get("function") or {}
        if number not in self.calls:
            events += self._close()
            block = {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu"),
                "name": function.get("name", ""),
                "input": {},
            }
            events += self._start(block)
            self.calls[number] = self.index
        if function.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append(
                ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
            )
        return events

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        self.index += 1
        self.open = block["type"]
        return [
            (
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        ]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _stop_reason(finish_reason: str, stop_string: str | None) -> tuple[str, str | None]:
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def _usage(usage: Mapping) -> dict:
    """Anthropic's usage: input_tokens are those computed, cache_read_input_tokens those reused."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage["completion_tokens"],
    }


def _blocks(chat: Mapping) -> dict:
    """Our statistics blocks, beside Anthropic's fields."""
    return {key: chat[key] for key in ("timings", "stats", "speculative") if key in chat}
