"""One generation: prefill, then propose → verify → commit until a finish, and one exit path that
leaves every cache holding a prefix of prompt + the tokens handed out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from ..constraints.shaper import LogitShaper
from ..errors import NonFiniteLogitsError
from ..llama.model import Detokenizer
from ..rules.acceptance import step_kl
from ..rules.draft_length import CATCH_UP_HORIZON
from ..rules.logprobs import token_logprobs, with_bytes
from ..rules.sampling import sample_token
from .calibration import calibrate
from .drafters import DraftPlanner, DraftSourceChooser, LookupDrafter, ModelDrafter, Proposal, process_decoded
from .events import GenerationResult, StreamEvent
from .lookup import point_mass_rows
from .output import Output
from .prompt_cache import common_prefix, prepare_caches
from .stats import GenerationStats, StepProfiler, StepStats

if TYPE_CHECKING:
    from .config import GenerationConfig
    from .engine import Engine


class Generation:
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
        self.shaper = engine.reply_shaper(prompt_tokens, config)
        self.drafter = self._drafter(self.shaper if self.shaper.active else None)
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
        """Leave every cache holding the longest prefix of committed[:-1] that it or the prompt
        cache has (:func:`prepare_caches`); decode nothing. The first step (plain) decodes the
        target's missing prompt tokens: one forward pass to the first token, as in plain decoding.
        The draft catches up when a step first drafts with it (:class:`ModelDrafter`): a request
        that never drafts with it never prefills it."""
        for model in self.engine.models:
            model.sync_cache()  # cheap insurance: llama.cpp holds exactly what the mirror says
        prepared = prepare_caches(
            self.engine.models_by_role, self.engine.prompt_cache, self.committed[:-1], self.config.cache_key
        )
        self.stats.n_prompt_decoded = len(self.committed) - self.target.n_past
        self.stats.prompt_cache = prepared.source
        self.stats.prompt_cache_restore_ms = prepared.restore_ms
        self.stats.prompt_cache_save_ms = prepared.save_ms

    def decode_loop(self):
        """Steps until a finish; yields the events it hands out, returns the finish reason."""
        while True:
            if self.cancel.is_set() or self.engine.closing:
                return "cancelled"
            if len(self.committed) > self.engine.n_ctx:
                return "length"
            if self.stats.n_verifier_calls == 1 and self.config.auto and self.rule is not None:
                self._calibrate_once()
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
        for model in self.engine.models:
            try:
                model.truncate(min(common_prefix(model.tokens, self.committed), model.n_past))
                model.sync_cache()
            except Exception:  # a broken backend: an empty cache is still a consistent one
                with contextlib.suppress(Exception):
                    model.reset()

    def step(self) -> tuple[list[int], list[bool]]:
        """One verifier call. Returns the emitted tokens and, per token, whether it was a draft."""
        step_start = time.perf_counter()
        self.profile.start()
        horizon = min(self.config.max_tokens - self.n_generated, CATCH_UP_HORIZON)
        proposal = self.drafter.propose(self.committed, self._draft_room(), horizon)
        self.stats.draft_model_off = self.drafter.model_off
        target_rows, verify_ms, raw_logits = self.verify(proposal)
        emitted, n_accepted, acceptance_probs, kl = self.decide(proposal, target_rows)
        if self.config.logprobs:  # from the raw rows, before the next decode overwrites them
            self.pending_logprobs = self._logprobs(raw_logits, emitted)
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

    def _draft_room(self) -> int:
        """The longest block that fits the context and the max_tokens budget."""
        if self.rule is None or self.stats.n_verifier_calls == 0:
            return 0  # the first token comes from the target's prefill alone
        room_in_context = self.engine.n_ctx - len(self.committed)
        room_in_budget = self.config.max_tokens - self.n_generated - 1
        return max(0, min(self.config.max_draft, room_in_context, room_in_budget))

    def _calibrate_once(self) -> None:
        """`auto`'s batch costs, after the first token, never before it (:func:`calibrate`)."""
        start = time.perf_counter()
        calibrate(self.engine.costs, self.target, self.draft, self.committed[-1])
        self.stats.calibration_ms += (time.perf_counter() - start) * 1000

    def _drafter(self, shaper: LogitShaper | None) -> DraftSourceChooser:
        """Where the drafts come from: the model (if this generation uses one) and lookup."""
        config, costs, profile, vocab = self.config, self.engine.costs, self.profile, self.target.vocab_size
        is_end = self.target.is_end_of_generation  # a block ends at a drafted end of generation
        model = self.draft and ModelDrafter(
            self.draft, vocab, config, self.rng, costs, profile, shaper, is_end
        )
        prediction = ()
        if config.prediction and self.rule is not None:  # a reply longer than the context cannot be
            prediction = self.target.tokenize(config.prediction, add_special=False)[: self.engine.n_ctx]
        lookup = LookupDrafter(vocab, prediction, self.n_prompt)
        return DraftSourceChooser(config.drafter, self.planner, model, lookup, profile, shaper, is_end)

    def _logprobs(self, raw_logits: np.ndarray, emitted: list[int]) -> list:
        """The emitted tokens' logprobs from the target's raw rows (n ≥ len(emitted), V), with bytes."""
        entries = token_logprobs(raw_logits[: len(emitted)], emitted, self.config.top_logprobs)
        return with_bytes(entries, lambda token: self.target.token_bytes(token, special=True))


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


def collect(events: Iterator[StreamEvent]) -> GenerationResult:
    """A stream's events gathered into one result."""
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
