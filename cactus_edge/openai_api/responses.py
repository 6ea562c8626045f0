"""OpenAI's Responses API (``POST /v1/responses``) as a conversion over chat completions: a request
becomes a chat request (:func:`read_responses_request`), and the chat reply's chunks become the
Responses API's events or response object (:class:`ResponsesReply`). Stored responses live in a
bounded :class:`ResponseStore`, so that ``previous_response_id`` continues a conversation.

How each request field is treated (docs/server.md has the table):

* Used: ``input`` (a string, or items: messages with text parts, ``function_call``,
  ``function_call_output``; ``reasoning`` items are dropped), ``instructions``, ``tools``
  (function tools; other types are left out and reported), ``tool_choice``,
  ``parallel_tool_calls``, ``text.format``, ``max_output_tokens``, ``temperature``, ``top_p``,
  ``stream``, ``store``, ``previous_response_id``, ``prompt_cache_key``, ``metadata`` (echoed),
  and our ``top_k``, ``min_p``, ``seed``, ``speculative``.
* Refused (400): ``background: true``, ``conversation``, ``prompt`` (templates), images, files
  and audio in the input, a ``tool_choice`` naming a tool that is not a function.
* Anything else (``reasoning``, ``include``, ``truncation``, ``user``, ``service_tier``,
  ``max_tool_calls``, ``safety_identifier``, …) is accepted and ignored.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .items import (
    ChunkTranslator,
    add_tool_call,
    check_tool_results,
    expect_list,
    expect_object,
    expect_str,
    new_id,
    refuse,
    text_of_parts,
    tool_call,
    unsupported,
)

TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
# Fields handed to the chat request under the same name.
SAME_NAME = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "speculative", "prompt_cache_key",
             "parallel_tool_calls")  # fmt: skip
# The Responses name of a chat field an error names.
PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
REFUSED = {
    "background": "background responses are not served: send the request and wait for it",
    "conversation": "the Conversations API is not served: use previous_response_id or send the history",
    "prompt": "prompt templates are not served: send instructions and input",
}
DEFAULT_STORE_BYTES = 64 * 2**20  # stored responses kept in memory, least recently used out first


@dataclass
class ResponsesRequest:
    """A Responses request read: the chat request that answers it, and what its response echoes."""

    chat_body: dict
    echo: dict  # the request's settings a response object repeats
    store: bool
    skipped_tools: list[str]  # tools left out of the prompt (not functions)
    history: list[dict]  # the conversation's messages before this request's input, without instructions
    messages: list[dict]  # this request's input as chat messages
    item_ids: frozenset[str]  # ids of the conversation's items so far (the chain and this input)


# --- the request -------------------------------------------------------------------------------


def read_responses_request(body: Any, store: ResponseStore | None) -> ResponsesRequest:
    """A Responses request as a chat request; InvalidSettingError naming the Responses field."""
    body = expect_object(body, "body")
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False):
            raise unsupported(f"{name}: {why}", name)
    previous = _previous(body.get("previous_response_id"), store)
    messages, where, item_ids = input_messages(body.get("input"))
    if previous is not None:
        _check_not_repeated(item_ids, previous)
    history = previous.messages if previous is not None else []
    instructions = body.get("instructions")
    system = [{"role": "system", "content": expect_str(instructions, "instructions")}] if instructions else []
    conversation = [*system, *history, *messages]
    offset = len(system) + len(history)
    check_tool_results(conversation, {offset + index: name for index, name in where.items()})
    tools, skipped = function_tools(body.get("tools"))
    chat_body = _chat_body(body, conversation, tools, skipped)
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise refuse(f"store must be a boolean, got {store_it!r}", "store")
    chain_ids = previous.item_ids if previous is not None else frozenset()
    return ResponsesRequest(
        chat_body, _echo(body, tools), store_it, skipped, history, messages, chain_ids | item_ids
    )


def _chat_body(body: Mapping, conversation: list[dict], tools: list[dict], skipped: list[str]) -> dict:
    """The chat completions request that answers a Responses request."""
    chat_body = {name: body[name] for name in SAME_NAME if body.get(name) is not None}
    chat_body.update(
        messages=conversation, stream=bool(body.get("stream")), stream_options={"include_usage": True}
    )
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    choice = chat_tool_choice(body["tool_choice"], skipped) if body.get("tool_choice") is not None else None
    if tools:
        chat_body["tools"] = tools
    if choice is not None and (tools or choice not in ("auto", "none")):
        chat_body["tool_choice"] = choice  # without tools, the chat layer refuses a call it cannot make
    response_format = chat_response_format(body.get("text"))
    if response_format is not None:
        chat_body["response_format"] = response_format
    return chat_body


def _previous(response_id: Any, store: ResponseStore | None) -> StoredResponse | None:
    if response_id is None:
        return None
    response_id = expect_str(response_id, "previous_response_id")
    stored = store.get(response_id) if store is not None else None
    if stored is None:
        raise refuse(
            f"previous_response_id {response_id!r} is not a stored response: it was never stored "
            "(store: false), was deleted, or was evicted or lost when the server restarted; "
            "send the whole conversation as input instead",
            "previous_response_id",
        )
    return stored


def _check_not_repeated(item_ids: frozenset[str], previous: StoredResponse) -> None:
    repeated = sorted(item_ids & previous.item_ids)
    if repeated:
        raise refuse(
            f"input repeats item {repeated[0]!r} of the conversation previous_response_id continues; "
            "send either previous_response_id and only the new items, or the whole history without it",
            "input",
        )


def input_messages(value: Any) -> tuple[list[dict], dict[int, str], frozenset[str]]:
    """(chat messages, the input field of each tool message by its index, the items' ids)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], {}, frozenset()
    items = expect_list(value, "input")
    messages: list[dict] = []
    where: dict[int, str] = {}
    ids = set()
    for index, item in enumerate(items):
        param = f"input[{index}]"
        item = expect_object(item, param)
        if isinstance(item.get("id"), str):
            ids.add(item["id"])
        _add_item(messages, where, item, param)
    if not messages:
        raise refuse("input must hold at least one message or tool output", "input")
    return messages, where, frozenset(ids)


def _add_item(messages: list[dict], where: dict[int, str], item: Mapping, param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise refuse(
                f"{param}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", f"{param}.role"
            )
        content = text_of_parts(item.get("content"), f"{param}.content", TEXT_PARTS)
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    elif kind == "function_call":
        name = expect_str(item.get("name"), f"{param}.name")
        call_id = expect_str(item.get("call_id"), f"{param}.call_id")
        add_tool_call(
            messages, tool_call(call_id, name, expect_str(item.get("arguments", "{}"), f"{param}.arguments"))
        )
    elif kind == "function_call_output":
        call_id = expect_str(item.get("call_id"), f"{param}.call_id")
        output = text_of_parts(item.get("output"), f"{param}.output", TEXT_PARTS)
        where[len(messages)] = f"{param}.call_id"
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind != "reasoning":  # a model's reasoning: ours do not read it back
        raise unsupported(
            f"{param} is a {kind!r} item; this server takes message, function_call, function_call_output "
            "and reasoning items",
            f"{param}.type",
        )


def function_tools(value: Any) -> tuple[list[dict], list[str]]:
    """(chat tools for the function tools, names of the others: web_search, mcp, custom, …,
    which this server cannot run and leaves out of the prompt)."""
    if value is None:
        return [], []
    tools, skipped = [], []
    for index, tool in enumerate(expect_list(value, "tools")):
        tool = expect_object(tool, f"tools[{index}]")
        if tool.get("type") != "function":
            skipped.append(str(tool.get("name") or tool.get("type")))
            continue
        function = {"name": expect_str(tool.get("name"), f"tools[{index}].name")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        tools.append({"type": "function", "function": function})
    return tools, skipped


def chat_tool_choice(choice: Any, skipped: list[str]) -> Any:
    """A Responses tool_choice as chat's; one naming a tool that is not a function is refused."""
    if choice in ("auto", "none", "required"):
        return choice
    choice = expect_object(choice, "tool_choice")
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": expect_str(choice.get("name"), "tool_choice.name")}}
    raise unsupported(
        f"tool_choice names a {choice.get('type')!r} tool; this server runs function tools only"
        + (f" (left out of this request: {', '.join(skipped)})" if skipped else ""),
        "tool_choice",
    )


def chat_response_format(text: Any) -> dict | None:
    """``text.format`` as chat's response_format: json_schema (our grammars), json_object, text."""
    if text is None:
        return None
    fmt = expect_object(text, "text").get("format")
    if fmt is None:
        return None
    fmt = expect_object(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict") if key in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise refuse(
        f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format.type"
    )


def _echo(body: Mapping, tools: list[dict]) -> dict:
    """What a response object repeats of its request."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "temperature": body.get("temperature"),
        "text": {"format": fmt or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [{"type": "function", **tool["function"]} for tool in tools],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "user": None,
    }


# --- the response ------------------------------------------------------------------------------


class ResponsesReply(ChunkTranslator):
    """A chat reply's chunks as the Responses API's events (:meth:`opening`, :meth:`add`,
    :meth:`finish`, :meth:`failure`), or its whole body as a response object (:meth:`complete`)."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request, self.model = request, model
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.sequence = 0
        self.output: list[dict] = []  # items as they stand
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its item
        self.final: dict | None = None  # the response object once complete

    # the response object

    def response(self, status: str, usage: dict | None = None, extra: Mapping | None = None) -> dict:
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "usage": usage,
            "store": self.request.store,
            **self.request.echo,
        }
        return {**body, **(extra or {})}

    def complete(self, chat: dict) -> dict:
        """The response object for a whole chat completion body."""
        choice = chat["choices"][0]
        message = choice["message"]
        if message.get("content"):
            self.output.append(_message_item(new_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            function = call["function"]
            self.output.append(_call_item(call["id"], function["name"], function["arguments"], "completed"))
        self.final = self._finished(choice["finish_reason"], chat)
        return self.final

    def _finished(self, finish_reason: str, chat: Mapping) -> dict:
        incomplete = finish_reason == "length"
        extra = {key: chat[key] for key in ("timings", "stats", "speculative") if key in chat}
        body = self.response("incomplete" if incomplete else "completed", _usage(chat["usage"]), extra)
        if incomplete:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    # events

    def event(self, kind: str, **fields) -> tuple[str, dict]:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[tuple[str, dict]]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def finish(self, final_chunks: list[dict]) -> list[tuple[str, dict]]:
        """The last events, from the chat stream's finishing chunks (the finish, then usage)."""
        events, finish, blocks = self.ending(final_chunks)
        self.final = self._finished(finish, blocks)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=self.final)]

    def failure(self, message: str, code: str) -> list[tuple[str, dict]]:
        """A generation that failed after the stream began: ``error`` (with our code), then
        ``response.failed`` (whose error code OpenAI's types limit to its own names)."""
        failed = self.response("failed")
        failed["error"] = {"code": "server_error", "message": message}
        return [
            self.event("error", code=code, message=message, param=None),
            self.event("response.failed", response=failed),
        ]

    def _text(self, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            events += self._open(_message_item(new_id("msg"), "", "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._item_event("response.content_part.added", content_index=0, part=part))
        self.open["content"][0]["text"] += text
        events.append(
            self._item_event("response.output_text.delta", content_index=0, delta=text, logprobs=[])
        )
        return events

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        events = []
        item = self.calls.get(call.get("index", 0))
        if item is None:
            events += self._close()
            function = call.get("function") or {}
            item = _call_item(call.get("id") or new_id("call"), function.get("name", ""), "", "in_progress")
            self.calls[call.get("index", 0)] = item
            events += self._open(item)
        arguments = (call.get("function") or {}).get("arguments")
        if arguments:
            item["arguments"] += arguments
            events.append(self._item_event("response.function_call_arguments.delta", delta=arguments))
        return events

    def _open(self, item: dict) -> list[tuple[str, dict]]:
        self.open = item
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _item_event(self, kind: str, **fields) -> tuple[str, dict]:
        return self.event(kind, item_id=self.open["id"], output_index=len(self.output) - 1, **fields)

    def _close(self) -> list[tuple[str, dict]]:
        """The done events of the item being written."""
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._item_event("response.output_text.done", content_index=0, text=part["text"], logprobs=[])
            )
            events.append(self._item_event("response.content_part.done", content_index=0, part=dict(part)))
        else:
            events.append(
                self._item_event(
                    "response.function_call_arguments.done", arguments=item["arguments"], name=item["name"]
                )
            )
        item["status"] = "completed"
        events.append(
            self.event("response.output_item.done", output_index=len(self.output) - 1, item=dict(item))
        )
        self.open = None
        return events

    # what a stored response continues from

    def assistant_messages(self) -> list[dict]:
        """The response's output as chat messages, for a later previous_response_id."""
        messages: list[dict] = []
        for item in self.output:
            if item["type"] == "message":
                messages.append({"role": "assistant", "content": item["content"][0]["text"]})
            else:
                add_tool_call(messages, tool_call(item["call_id"], item["name"], item["arguments"]))
        return messages or [{"role": "assistant", "content": ""}]  # an empty reply is still a turn


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    item_id = "fc_" + call_id.removeprefix("call_")
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}  # fmt: skip


def _usage(usage: Mapping) -> dict:
    return {
        "input_tokens": usage["prompt_tokens"],
        # cache_write_tokens: what a request added to a provider's paid cache; ours costs nothing
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


# --- stored responses --------------------------------------------------------------------------


@dataclass
class StoredResponse:
    body: dict  # the response object, as GET /v1/responses/{id} returns it
    messages: list[dict]  # the conversation through this response, instructions left out
    item_ids: frozenset[str]
    n_bytes: int = 0


@dataclass
class ResponseStore:
    """Stored responses in memory, at most ``max_bytes`` (their JSON), least recently used out."""

    max_bytes: int = DEFAULT_STORE_BYTES
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    evictions: int = 0
    n_bytes: int = 0

    def keep(self, request: ResponsesRequest, reply: ResponsesReply) -> None:
        """Store a finished response, if its request asked to (``store``, true by default) and it
        fits the bound at all; then drop the least recently used until the bound holds."""
        if not request.store or reply.final is None:
            return
        output_ids = frozenset(item["id"] for item in reply.output)
        messages = [*request.history, *request.messages, *reply.assistant_messages()]
        stored = StoredResponse(reply.final, messages, request.item_ids | output_ids)
        stored.n_bytes = len(json.dumps(stored.body)) + len(json.dumps(messages))
        if stored.n_bytes > self.max_bytes:
            return
        with self._lock:
            self._entries[reply.id] = stored
            self.n_bytes += stored.n_bytes
            while self.n_bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.n_bytes -= evicted.n_bytes
                self.evictions += 1

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None:
                self._entries.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            stored = self._entries.pop(response_id, None)
            self.n_bytes -= stored.n_bytes if stored is not None else 0
            return stored is not None

    def __len__(self) -> int:
        return len(self._entries)
