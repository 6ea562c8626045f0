"""Response bodies: OpenAI's chat / completions shapes, our extra blocks (usage, timings, stats,
speculative) and server-sent-event framing."""

from __future__ import annotations

import json
import time
import uuid

from ..config import GenerationConfig
from ..stats import GenerationStats
from .scheduler import Job


def openai_finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"  # cancelled or a stop string: stopped on our side


def response_blocks(stats: GenerationStats, config: GenerationConfig, job: Job) -> dict:
    """usage, llama-server ``timings``, LM Studio ``stats`` and our ``speculative`` block."""
    return {
        "usage": _usage(stats),
        "timings": _timings(stats),
        "stats": _lm_studio_stats(stats, job, end=time.perf_counter()),
        "speculative": _speculative(stats, config),
    }


def _usage(stats: GenerationStats) -> dict:
    """OpenAI's usage block; cached tokens are the prompt prefix reused from the last request."""
    return {
        "prompt_tokens": stats.n_prompt_tokens,
        "completion_tokens": stats.n_tokens,
        "total_tokens": stats.n_prompt_tokens + stats.n_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.n_prompt_tokens - stats.n_prompt_decoded},
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


def _lm_studio_stats(stats: GenerationStats, job: Job, end: float) -> dict:
    """LM Studio's ``stats`` block; times in seconds from the job's arrival, queueing included."""
    first = job.first_token if job.first_token is not None else end
    decided = sum(step.n_decided for step in stats.steps)
    return {
        "tokens_per_second": stats.tokens_per_second,
        "time_to_first_token": first - job.arrived,
        "generation_time": end - (job.started or job.arrived),
        "queue_time": (job.started or end) - job.arrived,
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
        "draft_length_histogram": {str(k): v for k, v in stats.draft_length_histogram.items()},
        "accepted_by_position": list(stats.accepted_by_position),
        "kl_mean": stats.kl_mean,
        "kl_total": stats.kl_total,
        "kl_budget": getattr(config, "kl_budget", None),
    }


class ResponseShape:
    """Chat (``chat.completion``) or legacy completions (``text_completion``) bodies and chunks."""

    def __init__(self, chat: bool, model: str, include_usage: bool) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

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

    def complete(self, text: str, finish: str, blocks: dict) -> dict:
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
            body["usage"] = None
        return {**body, **extra}

    def role_chunk(self) -> dict | None:
        return self.chunk([self._choice(None, None, role=True)]) if self.chat else None

    def text_chunk(self, text: str) -> dict:
        return self.chunk([self._choice(text, None)])

    def final_chunks(self, finish: str, blocks: dict) -> list[dict]:
        extra = {key: value for key, value in blocks.items() if key != "usage"}
        if not self.include_usage:
            extra["usage"] = blocks["usage"]  # not OpenAI's, harmless: every response carries usage
        chunks = [self.chunk([self._choice(None if self.chat else "", finish)], **extra)]
        if self.include_usage:
            chunks.append({**self.chunk([]), **blocks})
        return chunks


def sse_event(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()
