"""One response assembled from the engine's events, for the server and the facade alike: its text,
its tool calls (parsed from the text, :mod:`cactus_edge.constraints.tools`) and its logprobs, as a whole body
(:meth:`Reply.complete`) or as stream chunks (:meth:`Reply.add`, then :meth:`Reply.finish`)."""

from __future__ import annotations

from typing import Any

from ..constraints.tools import ContentDelta, ToolSetup, parse_tool_calls
from ..engine.events import StreamEvent
from ..rules.logprobs import TokenLogprob
from .shapes import ResponseShape, openai_finish


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    """One ``choices[].logprobs.content[]`` entry (OpenAI's chat shape)."""
    return {
        "token": _text(entry.token_bytes),
        "logprob": entry.logprob,
        "bytes": list(entry.token_bytes),
        "top_logprobs": [
            {"token": _text(data), "logprob": logprob, "bytes": list(data)}
            for (_, logprob), data in zip(entry.top, entry.top_bytes, strict=True)
        ],
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Legacy completions' ``logprobs`` object: tokens, their logprobs, the top alternatives and
    each token's character offset in the text (from ``offset``)."""
    tokens = [_text(e.token_bytes) for e in entries]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {_text(data): logprob for (_, logprob), data in zip(e.top, e.top_bytes, strict=True)}
            for e in entries
        ],
        "text_offset": offsets,
    }


class Reply:
    """One response's content, calls and logprobs, from its events (see the module docstring)."""

    def __init__(self, shape: ResponseShape, tools: ToolSetup | None = None, logprobs: bool = False) -> None:
        self.shape, self.tools, self.logprobs = shape, tools, logprobs
        self.parser = tools.parser() if tools is not None and tools.calls_allowed and shape.chat else None
        self.text: list[str] = []
        self.entries: list[TokenLogprob] = []
        self._pending: list[TokenLogprob] = []  # logprobs not yet sent in a chunk
        self._sent_chars = 0
        self._n_calls = 0

    def _collect(self, event: StreamEvent) -> None:
        self.text.append(event.text)
        if event.logprob is not None:
            self.entries.append(event.logprob)
            self._pending.append(event.logprob)

    # --- a whole body ------------------------------------------------------------------------------

    def complete(self, final: StreamEvent, blocks: dict) -> dict:
        """The whole response once ``final`` (the final event) has come; every earlier event must
        have gone through :meth:`add_quietly`."""
        self._collect(final)
        text = "".join(self.text)
        finish = openai_finish(final.finish_reason)
        content: str | None = text
        calls: list[dict] = []
        if self.parser is not None:
            # The stream's content exactly; null beside calls only (a message without any has text).
            content, parsed = parse_tool_calls(
                text, self.tools.names, calls_only=self.tools.constrained, cut=_was_cut(final)
            )
            calls = [call.to_openai() for call in parsed]
            content = content if calls else content or ""
        if calls and finish == "stop":
            finish = "tool_calls"
        body = self.shape.complete(content, final.finish_reason, blocks)
        choice = body["choices"][0]
        choice["finish_reason"] = finish
        if calls:
            choice["message"]["tool_calls"] = calls
        if self.logprobs:
            choice["logprobs"] = self._logprobs_block(self.entries, 0)
        return body

    def add_quietly(self, event: StreamEvent) -> None:
        """Take an event for :meth:`complete` (nothing is sent)."""
        self._collect(event)

    # --- a stream ------------------------------------------------------------------------------------

    def add(self, event: StreamEvent) -> list[dict]:
        """The chunks to send for one event (often none: text may be held back)."""
        self._collect(event)
        if self.parser is None:
            return [self._content_chunk(event.text)] if event.text else []
        return self._delta_chunks(self.parser.feed(event.text))

    def finish(self, final: StreamEvent, blocks: dict) -> list[dict]:
        """The last chunks: what the tool parser still held, then the finish chunk(s)."""
        chunks = self.add(final) if final.text else []
        if self.parser is not None:
            chunks += self._delta_chunks(self.parser.finish(cut=_was_cut(final)))
        finishing = self.shape.final_chunks(final.finish_reason, blocks)
        choice = finishing[0]["choices"][0]
        if self._n_calls and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        if self.logprobs and self._pending:
            choice["logprobs"] = self._logprobs_block(self._take_pending(), self._sent_chars)
        return chunks + finishing

    def _content_chunk(self, text: str) -> dict:
        chunk = self.shape.text_chunk(text)
        if self.logprobs and self._pending:
            chunk["choices"][0]["logprobs"] = self._logprobs_block(self._take_pending(), self._sent_chars)
        self._sent_chars += len(text)
        return chunk

    def _delta_chunks(self, deltas) -> list[dict]:
        chunks = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                chunks.append(self._content_chunk(delta.text))
                continue
            if delta.id is not None:
                self._n_calls += 1
            chunks.append(self.shape.chunk([{"index": 0, "delta": delta.to_openai(), "finish_reason": None}]))
        return chunks

    def _take_pending(self) -> list[TokenLogprob]:
        pending, self._pending = self._pending, []
        return pending

    def _logprobs_block(self, entries: list[TokenLogprob], offset: int) -> dict:
        if self.shape.chat:
            return {"content": [chat_logprob(e) for e in entries], "refusal": None}
        return completion_logprobs(entries, offset)


def _was_cut(final: StreamEvent) -> bool:
    """Whether the generation was cut (max_tokens, a full context, a stop string, a cancel)
    rather than ended by the model: then an unfinished tool call is dropped, not shown."""
    return final.finish_reason != "stop"
