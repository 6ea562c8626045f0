"""OpenAI's response shapes, one definition for the HTTP server and the Python facade: the
``chat.completion`` / ``text_completion`` bodies, their stream chunks, and the blocks every
response carries (``usage``, llama-server's ``timings``, LM Studio's ``stats``, our
``speculative``). Ids and times are arguments (:class:`ResponseShape`, :class:`Timeline`), so a
shape depends only on what it is given, never on who ran the generation."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..engine.config import GenerationConfig
from ..engine.stats import FinishReason, GenerationStats

MODEL_ALIAS = "cactus-edge"  # the model id when none is named; a server accepts it whatever it serves


def openai_finish(reason: FinishReason | None) -> str:
    """OpenAI's finish_reason: "length", or "stop" for everything that ended on our side (an
    end-of-generation token, a stop string, a cancel: OpenAI has no name for the last two)."""
    return "length" if reason == "length" else "stop"


@dataclass(frozen=True)
class Timeline:
    """One request's moments, in time.perf_counter() seconds, for the ``stats`` block.

    arrived: the request came in (the HTTP server: its headers; the facade: the call).
    started: its generation took the engine (None: it never did).
    first_token: the first token came out (None: none did).
    ended: the generation's final event.
    """

    arrived: float
    started: float | None
    first_token: float | None
    ended: float


def response_blocks(stats: GenerationStats, config: GenerationConfig, timeline: Timeline) -> dict:
    """usage, llama-server ``timings``, LM Studio ``stats`` and our ``speculative`` block."""
    return {
        "usage": _usage(stats),
        "timings": _timings(stats),
        "stats": _lm_studio_stats(stats, timeline),
        "speculative": _speculative(stats, config),
    }


def _usage(stats: GenerationStats) -> dict:
    """OpenAI's usage block; cached tokens are the prompt prefix reused (the live cache or the
    prompt cache); accepted/rejected prediction tokens are the drafts proposed from a predicted
    output that the target kept or refused."""
    accepted, rejected = stats.prediction_tokens
    return {
        "prompt_tokens": stats.n_prompt_tokens,
        "completion_tokens": stats.n_tokens,
        "total_tokens": stats.n_prompt_tokens + stats.n_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.n_prompt_tokens - stats.n_prompt_decoded},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": rejected,
        },
    }


def _timings(stats: GenerationStats) -> dict:
    """llama-server's ``timings`` block (same names and meanings)."""
    decoded, prefill_ms = stats.n_prompt_decoded, stats.prefill_ms
    return {
        "cache_n": stats.n_prompt_tokens - decoded,
        "prompt_n": decoded,
        "prompt_ms": prefill_ms,
        "prompt_per_token_ms": prefill_ms / decoded if decoded else 0.0,
        "prompt_per_second": decoded / (prefill_ms / 1000) if prefill_ms > 0 else 0.0,
        "predicted_n": stats.n_tokens,
        "predicted_ms": stats.decode_ms,
        "predicted_per_token_ms": stats.decode_ms / stats.n_tokens if stats.n_tokens else 0.0,
        "predicted_per_second": stats.tokens_per_second,
        "draft_n": stats.n_drafted,
        "draft_n_accepted": stats.n_accepted,
    }


def _lm_studio_stats(stats: GenerationStats, timeline: Timeline) -> dict:
    """LM Studio's ``stats`` block; times in seconds from the request's arrival, queueing included."""
    arrived, end = timeline.arrived, timeline.ended
    first = timeline.first_token if timeline.first_token is not None else end
    decided = sum(step.n_decided for step in stats.steps)
    return {
        "tokens_per_second": stats.tokens_per_second,
        "time_to_first_token": first - arrived,
        "generation_time": end - (timeline.started or arrived),
        "queue_time": (timeline.started or end) - arrived,
        "stop_reason": stats.finish_reason,
        "total_draft_tokens_count": stats.n_drafted,
        "accepted_draft_tokens_count": stats.n_accepted,
        "rejected_draft_tokens_count": stats.n_drafted - stats.n_accepted,
        "ignored_draft_tokens_count": stats.n_drafted - decided,
    }


def _speculative(stats: GenerationStats, config: GenerationConfig) -> dict:
    """Our own block: the settings that produced the reply and what speculation did."""
    return {
        "method": stats.method,
        "delta": config.delta if config.method == "cactus" else None,
        "lossless": not stats.lossy,
        "n_draft": config.n_draft,
        "drafter": config.drafter if config.method != "none" else None,
        "acceptance_length": stats.acceptance_length,
        "tokens_per_verifier_call": stats.tokens_per_verifier_call,
        "verifier_calls": stats.n_verifier_calls,
        "drafted": stats.n_drafted,
        "accepted": stats.n_accepted,
        "forced": stats.n_forced,
        "draft_length_histogram": {str(k): v for k, v in stats.draft_length_histogram.items()},
        "accepted_by_position": list(stats.accepted_by_position),
        "kl_mean": stats.kl_mean,
        "kl_total": stats.kl_total,
        "kl_budget": config.kl_budget,
    }


@dataclass(frozen=True)
class ResponseShape:
    """Chat (``chat.completion``) or legacy completions (``text_completion``) bodies and chunks
    of one response. ``id`` and ``created`` (Unix seconds) are the response's: every chunk of a
    stream carries the same ones."""

    chat: bool
    model: str
    include_usage: bool
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str, include_usage: bool = False) -> ResponseShape:
        """A shape with a fresh id, created now."""
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        return cls(chat, model, include_usage, completion_id, int(time.time()))

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def complete(self, text: str | None, finish_reason: FinishReason | None, blocks: dict) -> dict:
        """The whole response: ``text`` and how the generation ended (the engine's reason)."""
        finish = openai_finish(finish_reason)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            return {**self._envelope("chat.completion", [choice]), **blocks}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._envelope("text_completion", [choice]), **blocks}

    def chunk(self, choices: list[dict], **extra) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)
        if self.include_usage:
            body["usage"] = None  # OpenAI's: null on every chunk but the last
        return {**body, **extra}

    def role_chunk(self) -> dict | None:
        """A chat stream's first chunk (completions streams have none)."""
        return self.chunk([self._choice(None, None, role=True)]) if self.chat else None

    def text_chunk(self, text: str) -> dict:
        return self.chunk([self._choice(text, None)])

    def final_chunks(self, finish_reason: FinishReason | None, blocks: dict) -> list[dict]:
        """The chunk with the finish reason (and our blocks), then with include_usage the usage
        chunk (``choices: []``)."""
        extra = {key: value for key, value in blocks.items() if key != "usage"}
        if not self.include_usage:
            extra["usage"] = blocks["usage"]  # not OpenAI's, harmless: every response carries usage
        finish = openai_finish(finish_reason)
        chunks = [self.chunk([self._choice(None if self.chat else "", finish)], **extra)]
        if self.include_usage:
            chunks.append({**self.chunk([]), **blocks})
        return chunks
