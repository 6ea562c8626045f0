"""The speculative decoding engine: propose, verify, commit — streamed token by token.

State between steps is one list, ``committed`` (prompt + every accepted token). Each model's KV cache
always holds a prefix of it; a step first feeds each model whatever committed tokens it has not
seen, so rollback is a single truncate. The first step is plain: its one target decode is the
prompt's prefill and yields the first token, as plain decoding's does. The draft is fed lazily:
only a step that drafts with it feeds it what it lacks (the prompt the first time, a new turn's
text, the tokens it skipped during plain steps), so no draft work ever delays the first token and
a request that never drafts with the model never prefills it.

**One exit path.** However a generation ends — end of text, stop string, length, cancel, the
consumer closing or abandoning the stream, an exception inside a step, KeyboardInterrupt — its
``finally`` brings both caches back to a prefix of prompt + the tokens handed to the consumer
(tokens held back for a possible stop string and then cut are not kept), checked against
llama.cpp's own position range, not only our mirror of it.

**Concurrency contract.** One engine runs one generation at a time. A stream takes the engine when
it starts (its first ``next()``) and gives it back on any exit; other callers wait for it, forever
by default or up to ``timeout`` seconds, then get :class:`EngineBusy`. A thread that already holds
an open stream of this engine and starts another gets EngineBusy at once instead of a deadlock.
An abandoned stream gives the engine back when it is garbage-collected. ``close()`` is safe at any
time from any thread: the running generation ends at its next step and the models are freed when
it has let go. Tokenizing and rendering never wait for a generation and share no buffer with it.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .acceptance import step_kl
from .adaptive import CALIBRATION_DRAFT_SIZES, CALIBRATION_VERIFY_SIZES, CATCH_UP_HORIZON, CostModel
from .backend import Detokenizer, LlamaModel, set_verbose
from .config import DEFAULT_N_CTX, GenerationConfig
from .constraints import LogitShaper
from .cost_cache import MAX_KEPT_CONTEXT, load_costs, save_costs, still_holds
from .drafters import DraftPlanner, DraftSourceChooser, LookupDrafter, ModelDrafter, Proposal, process_decoded
from .errors import (
    ContextLengthError,
    EngineBusy,
    EngineClosedError,
    InvalidSettingError,
    NonFiniteLogitsError,
)
from .events import GenerationResult, StreamEvent
from .gguf_info import check_pair_compatible, read_gguf
from .grammar import CompiledGrammars
from .logprobs import token_logprobs, with_bytes
from .lookup import point_mass_rows
from .output import Output
from .sampling import sample_token
from .stats import GenerationStats, StepProfiler, StepStats
from .templates import Prompts

__all__ = ["Engine", "GenerationConfig", "GenerationResult", "GenerationStats", "StepStats", "StreamEvent"]


class _Guard:
    """The engine's one-generation-at-a-time lock, with an owner (to refuse re-entry from the same
    thread) and a callback run on release (a deferred close)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = threading.Lock()  # makes "is it free, or else run this on release" atomic
        self._owner: int | None = None
        self._on_release = None

    @contextlib.contextmanager
    def hold(self, timeout: float | None):
        if self._owner == threading.get_ident():
            raise EngineBusy(
                "this thread already has an open stream of this engine; finish or close it first"
            )
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            raise EngineBusy(f"the engine is busy with another generation (waited {timeout:g} s)")
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            with self._state:
                self._owner = None
                callback, self._on_release = self._on_release, None
                try:
                    if callback is not None:
                        callback()
                finally:
                    self._lock.release()

    def run_when_free(self, callback, wait: float) -> bool:
        """Run ``callback`` holding the lock, now or within ``wait`` seconds if it is free by then;
        otherwise when the current holder lets go. True if it ran now."""
        if self._owner != threading.get_ident() and self._lock.acquire(timeout=max(wait, 0)):
            try:
                callback()
            finally:
                self._lock.release()
            return True
        with self._state:
            if self._lock.acquire(blocking=False):
                try:
                    callback()
                finally:
                    self._lock.release()
                return True
            self._on_release = callback
            return False


