"""The speculative decoding engine: draft → verify → accept → roll back, streamed token by token.

State between steps is one list, ``committed`` (prompt + every emitted token). Each model's KV cache
always holds a prefix of it; a step first feeds each model whatever committed tokens it has not
seen (usually just the last emitted token; after a fully accepted block the draft also catches up
on its last draft token, and after plain steps on every token it skipped), so rollback is a single
truncate. The draft model may also be fed a lookup guess in the same batch; guessed tokens its
samples do not follow are cut again before the step ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .acceptance import AcceptanceRule, Cactus, make_rule, output_kl
from .adaptive import (
    SPECULATION_MARGIN,
    AcceptanceTracker,
    CostModel,
    choose_draft_length,
    could_pay,
    expected_run,
)
from .backend import Detokenizer, LlamaModel, set_verbose
from .chat import render_chat
from .errors import ContextLengthError
from .gguf_info import check_pair_compatible, read_gguf
from .lookup import lookup_continuation, point_mass_rows
from .sampling import SamplingConfig, SparseProbs, process_logits, row_prob, sample_token

METHODS = ("cactus", "sps", "tas", "exact", "none")
DRAFTERS = ("model", "lookup", "model+lookup")
MAX_AUTO_DRAFT = 12  # the longest block `auto` considers
AUTO_DRAFT_P_MIN = 0.2  # with `auto`, stop drafting once the draft's own p(d) falls below this


@dataclass(frozen=True)
class GenerationConfig:
    """Everything that shapes one generation. Sampling settings apply to draft and target alike."""

    method: str = "cactus"
    delta: float = 1.0
    n_draft: int | str = "auto"  # a fixed block length, or "auto": chosen per step from costs
    drafter: str = "model"  # "model", "lookup" (prompt n-grams) or "model+lookup"
    draft_p_min: float | None = None  # stop drafting below this draft p(d); None: 0.2 with auto
    temperature: float = 0.6
    top_k: int = 20
    top_p: float = 0.95
    min_p: float = 0.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.n_draft != "auto" and (
            isinstance(self.n_draft, bool) or not isinstance(self.n_draft, int) or not 0 <= self.n_draft <= 64
        ):
            raise ValueError(f"n_draft must be 'auto' or an integer in [0, 64], got {self.n_draft!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.draft_p_min is not None and not 0.0 <= self.draft_p_min < 1.0:
            raise ValueError(f"draft_p_min must be in [0, 1), got {self.draft_p_min!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        # Building these validates temperature … min_p and delta (whatever the method, so a bad
        # delta is caught before someone switches to cactus).
        _ = self.sampling, self.rule, Cactus(self.delta)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def rule(self) -> AcceptanceRule | None:
        return None if self.method == "none" else make_rule(self.method, self.delta)

    @property
    def auto(self) -> bool:
        return self.n_draft == "auto"

    @property
    def max_draft(self) -> int:
        return MAX_AUTO_DRAFT if self.auto else self.n_draft

    @property
    def p_min(self) -> float:
        if self.draft_p_min is not None:
            return self.draft_p_min
        return AUTO_DRAFT_P_MIN if self.auto else 0.0

    @property
    def uses_model(self) -> bool:
        return self.method != "none" and self.drafter in ("model", "model+lookup")


@dataclass
class StepStats:
    """One verifier call. draft_ms / verify_ms are time inside llama_decode."""

    n_draft: int
    n_accepted: int
    draft_ms: float
    verify_ms: float
    total_ms: float
    kl: float | None = None
    drafter: str = "model"  # what proposed this block: "model", "lookup" or "none" (k = 0)


@dataclass
class GenerationStats:
    method: str
    n_tokens: int = 0
    n_prompt_tokens: int = 0
    n_prompt_decoded: int = 0
    n_verifier_calls: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    tried_by_position: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    decode_ms: float = 0.0  # all time inside generation steps (prefill excluded)
    kl_sum: float = 0.0
    kl_steps: int = 0
    finish_reason: str | None = None
    steps: list[StepStats] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """AL: accepted draft tokens per verifier call, bonus excluded (the Cactus paper's)."""
        return self.n_accepted / self.n_verifier_calls if self.n_verifier_calls else 0.0

    @property
    def tokens_per_verifier_call(self) -> float:
        """AL + 1 (the vLLM / Spec-Bench convention)."""
        return self.n_tokens / self.n_verifier_calls if self.n_verifier_calls else 0.0

    @property
    def overhead_ms(self) -> float:
        """Generation time spent outside llama_decode (sampling, rules, bookkeeping)."""
        return max(0.0, self.decode_ms - self.draft_ms - self.verify_ms)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of generation (prefill excluded)."""
        return self.n_tokens / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    @property
    def draft_length_histogram(self) -> dict[int, int]:
        """How many verifier calls drafted k tokens, per k (what `auto` chose)."""
        counts: dict[int, int] = {}
        for step in self.steps:
            counts[step.n_draft] = counts.get(step.n_draft, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def kl_mean(self) -> float | None:
        return self.kl_sum / self.kl_steps if self.kl_steps else None

    def record(self, step: StepStats, accept_probs_len: int) -> None:
        self.steps.append(step)
        self.n_verifier_calls += 1
        self.n_drafted += step.n_draft
        self.n_accepted += step.n_accepted
        grow = step.n_draft - len(self.tried_by_position)
        if grow > 0:
            self.tried_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for position in range(accept_probs_len):
            self.tried_by_position[position] += 1
            if position < step.n_accepted:
                self.accepted_by_position[position] += 1
        if step.kl is not None:
            self.kl_sum += step.kl
            self.kl_steps += 1

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


@dataclass(frozen=True)
class StreamEvent:
    """One emitted token (or, last, the end of the stream).

    text: visible text this event adds ("" while a possible stop string or an unfinished UTF-8
        character is held back).
    token: the token id; None on the final event.
    from_draft: True for an accepted draft token, False for a token the target produced.
    step: index of the verifier call that produced the token.
    finish_reason: set on the final event only.
    stats: the generation's running statistics (complete on the final event).
    """

    text: str
    token: int | None
    from_draft: bool = False
    step: int = 0
    finish_reason: str | None = None
    stats: GenerationStats | None = None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats


class _StopFilter:
    """Holds back text that could be the start of a stop string; cuts at a complete one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was hit)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [self.pending.find(s) for s in self.stops if s in self.pending]
        if hits:
            out = self.pending[: min(hits)]
            self.pending = ""
            return out, True
        hold = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:length]):
                    hold = max(hold, length)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Engine:
    """A draft/target pair (or a target alone) and the speculative decoding loop over them."""

    def __init__(
        self,
        draft: str | Path | None,
        target: str | Path,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        verbose: bool = False,
    ) -> None:
        from .registry import resolve_model_path

        set_verbose(verbose)
        target_path = resolve_model_path(target)
        target_info = read_gguf(target_path, tokens=draft is not None)
        draft_info = None
        if draft is not None:
            draft_info = read_gguf(resolve_model_path(draft), tokens=True)
            check_pair_compatible(draft_info, target_info)  # before any weights are loaded
        self.target = LlamaModel(
            target_path, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, info=target_info
        )
        self.draft: LlamaModel | None = None
        if draft_info is not None:
            try:
                self.draft = LlamaModel(
                    draft_info.path,
                    n_ctx=n_ctx,
                    n_threads=n_threads,
                    n_gpu_layers=n_gpu_layers,
                    info=draft_info,
                )
            except Exception:
                self.target.close()
                raise
        self._lock = threading.Lock()
        # What `n_draft="auto"` learns, kept across generations: costs of this machine, and
        # acceptance rates per (drafter, method, delta).
        self.costs = CostModel()
        self.acceptance: dict[tuple, AcceptanceTracker] = {}

    @classmethod
    def from_pair(cls, name: str = "default", **kwargs) -> Engine:
        from .registry import load_registry

        pair = load_registry().pair(name)
        return cls(pair.draft, pair.target, **kwargs)

    def close(self) -> None:
        for model in (self.draft, self.target):
            if model is not None:
                model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- prompts -------------------------------------------------------------------------------

    def _special_text(self, token: int) -> str:
        return self.target.detokenize([token], special=True) if token >= 0 else ""

    def render(self, messages: list[dict[str, str]]) -> str:
        return render_chat(
            messages,
            self.target.chat_template,
            bos_token=self._special_text(self.target.bos_token),
            eos_token=self._special_text(self.target.eos_token),
        )

    def tokenize_prompt(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        bos = self._special_text(self.target.bos_token) if self.target.add_bos else ""
        # A template that writes the BOS text itself must not get a second BOS from the tokenizer.
        add_special = not (chat and bos and prompt.startswith(bos))
        return self.target.tokenize(prompt, add_special=add_special, parse_special=chat)

    # --- generation ----------------------------------------------------------------------------

    def generate(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, **kwargs
    ) -> GenerationResult:
        return _collect(self.stream(prompt, config, **kwargs))

    def chat(
        self, messages: list[dict[str, str]], config: GenerationConfig | None = None, **kwargs
    ) -> GenerationResult:
        return _collect(self.stream_chat(messages, config, **kwargs))

    def stream_chat(
        self, messages: list[dict[str, str]], config: GenerationConfig | None = None, **kwargs
    ) -> Iterator[StreamEvent]:
        tokens = self.tokenize_prompt(self.render(messages), chat=True)
        return self.stream(tokens, config, **kwargs)

    def stream(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        *,
        cancel: threading.Event | None = None,
    ) -> Iterator[StreamEvent]:
        """Stream the continuation of ``prompt`` (text, or token ids) one event per token."""
        config = config or GenerationConfig()
        if config.uses_model and self.draft is None:
            raise ValueError(
                f"drafter {config.drafter!r} needs a draft model and this engine has none; "
                "use drafter='lookup' or method='none'"
            )
        prompt_tokens = self.tokenize_prompt(prompt)
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if len(prompt_tokens) >= self.target.n_ctx:
            raise ContextLengthError(
                f"the prompt has {len(prompt_tokens)} tokens but the context holds {self.target.n_ctx}; "
                "shorten it or raise --n-ctx"
            )
        return self._run(prompt_tokens, config, cancel or threading.Event())

    def _run(
        self, prompt_tokens: list[int], config: GenerationConfig, cancel: threading.Event
    ) -> Iterator[StreamEvent]:
        with self._lock:
            yield from _Generation(self, prompt_tokens, config, cancel).events()

    # --- OpenAI-style facade -------------------------------------------------------------------

    def create_chat_completion(
        self, messages: list[dict[str, str]], *, stream: bool = False, model: str = "cactus-edge", **settings
    ):
        """Same shapes as llama-cpp-python's / OpenAI's chat completions (dict, or chunk iterator)."""
        from .openai_compat import chat_completion

        return chat_completion(self, messages, stream=stream, model=model, **settings)


def _collect(events: Iterator[StreamEvent]) -> GenerationResult:
    text, tokens = [], []
    for event in events:
        text.append(event.text)
        if event.token is not None:
            tokens.append(event.token)
        if event.finish_reason is not None:
            return GenerationResult("".join(text), tokens, event.finish_reason, event.stats)
    raise RuntimeError("stream ended without a final event")  # pragma: no cover


class _Generation:
    """One call of Engine.stream: the loop and its bookkeeping."""

    def __init__(
        self, engine: Engine, prompt_tokens: list[int], config: GenerationConfig, cancel: threading.Event
    ) -> None:
        self.engine = engine
        self.target = engine.target
        self.draft = engine.draft if config.uses_model else None
        self.config, self.cancel = config, cancel
        self.sampling = config.sampling
        self.rule = config.rule
        self.rng = np.random.default_rng(config.seed)
        self.committed = list(prompt_tokens)
        self.stats = GenerationStats(method=config.method, n_prompt_tokens=len(prompt_tokens))
        self.detokenizer = Detokenizer(self.target)
        self.stop_filter = _StopFilter(config.stop)
        self.n_generated = 0
        self.probing: tuple | None = None  # (tracker, draft cost, room) when this step is a probe
        self.guess: list[int] = []  # this step's lookup guess for the draft model

    def models(self) -> list[LlamaModel]:
        return [m for m in (self.target, self.draft) if m is not None]

    def prefill(self) -> None:
        """Bring every cache to committed[:-1], reusing the longest common prefix it holds."""
        start = time.perf_counter()
        for model in self.models():
            keep = _common_prefix(model.tokens, self.committed[:-1])
            model.truncate(keep)
            if model is self.target:
                self.stats.n_prompt_decoded = len(self.committed) - keep
            missing = self.committed[keep:-1]
            if missing:
                model.decode(missing, output_rows=())
        self.stats.prefill_ms = (time.perf_counter() - start) * 1000

    def events(self) -> Iterator[StreamEvent]:
        self.prefill()
        finish = None
        stopped_by_string = False
        try:
            while finish is None:
                if self.cancel.is_set():
                    finish = "cancelled"
                    break
                if len(self.committed) > self.target.n_ctx:
                    finish = "length"
                    break
                emitted, from_draft = self.step()
                for token, drafted in zip(emitted, from_draft, strict=True):
                    self.n_generated += 1
                    if self.target.is_end_of_generation(token):
                        finish = "stop"
                        break
                    text, stopped_by_string = self.stop_filter.push(self.detokenizer.add(token))
                    self.stats.n_tokens += 1
                    yield StreamEvent(text, token, drafted, self.stats.n_verifier_calls - 1, stats=self.stats)
                    if stopped_by_string:
                        finish = "stop"
                        break
                    if self.n_generated >= self.config.max_tokens:
                        finish = "length"
                        break
            self.roll_back_to_committed()
        except GeneratorExit:  # the consumer closed the stream: leave caches consistent
            self.roll_back_to_committed()
            raise
        self.stats.finish_reason = finish
        tail = ""
        if not stopped_by_string:  # release held-back text: no stop string completed it
            tail, stopped_by_string = self.stop_filter.push(self.detokenizer.flush())
            tail += "" if stopped_by_string else self.stop_filter.flush()
        yield StreamEvent(tail, None, finish_reason=finish, stats=self.stats)

    def roll_back_to_committed(self) -> None:
        """Caches may hold tokens past what was emitted (a stop inside a block): cut them."""
        for model in self.models():
            if model.n_past > len(self.committed):
                model.truncate(len(self.committed))

    def draft_room(self) -> int:
        """The longest block that fits the context and the max_tokens budget."""
        if self.rule is None:
            return 0
        room_in_context = self.target.n_ctx - len(self.committed)
        room_in_budget = self.config.max_tokens - self.n_generated - 1
        return max(0, min(self.config.max_draft, room_in_context, room_in_budget))

    def tracker(self, drafter: str) -> AcceptanceTracker:
        key = (drafter, self.config.method, self.config.delta)
        if key not in self.engine.acceptance:
            self.engine.acceptance[key] = AcceptanceTracker(MAX_AUTO_DRAFT)
        return self.engine.acceptance[key]

    def plan(self, room: int, drafter: str, guess: Sequence[int] = ()) -> int:
        """How many tokens to draft this step. drafter: "lookup", "model", or "model/guided" (the
        draft model with a lookup guess to batch along; its acceptance is tracked apart, as
        text that repeats earlier text is easier for both models, and also learnt from plain
        steps: did the target follow the guess?).

        Resuming drafting after k = 0 steps first feeds the draft every token it skipped. That
        catch-up is charged spread over the drafting run it is expected to start (geometric in
        the first-position acceptance): in copied code it is nearly free, in prose a resumption
        on a stray 2-gram match must pay for all of it. A probe is only made when it could pay
        at full acceptance with the whole catch-up counted.
        """
        if not self.config.auto or room == 0:
            return room
        costs = self.engine.costs
        if not costs.verify or (drafter != "lookup" and not costs.draft):
            return min(room, 4)  # measure something first
        tracker = self.tracker(drafter)
        draft_ms = self.draft_cost(drafter, len(guess), expected_run(tracker.rates[0]))
        k = choose_draft_length(tracker.rates, draft_ms, costs.verify_ms, room, SPECULATION_MARGIN)
        probe_k = min(room, max(k + 1, 2))
        probe_ms = self.draft_cost(drafter, len(guess), run_tokens=0.0)
        if tracker.should_probe() and could_pay(probe_k, probe_ms, costs.verify_ms, SPECULATION_MARGIN):
            self.probing = (tracker, draft_ms, room)
            k = probe_k
        return k

    def draft_cost(self, drafter: str, n_guided: int, run_tokens: float):
        """k → estimated ms to draft k tokens with this drafter, catch-up spread over a run of
        run_tokens tokens."""
        if drafter == "lookup":
            return lambda k: 0.0  # a lookup costs no decode
        n_catch_up = len(self.committed) - 1 - self.draft.n_past
        return lambda k: self.engine.costs.model_draft_ms(k, n_catch_up, n_guided, run_tokens)

    def end_probe(self) -> None:
        """After a probe's verification: did it turn speculation back on?"""
        tracker, draft_ms, room = self.probing
        verify_ms = self.engine.costs.verify_ms
        next_k = choose_draft_length(tracker.rates, draft_ms, verify_ms, room, SPECULATION_MARGIN)
        tracker.record_probe(paid=next_k > 0)
        self.probing = None

    def step(self) -> tuple[list[int], list[bool]]:
        """One verifier call. Returns the emitted tokens and, per token, whether it was a draft."""
        step_start = time.perf_counter()
        draft_tokens, draft_rows, draft_ms, drafter = self.propose(self.draft_room())
        n_draft = len(draft_tokens)
        verify_start = time.perf_counter()
        feed = self.committed[self.target.n_past :] + draft_tokens
        target_logits = self.target.decode(feed, output_rows=range(len(feed) - n_draft - 1, len(feed)))
        verify_ms = (time.perf_counter() - verify_start) * 1000
        self.engine.costs.record_verify(len(feed), verify_ms)
        target_rows = process_logits(target_logits, self.sampling)
        kl = None
        if n_draft == 0:
            emitted = [sample_token(target_rows[0], self.rng)]
            n_accepted, n_decided = 0, 0
            if drafter == "model/guided":
                self.tracker(drafter).record_lookup_outcome(emitted[0] == self.guess[0])
        else:
            verdict = self.rule.verify(np.array(draft_tokens), draft_rows, target_rows, self.rng)
            n_accepted, n_decided = verdict.n_accepted, len(verdict.acceptance_probs)
            emitted = [*draft_tokens[:n_accepted], verdict.next_token]
            kl = self.fidelity(draft_rows, target_rows, n_decided)
            self.tracker(drafter).record(verdict.acceptance_probs)
        if self.probing is not None:
            self.end_probe()
        self.committed += emitted
        base = len(self.committed) - len(emitted)
        self.target.truncate(base + n_accepted)
        if self.draft is not None and self.draft.n_past > base + n_accepted:
            self.draft.truncate(base + n_accepted)
        total_ms = (time.perf_counter() - step_start) * 1000
        label = drafter.split("/")[0] if n_draft else "none"
        step = StepStats(n_draft, n_accepted, draft_ms, verify_ms, total_ms, kl, label)
        self.stats.draft_ms += draft_ms
        self.stats.verify_ms += verify_ms
        self.stats.decode_ms += total_ms
        self.stats.record(step, n_decided)
        return emitted, [True] * n_accepted + [False]

    def propose(self, room: int) -> tuple[list[int], list, float, str]:
        """Draft up to ``room`` tokens: (tokens, their draft rows, ms in llama_decode, drafter)."""
        if room == 0:
            return [], [], 0.0, "none"
        if self.config.drafter in ("lookup", "model+lookup"):
            n_lookup = self.plan(room, "lookup")
            tokens = lookup_continuation(self.committed, n_lookup) if n_lookup else []
            if tokens or self.config.drafter == "lookup":
                return tokens, point_mass_rows(tokens, self.target.vocab_size), 0.0, "lookup"
        guess = self.guess = lookup_continuation(self.committed, room - 1)
        drafter = "model/guided" if guess else "model"
        n_draft = self.plan(room, drafter, guess)
        tokens, rows, ms = self.sample_draft(n_draft, guess)
        return tokens, rows, ms, drafter

    def sample_draft(self, n_draft: int, guess: Sequence[int] = ()) -> tuple[list[int], list, float]:
        """Sample up to n_draft tokens from the draft model, keeping every processed row; stops
        early when the draft's own p(d) falls below p_min.

        Drafting is autoregressive, one decode per token, except along a lookup ``guess``: one
        batch decode of [unseen committed tokens] + guess yields the draft's row after each guessed
        token, and row i+1 is the draft's true conditional for as long as the sampled tokens equal
        the guess. So the drafts have exactly the distribution of token-by-token drafting, at the
        cost of one batch (on a CPU, 4 rows of the 0.5B draft cost about 2 single decodes).
        """
        tokens: list[int] = []
        rows = []
        decode_ms = 0.0
        base = len(self.committed)
        pending = self.committed[self.draft.n_past :]
        guided = list(guess[: max(n_draft - 1, 0)])
        while len(tokens) < n_draft:
            feed = pending + guided
            start = time.perf_counter()
            logits = self.draft.decode(feed, output_rows=range(len(pending) - 1, len(feed)))
            elapsed = (time.perf_counter() - start) * 1000
            decode_ms += elapsed
            self.engine.costs.record_draft(len(feed), elapsed)
            n_before, n_followed = len(tokens), 0
            for index in range(len(guided) + 1):
                row = process_logits(logits[index], self.sampling)
                token = sample_token(row, self.rng)
                if self.config.p_min and row_prob(row, token) < self.config.p_min:
                    n_draft = len(tokens)  # such tokens are rarely accepted: verify what we have
                    break
                tokens.append(token)
                rows.append(row)
                if index == len(guided) or token != guided[index]:
                    break  # the rows after this one are conditioned on a token we did not draw
                n_followed += 1
                if len(tokens) == n_draft:
                    break
            # The cache must hold committed + drafts only: drop guessed tokens no draft followed.
            keep = base + n_before + n_followed
            if self.draft.n_past > keep:
                self.draft.truncate(keep)
            pending, guided = tokens[-1:], []
        return tokens, rows, decode_ms

    def fidelity(self, draft_rows: list, target_rows, n_decided: int) -> float | None:
        """Mean KL(out ‖ target) over the positions decided this step (lossy rules, sparse rows)."""
        if self.rule.lossless or not isinstance(target_rows, SparseProbs):
            return 0.0 if self.rule.lossless else None
        values = [output_kl(self.rule, draft_rows[i], target_rows[i]) for i in range(n_decided)]
        return float(np.mean(values)) if values else None
