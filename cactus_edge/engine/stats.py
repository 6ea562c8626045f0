"""Statistics of a generation, in a module that imports no llama.cpp (the TUI, the CLI and the
OpenAI-shaped layer read them without loading a model library)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Literal

# How a generation ended: an end-of-generation token, max_tokens or a full context, a stop string,
# or the caller's cancel / close.
FinishReason = Literal["stop", "length", "stop-string", "cancelled"]
# What proposed a step's drafts: the draft model, prompt lookup, or nothing (a plain step).
DraftSource = Literal["model", "lookup", "prediction", "forced", "none"]


@dataclass
class StepStats:
    """One verifier call. draft_ms / verify_ms are time inside llama_decode."""

    n_draft: int
    n_accepted: int
    draft_ms: float
    verify_ms: float
    total_ms: float
    kl: float | None = None  # mean KL(out ‖ target) over the positions decided this step
    drafter: DraftSource = "model"  # what proposed this block ("none": k = 0)
    n_decided: int = 0  # draft positions the rule judged (accepted ones + the first rejection)
    n_forced: int = 0  # accepted drafts the grammar forced (proposed without a draft model)


# Where a step's time goes (``--profile``): the two decodes, and host work by kind.
PROFILE_PARTS = (
    "draft decode",  # inside llama_decode, draft model
    "verify decode",  # inside llama_decode, target model
    "batch + logits",  # filling llama_batch, reaching the logits (no copy on the hot path)
    "draft processing",  # draft rows: top-k/top-p/softmax and sampling
    "target processing",  # target rows: the same
    "acceptance",  # the rule's verify
    "kl",  # the exact per-step KL of lossy rules
    "lookup",  # prompt n-gram search
    "grammar",  # the tokens a grammar forces (masks are counted where rows are processed)
    "planning",  # draft length choice and what auto learns
    "rollback",  # cutting rejected drafts from the caches
    "bookkeeping",  # everything else inside the step
)


class StepProfiler:
    """A lap timer over one step: each :meth:`lap` charges the time since the previous lap to a
    part, minus the llama_decode time it is told about, which goes to its decode part."""

    def __init__(self) -> None:
        self.ms = dict.fromkeys(PROFILE_PARTS, 0.0)
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, part: str, decode_ms: float = 0.0, decode_part: str = "") -> None:
        now = time.perf_counter()
        elapsed = (now - self._last) * 1000
        self._last = now
        if decode_part:
            self.ms[decode_part] += decode_ms
            elapsed -= decode_ms
        self.ms[part] += elapsed


@dataclass
class GenerationStats:
    """Running statistics of one generation (complete once it has finished).

    lossy: whether the rule can move the output away from the target's distribution (Cactus with
        delta > 0, typical acceptance); KL figures are only meaningful then.
    kl_total: sum over decided draft positions of the exact KL(out ‖ target): by the chain rule
        its expectation is the response-level KL (docs/methods.md, 'A KL budget per response').
    kl_budget: the response's KL budget (None: unlimited); kl_total never exceeds it.
    """

    method: str
    lossy: bool = False
    n_tokens: int = 0
    n_prompt_tokens: int = 0
    n_prompt_decoded: int = 0
    n_verifier_calls: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_forced: int = 0  # accepted draft tokens that the grammar forced (included in n_accepted)
    draft_model_off: bool = False  # model+lookup drafted by lookup alone: the model cannot pay here
    prompt_cache: str | None = None  # where the reused prefix came from: "live", "memory", "disk" or None
    prompt_cache_restore_ms: float = 0.0  # restoring a saved cache before the prefill
    prompt_cache_save_ms: float = 0.0  # saving the live cache the prompt discarded
    accepted_by_position: list[int] = field(default_factory=list)
    tried_by_position: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0  # the first step: the prompt's decode and the first token
    calibration_ms: float = 0.0  # `auto` measuring batch costs after the first token (once per engine)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    decode_ms: float = 0.0  # all time inside generation steps after the first (prefill excluded)
    kl_sum: float = 0.0
    kl_steps: int = 0
    kl_total: float = 0.0
    kl_budget: float | None = None
    finish_reason: FinishReason | None = None
    stop_string: str | None = None  # the stop string that ended the reply, if one did
    steps: list[StepStats] = field(default_factory=list)
    profile_ms: dict[str, float] = field(default_factory=dict)  # ms per PROFILE_PARTS entry

    @property
    def acceptance_length(self) -> float:
        """AL: accepted draft tokens per verifier call, bonus excluded (the Cactus paper's)."""
        return self.n_accepted / self.n_verifier_calls if self.n_verifier_calls else 0.0

    @property
    def tokens_per_verifier_call(self) -> float:
        """AL + 1 (the vLLM / Spec-Bench convention)."""
        return self.n_tokens / self.n_verifier_calls if self.n_verifier_calls else 0.0

    @property
    def n_decode_steps(self) -> int:
        """Verifier calls after the first (which decodes the prompt): the steps profile_ms covers."""
        return max(self.n_verifier_calls - 1, 0)

    @property
    def overhead_ms(self) -> float:
        """Generation time spent outside llama_decode (sampling, rules, bookkeeping)."""
        return max(0.0, self.decode_ms - self.draft_ms - self.verify_ms)

    @property
    def tokens_per_second(self) -> float:
        """Tokens per second after the first (the prefill's), as llama.cpp's eval rate counts."""
        return (self.n_tokens - 1) / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    @property
    def draft_length_histogram(self) -> dict[int, int]:
        """How many verifier calls drafted k tokens, per k (what `auto` chose)."""
        counts: dict[int, int] = {}
        for step in self.steps:
            counts[step.n_draft] = counts.get(step.n_draft, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def prediction_tokens(self) -> tuple[int, int]:
        """(accepted, rejected) draft tokens proposed from the client's predicted output."""
        steps = [step for step in self.steps if step.drafter == "prediction"]
        accepted = sum(step.n_accepted - step.n_forced for step in steps)
        return accepted, sum(step.n_draft - step.n_forced for step in steps) - accepted

    @property
    def first_token_ms(self) -> float:
        """From the start of the generation to its first token: the prompt cache's save and
        restore, then the prefill."""
        return self.prompt_cache_save_ms + self.prompt_cache_restore_ms + self.prefill_ms

    @property
    def kl_mean(self) -> float | None:
        return self.kl_sum / self.kl_steps if self.kl_steps else None

    def record(self, step: StepStats, prefill: bool = False) -> None:
        """Count one verifier call. ``prefill``: the first, which decodes the prompt and gives the
        first token; its time is prefill_ms, not decode time."""
        self.steps.append(step)
        if prefill:
            self.prefill_ms += step.total_ms
        else:
            self.draft_ms += step.draft_ms
            self.verify_ms += step.verify_ms
            self.decode_ms += step.total_ms
        self.n_verifier_calls += 1
        self.n_drafted += step.n_draft
        self.n_accepted += step.n_accepted
        self.n_forced += step.n_forced
        grow = step.n_draft - len(self.tried_by_position)
        if grow > 0:
            self.tried_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for position in range(step.n_decided):
            self.tried_by_position[position] += 1
            if position < step.n_accepted:
                self.accepted_by_position[position] += 1
        if step.kl is not None:
            kl = max(0.0, step.kl)  # exact KL is >= 0; float rounding can leave -1e-17
            self.kl_sum += kl
            self.kl_steps += 1
            self.kl_total += kl * step.n_decided

    def summary(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k not in ("steps", "kl_sum", "kl_steps")}
        data.update(
            acceptance_length=self.acceptance_length,
            tokens_per_verifier_call=self.tokens_per_verifier_call,
            overhead_ms=self.overhead_ms,
            tokens_per_second=self.tokens_per_second,
            kl_mean=self.kl_mean,
            draft_length_histogram=self.draft_length_histogram,
        )
        return data

    def report(self) -> dict:
        """What a reply's consumer reads (`generate --json`): the summary without the engine's
        own bookkeeping."""
        return {k: v for k, v in self.summary().items() if k not in _INTERNAL_FIELDS}

    def summary_line(self, constrained: bool = False) -> str:
        """One line after a reply. KL appears only when a lossy rule actually decided a draft
        token (lossless rules and plain steps are exact); the tokens the grammar forced, only
        under a constraint (``constrained``)."""
        kl = f", KL {_clean(self.kl_mean)}" if self.lossy and self.kl_mean is not None else ""
        budget = ""
        if kl and self.kl_budget is not None:
            budget = f" (total {_clean(self.kl_total)} of budget {self.kl_budget:g})"
        histogram = f", draft lengths {self.draft_length_histogram}" if self.method != "none" else ""
        forced = f", {self.n_forced} forced by the grammar" if constrained else ""
        off = ", lookup alone (the draft model cannot pay on this machine)" if self.draft_model_off else ""
        return (
            f"[{self.method}] {self.n_tokens} tokens, {self.tokens_per_second:.1f} tok/s, "
            f"AL {self.acceptance_length:.2f} ({self.tokens_per_verifier_call:.2f} tokens/verifier call), "
            f"{self.n_verifier_calls} verifier calls{kl}{budget}{histogram}{forced}{off}, "
            f"finish: {self.finish_reason}"
        )


_INTERNAL_FIELDS = ("lossy", "n_prompt_decoded", "calibration_ms")


def profile_table(profile_ms: dict[str, float], n_steps: int, title: str = "") -> str:
    """Where a step's time went (``--profile``): ms per step for each part, its share of the
    step, and the host total (everything outside the two llama_decode parts)."""
    n_steps = max(n_steps, 1)
    total = sum(profile_ms.values()) or 1.0
    host = total - profile_ms.get("draft decode", 0.0) - profile_ms.get("verify decode", 0.0)
    lines = [f"{title}per step, {n_steps} steps | ms | share", "|---|---|---|"]
    for part in PROFILE_PARTS:
        ms = profile_ms.get(part, 0.0)
        lines.append(f"| {part} | {ms / n_steps:.3f} | {100 * ms / total:.1f}% |")
    lines.append(f"| **host total** | **{host / n_steps:.3f}** | **{100 * host / total:.1f}%** |")
    return "\n".join(lines)


def _clean(value: float, digits: int = 4) -> str:
    """A number for people: never a negative zero (-0.0000) from rounding a tiny negative."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text