class _Lifecycle:
    """Open or closed, and which prompt operations (tokenizing, rendering) are in flight: they
    never wait for a generation, so closing must wait for them before freeing the models."""

    def __init__(self) -> None:
        self.closed = False
        self.closing = threading.Event()  # the running generation ends at its next step
        self._in_flight = 0
        self._changed = threading.Condition()

    def check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("the engine is closed")

    @contextlib.contextmanager
    def prompt_operation(self):
        with self._changed:
            self.check_open()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    def close(self) -> bool:
        """Mark closed (False if it already was); no new prompt operation starts after this."""
        with self._changed:
            if self.closed:
                return False
            self.closed = True
        self.closing.set()
        return True

    def wait_for_prompt_operations(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._in_flight == 0, timeout=30)


class _ForeignTokens(dict):
    """Target ids the draft's vocabulary lacks (the target's is up to 128 tokens larger), fed to
    the draft as the first draft token of the same text: the draft's cache keeps one position per
    committed token, and its drafts only need to be good, not exact (SpS stays lossless)."""

    def __init__(self, draft: LlamaModel, target: LlamaModel) -> None:
        super().__init__()
        self.draft, self.target = draft, target

    def __missing__(self, token: int) -> int:
        text = self.target.detokenize([token], special=True)
        ids = self.draft.tokenize(text, add_special=False, parse_special=True) if text else []
        self[token] = ids[0] if ids else max(self.draft.eos_token, 0)
        return self[token]


class Engine:
    """A target model and optionally a draft model, and the speculative decoding loop over them.
    Build one from loaded :class:`LlamaModel` objects (tests inject their own), or with :meth:`load`
    / :meth:`from_pair`, which resolve names and check the pair first (:func:`load_models`)."""

    def __init__(self, target: LlamaModel, draft: LlamaModel | None = None) -> None:
        if draft is not None and draft.vocab_size < target.vocab_size:
            draft.foreign_tokens = _ForeignTokens(draft, target)
        if not isinstance(target, LlamaModel) or not isinstance(draft, (LlamaModel, type(None))):
            raise TypeError("Engine(target, draft) takes loaded LlamaModels; use Engine.load(draft, target)")
        self.target, self.draft = target, draft
        self.prompts = Prompts(target)
        self._guard = _Guard()
        self._life = _Lifecycle()
        self.grammars = CompiledGrammars(target.grammar_tokenizer, target.vocab_size)
        self.last_shaper: LogitShaper | None = None  # for check_caches
        self.reset_estimates()

    @classmethod
    def load(cls, draft: str | Path | None, target: str | Path, **settings) -> Engine:
        """An engine over models given by path or registered name; see :func:`load_models`."""
        return cls(*load_models(draft, target, **settings))

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> Engine:
        """An engine over a registered pair (None: the default pair)."""
        from .registry import resolve_pair

        return cls.load(*resolve_pair(name), **kwargs)

    def reset_estimates(self) -> None:
        """Forget what `n_draft="auto"` learnt (costs; acceptance per drafter, method, delta)."""
        self.use_estimates(CostModel(), {})

    def use_estimates(self, costs: CostModel, acceptance: dict) -> None:
        """Let `auto` learn into these from now on (bench gives each variant its own)."""
        self.costs, self.acceptance = costs, acceptance

    def measure_costs(self, sizes: Sequence[int] = range(1, 10), repeats: int = 3) -> dict:
        """{"verify_ms": {n: ms}, "draft_ms": one draft token's ms or None}, medians inside
        llama_decode at the end of the cached text (:func:`measure_batch_costs`), under the lock."""
        with self._guard.hold(None):
            return _engine_costs(self.target, self.draft, sizes, repeats)

    def close(self, wait: float = 5.0) -> None:
        """Free both models. A running generation is cancelled at its next step; the models are
        freed once it has let go (at once when idle, else waiting up to ``wait`` s). Idempotent."""
        if self._life.close():
            self._guard.run_when_free(self._free_models, wait)

    def _free_models(self) -> None:
        self._life.wait_for_prompt_operations()
        for model in filter(None, (self.draft, self.target)):
            model.close()

    @property
    def closed(self) -> bool:
        return self._life.closed

    @property
    def n_ctx(self) -> int:
        """The context llama.cpp allocated (it may round the requested one up), both models'."""
        return min(m.n_ctx for m in _models(self))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- prompts (never wait for a generation; see the concurrency contract) ---------------------

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template's text for ``messages`` (for display; generation uses token ids)."""
        with self._life.prompt_operation():
            return self.prompts.render(messages, tools=tools)

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Prompt ids for a conversation and OpenAI ``tools`` (pasted ``<|im_start|>`` stays text)."""
        with self._life.prompt_operation():
            return self.prompts.tokenize_chat(messages, tools=tools)

    def tokenize_prompt(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Raw prompt ids; see :meth:`Prompts.tokenize_prompt`."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        with self._life.prompt_operation():
            return self.prompts.tokenize_prompt(prompt, chat=chat)

    def warm_up(self, grammars: bool = False) -> None:
        """Page the weights in, build the graphs, calibrate `auto`; ``grammars``: see :func:`warm_up`."""
        warm_up(self, grammars)

    # --- generation ------------------------------------------------------------------------------

    def generate(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, **kwargs
    ) -> GenerationResult:
        return _collect(self.stream(prompt, config, **kwargs))

    def chat(
        self, messages: list[dict[str, str]], config: GenerationConfig | None = None, **kwargs
    ) -> GenerationResult:
        return _collect(self.stream_chat(messages, config, **kwargs))

    def stream_chat(self, messages: list[dict], config=None, *, tools=None, **kwargs) -> Iterator:
        return self.stream(self.tokenize_chat(messages, tools), config, **kwargs)

    def stream(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        *,
        cancel: threading.Event | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamEvent]:
        """Stream the continuation of ``prompt`` (raw text, or token ids), one event per token.
        cancel: set it to end the generation at the end of the current step.
        timeout: seconds to wait for the engine if another generation holds it (None: wait),
            then :class:`EngineBusy`."""
        config = config or GenerationConfig()
        self._life.check_open()
        prompt_tokens = self.tokenize_prompt(prompt)
        self.check_request(prompt_tokens, config)
        return self._run(prompt_tokens, config, cancel or threading.Event(), timeout)

    def check_request(self, prompt_tokens: Sequence[int], config: GenerationConfig) -> None:
        """Refuse what cannot run before a generation takes the engine: InvalidSettingError naming the
        parameter (grammars compile here), ContextLengthError when the context has no room to reply."""
        _check_request(config, list(prompt_tokens), self.target, self.draft, self.n_ctx)
        _check_grammar(self, config)

    def _run(self, prompt_tokens, config, cancel, timeout) -> Iterator[StreamEvent]:
        with self._guard.hold(timeout):
            self._life.check_open()  # closed while this stream waited
            yield from _Generation(self, prompt_tokens, config, cancel).events()

    def clear_caches(self, timeout: float | None = None) -> None:
        """Empty both KV caches: with a fixed draft length the next reply then depends on prompt,
        config and seed alone (a reused prefix changes llama.cpp's rounding). timeout: as stream's."""
        self._life.check_open()
        with self._guard.hold(timeout):
            self._life.check_open()
            for model in filter(None, (self.target, self.draft)):
                model.reset()

    def check_caches(self, expected: Sequence[int] | None = None) -> list[str]:
        """Problems with the caches, [] when consistent: llama.cpp's position range must equal our
        mirror of each, and each must hold a prefix of ``expected`` (prompt + emitted tokens)."""
        return _cache_problems({"target": self.target, "draft": self.draft}, expected, self.last_shaper)


def _draft_room(generation: _Generation) -> int:
    """The longest block that fits the context and the max_tokens budget."""
    if generation.rule is None or generation.stats.n_verifier_calls == 0:
        return 0  # the first token comes from the target's prefill alone
    room_in_context = generation.engine.n_ctx - len(generation.committed)
    room_in_budget = generation.config.max_tokens - generation.n_generated - 1
    return max(0, min(generation.config.max_draft, room_in_context, room_in_budget))


def _calibrate_once(generation: _Generation) -> None:
    """`auto`'s batch costs, after the first token, never before it (:func:`calibrate`)."""
    start = time.perf_counter()
    calibrate(generation.engine.costs, generation.target, generation.draft, generation.committed[-1])
    generation.stats.calibration_ms += (time.perf_counter() - start) * 1000


def _drafter(generation: _Generation, shaper: LogitShaper | None) -> DraftSourceChooser:
    """Where a generation's drafts come from: the model (if it uses one) and lookup."""
    config, costs, profile = generation.config, generation.engine.costs, generation.profile
    vocab, draft = generation.target.vocab_size, generation.draft
    is_end = generation.target.is_end_of_generation  # a block ends at a drafted end of generation
    model = draft and ModelDrafter(draft, vocab, config, generation.rng, costs, profile, shaper, is_end)
    return DraftSourceChooser(
        config.drafter, generation.planner, model, LookupDrafter(vocab), profile, shaper, is_end
    )


def _logprobs(target: LlamaModel, raw_logits: np.ndarray, emitted: list[int], n_top: int) -> list:
    """The emitted tokens' logprobs from the target's raw rows (n ≥ len(emitted), V), with bytes."""
    entries = token_logprobs(raw_logits[: len(emitted)], emitted, n_top)
    return with_bytes(entries, lambda token: target.token_bytes(token, special=True))


def reply_shaper(engine: Engine, prompt_tokens: Sequence[int], config: GenerationConfig) -> LogitShaper:
    """What changes raw logits for one reply to ``prompt_tokens`` (inactive when nothing does)."""
    new_matcher, trigger = None, ()
    source = config.grammar_source
    if source is not None:
        grammars, param = engine.grammars, _grammar_param(config)
        new_matcher = lambda: grammars.matcher(source, param)  # noqa: E731
        if config.grammar_trigger:
            trigger = engine.target.tokenize(config.grammar_trigger, add_special=False, parse_special=True)
    bias = None
    if config.logit_bias:
        ids, values = zip(*config.logit_bias, strict=True)
        bias = (np.array(ids, dtype=np.int64), np.array(values, dtype=np.float32))
    end_tokens = engine.target.end_of_generation_tokens() if new_matcher else frozenset()
    return LogitShaper(
        prompt_tokens,
        new_matcher=new_matcher,
        trigger=trigger,
        bias=bias,
        penalties=config.penalties,
        end_tokens=end_tokens,
    )


def load_models(
    draft: str | Path | None,
    target: str | Path,
    *,
    n_ctx: int = DEFAULT_N_CTX,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    verbose: bool = False,
    rpc_servers: str | Sequence[str] | None = None,
    tensor_split: Sequence[float] = (),
    rpc_timeout: float | None = None,
) -> tuple[LlamaModel, LlamaModel | None]:
    """(target, draft) loaded from paths or registered names. The pair is checked to share a
    tokenizer before any weights are loaded; a failure frees whatever was loaded.

    rpc_servers: "host:port" workers (a list or one comma-separated string) that hold the
        target's layers (:class:`RemoteLlamaModel`, ``tensor_split`` their shares, ``rpc_timeout``
        seconds per call); the draft always runs here."""
    from .registry import resolve_model_path

    set_verbose(verbose)
    target_path = resolve_model_path(target)
    target_info = read_gguf(target_path, tokens=draft is not None)
    draft_info = None
    if draft is not None:
        draft_info = read_gguf(resolve_model_path(draft), tokens=True)
        check_pair_compatible(draft_info, target_info)
    settings = {"n_ctx": n_ctx, "n_threads": n_threads, "n_gpu_layers": n_gpu_layers}
    if rpc_servers:
        target_model = _remote_target(
            target_path, target_info, settings, rpc_servers, tensor_split, rpc_timeout, verbose
        )
        settings["n_gpu_layers"] = 0  # the draft stays on this machine's CPU
    elif tensor_split:
        raise InvalidSettingError("tensor_split needs rpc_servers", param="tensor_split")
    else:
        target_model = LlamaModel(target_path, info=target_info, **settings)
    try:
        draft_model = LlamaModel(draft_info.path, info=draft_info, **settings) if draft_info else None
    except BaseException:
        target_model.close()
        raise
    return target_model, draft_model


def _remote_target(path, info, settings, rpc_servers, tensor_split, timeout, verbose) -> LlamaModel:
    from .remote_model import DEFAULT_RPC_TIMEOUT, RemoteLlamaModel

    return RemoteLlamaModel(
        path,
        info=info,
        rpc_servers=rpc_servers,
        tensor_split=tensor_split,
        timeout=timeout or DEFAULT_RPC_TIMEOUT,
        verbose=verbose,
        **settings,
    )


def _collect(events: Iterator[StreamEvent]) -> GenerationResult:
    text, tokens, logprobs = [], [], []
    for event in events:
        text.append(event.text)
        if event.token is not None:
            tokens.append(event.token)
        if event.logprob is not None:
            logprobs.append(event.logprob)
        if event.finish_reason is not None:
            return GenerationResult(
                "".join(text), tokens, event.finish_reason, event.stats, logprobs if logprobs else None
            )
    raise RuntimeError("stream ended without a final event")  # pragma: no cover


class _Generation:
    """One call of Engine.stream: prefill, then propose → verify → commit until a finish."""

    def __init__(self, engine: Engine, prompt_tokens: list[int], config: GenerationConfig, cancel) -> None:
        self.engine, self.target, self.config, self.cancel = engine, engine.target, config, cancel
        self.draft = engine.draft if config.uses_model else None
        self.sampling, self.rule = config.sampling, config.rule
        self.rng = np.random.default_rng(config.seed)
        self.committed = list(prompt_tokens)
        self.n_prompt = len(prompt_tokens)
        self.n_generated = 0
        lossy = self.rule is not None and not self.rule.lossless
        self.stats = GenerationStats(
            method=config.method, lossy=lossy, n_prompt_tokens=len(prompt_tokens), kl_budget=config.kl_budget
        )
        self.output = Output(Detokenizer(self.target), config.stop, self.stats)
        self.planner = DraftPlanner(config, engine.costs, engine.acceptance)
        self.profile = StepProfiler()
        self.stats.profile_ms = self.profile.ms
        self.shaper = engine.last_shaper = reply_shaper(engine, prompt_tokens, config)
        self.drafter = _drafter(self, self.shaper if self.shaper.active else None)
        self.pending_logprobs: list = []

    def events(self) -> Iterator[StreamEvent]:
        try:
            self.reuse_prefixes()
            finish = yield from self.decode_loop()
            held, final = self.output.finish(finish, stopped_by_string=finish == "stop-string")
            yield from self.output.shown_events(held)
            yield final
        finally:
            self.settle()

    def reuse_prefixes(self) -> None:
        """Cut every cache back to the longest prefix of committed[:-1] it holds; decode nothing.
        The first step (plain) decodes the target's missing prompt tokens: one forward pass to the
        first token, as in plain decoding. The draft catches up when a step first drafts with it
        (:class:`ModelDrafter`): a request that never drafts with it never prefills it."""
        for model in _models(self.engine):
            model.sync_cache()  # cheap insurance: llama.cpp holds exactly what the mirror says
            model.truncate(_common_prefix(model.tokens, self.committed[:-1]))
        self.stats.n_prompt_decoded = len(self.committed) - self.target.n_past

    def decode_loop(self):
        """Steps until a finish; yields the events it hands out, returns the finish reason."""
        while True:
            if self.cancel.is_set() or self.engine._life.closing.is_set():
                return "cancelled"
            if len(self.committed) > self.engine.n_ctx:
                return "length"
            if self.stats.n_verifier_calls == 1 and self.config.auto and self.rule is not None:
                _calibrate_once(self)
            emitted, from_draft = self.step()
            logprobs = self.pending_logprobs or [None] * len(emitted)
            for token, drafted, logprob in zip(emitted, from_draft, logprobs, strict=True):
                self.n_generated += 1
                if self.target.is_end_of_generation(token):
                    return "stop"
                ready, hit = self.output.push(token, drafted, self.stats.n_verifier_calls - 1, logprob)
                yield from self.output.shown_events(ready)
                if hit:
                    return "stop-string"
                if self.n_generated >= self.config.max_tokens:
                    return "length"

    def settle(self) -> None:
        """The one exit path: each cache keeps at most prompt + shown tokens, and llama.cpp holds
        exactly what our mirror says. Never raises (it runs while an error may propagate)."""
        self.committed = self.committed[: self.n_prompt] + self.output.shown
        # A failure here shows in check_caches (the shaper's problems); the caches must still settle.
        with contextlib.suppress(Exception):
            self.shaper.rewind_to(len(self.committed))
        for model in _models(self.engine):
            try:
                model.truncate(min(_common_prefix(model.tokens, self.committed), model.n_past))
                model.sync_cache()
            except Exception:  # a broken backend: an empty cache is still a consistent one
                with contextlib.suppress(Exception):
                    model.reset()

    def step(self) -> tuple[list[int], list[bool]]:
        """One verifier call. Returns the emitted tokens and, per token, whether it was a draft."""
        step_start = time.perf_counter()
        self.profile.start()
        horizon = min(self.config.max_tokens - self.n_generated, CATCH_UP_HORIZON)
        proposal = self.drafter.propose(self.committed, _draft_room(self), horizon)
        target_rows, verify_ms, raw_logits = self.verify(proposal)
        emitted, n_accepted, acceptance_probs, kl = self.decide(proposal, target_rows)
        if self.config.logprobs:  # from the raw rows, before the next decode overwrites them
            self.pending_logprobs = _logprobs(self.target, raw_logits, emitted, self.config.top_logprobs)
        self.planner.learn(proposal, acceptance_probs, emitted[0])
        self.profile.lap("planning")
        self.commit(emitted, n_accepted, len(proposal.tokens))
        self.profile.lap("rollback")
        total_ms = (time.perf_counter() - step_start) * 1000
        n_draft, n_decided = len(proposal.tokens), len(acceptance_probs)
        fields = (n_draft, n_accepted, proposal.draft_ms, verify_ms, total_ms, kl, proposal.label, n_decided)
        fields += (sum(index < n_accepted for index in proposal.forced_indices),)
        prefill = self.stats.n_verifier_calls == 0
        self.stats.record(StepStats(*fields), prefill=prefill)
        self.profile.lap("bookkeeping")
        if prefill:  # the profile covers decode steps, as decode_ms does
            self.profile.ms.update(dict.fromkeys(self.profile.ms, 0.0))
        return emitted, [True] * n_accepted + [False]

    def verify(self, proposal: Proposal):
        """One target decode of the unseen committed tokens + the drafts; processed rows for the
        k + 1 positions that score the drafts and the bonus (a list of rows where the grammar
        fixed some of them)."""
        n_draft = len(proposal.tokens)
        feed = self.committed[self.target.n_past :] + proposal.tokens
        first_position = len(self.committed)  # row 0 predicts the first draft's position
        self.profile.lap("bookkeeping")
        fixed = {} if self.config.logprobs else fixed_rows(self.shaper, first_position, n_draft)
        wanted = [len(feed) - n_draft - 1 + index for index in range(n_draft + 1) if index not in fixed]
        self.profile.lap("grammar")
        # A view of llama.cpp's buffer: processed (and checked) before the next target decode.
        logits = self.target.decode(feed, output_rows=wanted, copy=False)
        verify_ms = self.target.last_decode_ms
        self.profile.lap("batch + logits", verify_ms, "verify decode")
        if self.stats.n_verifier_calls and not fixed:  # not the prefill, nor a verify of fewer rows
            self.engine.costs.record_verify(len(feed), verify_ms)
        target_rows = merge_rows(self.target, logits, self.sampling, self.shaper, first_position, fixed)
        self.profile.lap("target processing")
        return target_rows, verify_ms, logits

    def decide(self, proposal: Proposal, target_rows):
        """(emitted tokens, n_accepted, the rule's acceptance probabilities, mean KL or None)."""
        if not proposal.tokens:
            token = sample_token(target_rows[0], self.rng)
            self.profile.lap("acceptance")
            return [token], 0, (), None
        verdict = self.rule.verify(np.array(proposal.tokens), proposal.rows, target_rows, self.rng)
        self.profile.lap("acceptance")
        n_accepted, n_decided = verdict.n_accepted, len(verdict.acceptance_probs)
        emitted = [*proposal.tokens[:n_accepted], verdict.next_token]
        kl = step_kl(self.rule, proposal.rows, target_rows, n_decided)
        self.profile.lap("kl")
        return emitted, n_accepted, verdict.acceptance_probs, kl

    def commit(self, emitted: list[int], n_accepted: int, n_draft: int) -> None:
        """Append the emitted tokens; cut rejected drafts from both caches and the shaper (which
        followed every draft)."""
        base = len(self.committed)
        self.shaper.rewind(n_draft - n_accepted)
        self.shaper.advance(emitted[-1])
        self.committed += emitted
        self.target.truncate(base + n_accepted)
        if self.draft is not None and self.draft.n_past > base + n_accepted:
            self.draft.truncate(base + n_accepted)


def fixed_rows(shaper: LogitShaper, first_position: int, n_draft: int) -> dict[int, int]:
    """{row index: token} for the k + 1 rows of a verify (row i predicts first_position + i) where
    the grammar allows one token: point masses whatever the target's logits, so llama.cpp need
    not compute those logits (the lm_head's share of a row) nor numpy process them. (Not with
    logprobs, which report the raw rows.)"""
    if not shaper.constrained:
        return {}
    sole = {index: shaper.sole_token(first_position + index) for index in range(n_draft + 1)}
    return {index: token for index, token in sole.items() if token is not None}


def merge_rows(target, logits, sampling, shaper, first_position: int, fixed: dict[int, int]):
    """A verify's k + 1 rows: processed ``logits`` (one row per position not ``fixed``) with the
    point masses where ``fixed``, in order; each consecutive run of computed rows is processed
    at once (all of them, as one block, when nothing is fixed)."""
    if not fixed:
        return process_decoded(target, logits, sampling, None, shaper, first_position)
    wanted = [index for index in range(len(logits) + len(fixed)) if index not in fixed]
    rows = dict(zip(fixed, point_mass_rows(list(fixed.values()), target.vocab_size), strict=True))
    start = 0
    while start < len(wanted):
        end = start + 1
        while end < len(wanted) and wanted[end] == wanted[end - 1] + 1:
            end += 1
        position = first_position + wanted[start]
        try:
            run = process_decoded(target, logits[start:end], sampling, None, shaper, position)
        except NonFiniteLogitsError as error:  # renumbered: the row of the verify, not of the run
            row = wanted[start + error.row]
            raise target.non_finite_error(row, first_position + row - 1) from None
        rows.update((wanted[start + offset], run[offset]) for offset in range(end - start))
        start = end
    return [rows[index] for index in range(len(rows))]


def warm_up(engine: Engine, grammars: bool = False) -> None:
    """A short fixed-k generation pages the weights in and builds the compute graphs; its cold
    timings are then forgotten (they would skew the cost table), and a 2-token `auto` generation
    measures the batch costs `auto` needs (:func:`calibrate`, after its first token). The caches
    keep a short prompt; no acceptance rate is learnt.

    ``grammars``: also build the grammar tokenizer index (:meth:`CompiledGrammars.prepare`), as a
    server does before it says it is ready: otherwise the first constrained request builds it,
    holding Python's GIL (and a server's event loop) for most of a second."""
    if grammars:
        with engine._life.prompt_operation():
            engine.grammars.prepare()
    drafter = "model" if engine.draft else "lookup"
    engine.generate("Hello", GenerationConfig(method="sps", n_draft=2, drafter=drafter, max_tokens=4, seed=0))
    engine.reset_estimates()
    engine.generate(
        "Hello", GenerationConfig(method="sps", n_draft="auto", drafter=drafter, max_tokens=2, seed=0)
    )


def calibrate(costs: CostModel, target: LlamaModel, draft: LlamaModel | None, filler: int) -> None:
    """Measure what `auto` needs before its first choice, once per cost model and model: the
    target's cost of each verify batch size and the draft's of short batches
    (:func:`measure_batch_costs`). Learning only the sizes it happens to use, `auto` missed cheap
    ones (on Q4_0, 4 tokens cost less than 3); real steps keep refining every size. A measurement
    made by an earlier process for the same CPU, file and settings is reused (cost_cache)."""
    for role, model, sizes, record in (
        ("target", target, CALIBRATION_VERIFY_SIZES, costs.record_verify),
        ("draft", draft, CALIBRATION_DRAFT_SIZES, costs.record_draft),
    ):
        if model is not None and role not in costs.calibrated:
            costs.calibrated.add(role)
            table, was_kept = _batch_costs(model, sizes, filler)
            if was_kept:
                costs.kept.add(role)
            for n_tokens, ms in table.items():
                record(n_tokens, ms)


def _batch_costs(model: LlamaModel, sizes: Sequence[int], filler: int) -> tuple[dict[int, float], bool]:
    """(costs by batch size, whether kept): the table kept for this model (cost_cache), if one
    fresh decode of a single token still costs what it says; else freshly measured costs, kept
    when every size fitted and the context was short (attention grows with it: a table taken
    behind a long prompt would overstate every later request's costs)."""
    identity = model.cost_identity()
    if identity is None:
        return measure_batch_costs(model, sizes, filler), False
    kept = load_costs(identity, sizes)
    if kept is not None and still_holds(kept, measure_batch_costs(model, [1], filler)):
        return kept, True
    n_past = model.n_past
    measured = measure_batch_costs(model, sizes, filler)
    if set(sizes) <= set(measured) and n_past <= MAX_KEPT_CONTEXT:
        save_costs(identity, measured)
    return measured, False


def _engine_costs(target: LlamaModel, draft: LlamaModel | None, sizes, repeats: int) -> dict:
    filler = target.tokens[-1] if target.tokens else max(target.bos_token, 0)
    draft_ms = draft and measure_batch_costs(draft, [1], filler, repeats).get(1)
    return {"verify_ms": measure_batch_costs(target, sizes, filler, repeats), "draft_ms": draft_ms}


def measure_batch_costs(
    model: LlamaModel, sizes: Sequence[int], filler: int, repeats: int = 1
) -> dict[int, float]:
    """This machine's cost of a batch, by size: the median ms inside llama_decode of ``repeats``
    decodes of ``filler`` × n at the end of the cache (logits for every row, as a verify), cut
    right after; sizes that do not fit the context are skipped. One untimed decode first: a
    model's first decode builds its graph (a lazily fed draft may not have decoded yet)."""
    n_past, measured = model.n_past, {}
    for n_tokens in (n for n in sizes if n_past + n <= model.n_ctx):
        times = []
        for _ in range(repeats + (not measured)):
            try:
                model.decode([filler] * n_tokens, output_rows=range(n_tokens))
                times.append(model.last_decode_ms)
            finally:
                model.truncate(n_past)
        measured[n_tokens] = statistics.median(times[-repeats:])
    return measured


def _check_request(
    config, prompt_tokens: list[int], target: LlamaModel, draft: LlamaModel | None, n_ctx: int
) -> None:
    """Engine.check_request for these models."""
    if config.uses_model and draft is None:
        raise InvalidSettingError(
            f"drafter {config.drafter!r} needs a draft model and this engine has none; "
            "use drafter='lookup' or method='none'",
            param="drafter",
        )
    if not prompt_tokens:
        raise InvalidSettingError("the prompt is empty", param="prompt")
    if any(not 0 <= t < target.vocab_size for t in prompt_tokens):
        raise InvalidSettingError(f"prompt token ids must be in [0, {target.vocab_size})", param="prompt")
    if any(token >= target.vocab_size for token, _ in config.logit_bias):
        raise InvalidSettingError(
            f"logit_bias token ids must be in [0, {target.vocab_size})", param="logit_bias"
        )
    if len(prompt_tokens) >= n_ctx:
        raise ContextLengthError(
            f"the prompt has {len(prompt_tokens)} tokens but the context holds {n_ctx} "
            "(with room for at least one generated token); shorten it or raise --n-ctx"
        )


def _check_grammar(engine: Engine, config: GenerationConfig) -> None:
    """Compile the config's grammar against the vocabulary (cached): its errors come before the
    generation, naming the field."""
    if config.grammar_source is not None:
        with engine._life.prompt_operation():
            engine.grammars.matcher(config.grammar_source, _grammar_param(config))


def _grammar_param(config: GenerationConfig) -> str:
    """The field that holds a config's grammar, for errors."""
    return next(name for name in ("json_schema", "regex", "grammar") if getattr(config, name) is not None)


def _cache_problems(models: dict, expected: Sequence[int] | None, shaper: LogitShaper | None) -> list[str]:
    """Engine.check_caches for the named models (None: no such model) and the last reply's shaper
    (its grammar state must follow the reply as the caches do)."""
    problems = shaper.problems(expected) if expected is not None and shaper is not None else []
    for name, model in models.items():
        if model is None:
            continue
        low, high = model.cache_range()
        if (low, high) != ((0, model.n_past - 1) if model.n_past else (-1, -1)):
            problems.append(
                f"{name}: llama.cpp holds positions {low}..{high}, our mirror {model.n_past} tokens"
            )
        if expected is not None and list(expected[: model.n_past]) != model.tokens:
            problems.append(f"{name}: the cache is not a prefix of the {len(expected)} expected tokens")
    return problems


def _models(engine: Engine) -> list[LlamaModel]:
    """Both of the engine's models, also a draft a generation does not use: no cache may keep
    another text than the running generation's."""
    return [m for m in (engine.target, engine.draft) if m is not None]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
