"""Where each step's draft tokens come from. The engine asks one :class:`DraftSourceChooser`
``propose(committed, room) -> Proposal``; it picks the source for the step and asks the
:class:`DraftPlanner` how many tokens (the configured ``n_draft``, or with ``"auto"`` the k that
maximises expected tokens per millisecond from this machine's costs). The two sources do different
work and have their own calls, not a shared interface:

- :class:`ModelDrafter` ``propose(committed, n_draft, guess, source)``: samples from the draft
  model, token by token, or several rows per decode along a lookup guess (lookup-guided batching);
  it first feeds the draft the committed tokens it has not seen (the lazy catch-up).
- :class:`LookupDrafter` ``find(committed, max_tokens)`` then ``propose(tokens, source)``: prompt
  n-gram lookup, or a client's predicted output first, point-mass proposals, no decode; `auto`
  keeps one acceptance curve per source and match length class ("lookup/2", "lookup/3",
  "lookup/4+", "lookup/8+", "lookup/16+", "prediction/0" for the prediction's start, …).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import NonFiniteLogitsError
from ..rules.draft_length import (
    SPECULATION_MARGIN,
    AcceptanceTracker,
    CostModel,
    best_probe_length,
    choose_draft_length,
    could_pay,
    expected_run,
)
from ..rules.sampling import (
    ProbRows,
    SparseProbs,
    fit_logits_to_vocab,
    has_candidate_path,
    non_finite_row_error,
    process_candidates,
    process_logits,
    row_prob,
    sample_token,
    widen_row,
)
from .config import MAX_AUTO_DRAFT, GenerationConfig
from .lookup import NgramIndex, PredictionIndex, match_bucket, point_mass_rows
from .stats import StepProfiler


@dataclass
class Proposal:
    """One step's drafts.

    tokens: the draft tokens d_0..d_{k-1}; rows: their draft_probs rows over the target's
    vocabulary (k rows); draft_ms: time inside llama_decode; source: "model", "model/guided"
    (the draft model fed a lookup guess), "lookup/<match class>" or "none"; guess: what lookup
    found this step ([] if nothing), lookup_source: its match class ("lookup/8+", …; "" if none).
    """

    tokens: list[int] = field(default_factory=list)
    rows: list = field(default_factory=list)
    draft_ms: float = 0.0
    source: str = "none"
    guess: list[int] = field(default_factory=list)
    lookup_source: str = ""
    n_forced: int = 0  # leading tokens the grammar forced (point masses, no draft model)
    later_forced: list[int] = field(default_factory=list)  # indices of forced tokens after a draft

    @property
    def label(self) -> str:
        """What proposed the block, for statistics: "model", "lookup", "forced" or "none" (k = 0)."""
        if len(self.tokens) == self.n_forced:
            return "forced" if self.n_forced else "none"
        return self.source.split("/")[0]

    @property
    def forced_indices(self) -> list[int]:
        """Indices into ``tokens`` of every token the grammar forced, leading or after a draft."""
        return [*range(self.n_forced), *self.later_forced]

    def after_forced(self, forced: list[int], vocab_size: int) -> Proposal:
        """This proposal behind a run of forced tokens (point-mass rows), in one block."""
        self.tokens = [*forced, *self.tokens]
        self.rows = [*point_mass_rows(forced, vocab_size), *self.rows]
        self.later_forced = [len(forced) + index for index in self.later_forced]
        self.n_forced = len(forced)
        return self


@dataclass
class Probe:
    """A step that drafts one token more than the policy chose, to find out whether drafting
    pays again; judged right after its verification."""

    tracker: AcceptanceTracker
    draft_ms: Callable[[int], float]
    room: int


def decodes_nothing(source: str) -> bool:
    """Whether drafting from ``source`` costs no decode: prompt lookup and a predicted output."""
    return source.startswith(("lookup", "prediction"))


class DraftPlanner:
    """The draft length of each step, and what `auto` learns from each verification.

    Costs and acceptance trackers belong to the engine (they outlive one generation); trackers are
    keyed by (source, method, delta), since each rule accepts differently.
    """

    def __init__(self, config: GenerationConfig, costs: CostModel, trackers: dict) -> None:
        self.config, self.costs, self.trackers = config, costs, trackers
        self.probe: Probe | None = None

    def tracker(self, source: str) -> AcceptanceTracker:
        key = (source, self.config.method, self.config.delta)
        if key not in self.trackers:
            self.trackers[key] = AcceptanceTracker(MAX_AUTO_DRAFT)
        return self.trackers[key]

    def plan(
        self, room: int, source: str, n_guided: int = 0, n_catch_up: int = 0, horizon: float = 0.0
    ) -> int:
        """How many tokens to draft this step (≤ room).

        Drafting with the model first feeds the draft every committed token it has not seen: the
        prompt (or a new turn) the first time, since the draft is fed lazily, and whatever it
        skipped during k = 0 steps. That catch-up is charged spread over the tokens it buys: the
        drafting run it is expected to start (geometric in the first-position acceptance), or the
        ``horizon`` (tokens the reply may still use the draft for) if longer — once caught up the
        draft stays nearly in sync. So a long prompt is worth feeding only when the gain over the
        horizon exceeds its cost. A probe is only made when it could pay at full acceptance with
        the whole catch-up counted.
        """
        if not self.config.auto or room == 0:
            return room
        if not self.costs.verify or (not decodes_nothing(source) and not self.costs.draft):
            return min(room, 4)  # measure something first
        tracker = self.tracker(source)
        run = max(expected_run(tracker.rates[0]), horizon)
        draft_ms = self.draft_cost(source, n_guided, n_catch_up, run)
        k = choose_draft_length(tracker.rates, draft_ms, self.costs.verify_ms, room, SPECULATION_MARGIN)
        if tracker.should_probe():
            probe_ms = self.draft_cost(source, n_guided, n_catch_up, run_tokens=0.0)
            probe_k = min(room, max(k + 1, best_probe_length(probe_ms, self.costs.verify_ms, room)))
            if could_pay(probe_k, probe_ms, self.costs.verify_ms, SPECULATION_MARGIN):
                self.probe = Probe(tracker, draft_ms, room)
                k = probe_k
        return k

    def model_can_pay(self) -> bool:
        """Whether the draft model could beat plain decoding at some draft length `auto` may choose
        on this machine, even with every draft accepted and its decodes batched along a lookup
        guess (its cheapest case). A property of the measured costs, not of one step's room. True
        until `auto` has measured both models' costs."""
        if not (self.config.auto and {"target", "draft"} <= self.costs.calibrated):
            return True
        cheapest = self.costs.draft  # k guided drafts: one batch of k
        verify = self.costs.verify_ms
        lengths = range(1, self.config.max_draft + 1)
        return any(could_pay(k, cheapest, verify, SPECULATION_MARGIN) for k in lengths)

    def draft_cost(self, source: str, n_guided: int, n_catch_up: int, run_tokens: float):
        """k → estimated ms to draft k tokens from this source, catch-up spread over a run of
        run_tokens tokens."""
        if decodes_nothing(source):
            return lambda k: 0.0  # a lookup or a prediction costs no decode
        return lambda k: self.costs.model_draft_ms(k, n_catch_up, n_guided, run_tokens)

    def learn(self, proposal: Proposal, acceptance_probs: Sequence[float], emitted_first: int) -> None:
        """After a verification: update acceptance estimates and judge a probe. Forced positions
        teach nothing about the drafter: every rule accepts them (nearly) always, whatever it
        drafted. The drafts are learnt in the order the drafter wrote them, forced runs left out."""
        forced = set(proposal.forced_indices)
        # Empty: no draft was judged.
        drafted = tuple(prob for index, prob in enumerate(acceptance_probs) if index not in forced)
        if drafted:
            self.tracker(proposal.source).record(drafted)
        elif proposal.guess and not proposal.tokens:
            # A plain step with a lookup guess: whether the target's token followed it is free
            # evidence on the guess's first position, the only evidence while k stays 0 (for
            # lookup drafts, and for a draft model fed the guess, which mostly follows it too).
            followed = emitted_first == proposal.guess[0]
            if proposal.lookup_source:
                self.tracker(proposal.lookup_source).record_lookup_outcome(followed)
            if proposal.source == "model/guided":
                self.tracker(proposal.source).record_lookup_outcome(followed)
        if self.probe is not None:
            probe, self.probe = self.probe, None
            next_k = choose_draft_length(
                probe.tracker.rates, probe.draft_ms, self.costs.verify_ms, probe.room, SPECULATION_MARGIN
            )
            probe.tracker.record_probe(paid=next_k > 0)


def process_decoded(
    model, logits: np.ndarray, sampling, row: int | None = None, shaper=None, position: int = 0
) -> ProbRows:
    """Process consecutive rows (n, V) of a model's last decode, or only row ``row`` of them; the
    first processed row predicts context index ``position``. Non-finite logits become an error
    naming the model and cache position. With an active
    :class:`~cactus_edge.constraints.shaper.LogitShaper`, the rows are shaped first (bias, penalties,
    the grammar's mask)."""
    rows = logits if row is None else logits[row]
    try:
        if shaper is not None and shaper.active:
            return _process_shaped(rows, sampling, shaper, position)
        return process_logits(rows, sampling)
    except NonFiniteLogitsError as error:
        index = error.row if row is None else row
        # The row predicting context index p sits at cache position p - 1.
        raise model.non_finite_error(index, position - 1 + (index if row is None else 0)) from None


def _process_shaped(rows: np.ndarray, sampling, shaper, position: int) -> ProbRows:
    """process_logits of the shaped rows, (V,) or (n, V): under a grammar, from the few entries
    that decide each row's top k (:meth:`LogitShaper.candidates`); rows it cannot settle that
    way, and rows without a grammar, shaped whole."""
    many = rows.ndim == 2
    table = rows if many else rows[None]
    width = table.shape[-1]
    found = [None]
    if has_candidate_path(sampling, width):
        n_keep = 1 if sampling.greedy else sampling.top_k
        found = [shaper.candidates(row, position + index, n_keep) for index, row in enumerate(table)]
    if all(candidates is None for candidates in found):
        return process_logits(shaper.shape(rows, position), sampling)
    processed = []
    for index, candidates in enumerate(found):
        try:
            if candidates is None:
                processed.append(process_logits(shaper.shape(table[index], position + index), sampling))
            else:
                processed.append(process_candidates(*candidates, width, sampling))
        except NonFiniteLogitsError:
            raise non_finite_row_error(index) from None  # renumbered: the row of this block
    if not many:
        return processed[0]
    return SparseProbs(
        np.stack([p.token_ids for p in processed]), np.stack([p.probs for p in processed]), width
    )


def _never(token: int) -> bool:
    return False


def through_first_end(tokens: list[int], is_end: Callable[[int], bool]) -> list[int]:
    """``tokens`` up to and including the first end-of-generation one (a lookup continuation
    that runs on past an <|im_end|> earlier in the chat): no draft after it can be emitted."""
    for index, token in enumerate(tokens):
        if is_end(token):
            return tokens[: index + 1]
    return tokens


def _unfed(n_fed: int, committed: list[int], drafts: list[int]) -> list[int]:
    """The tokens of committed + drafts past the first n_fed (the draft's cache), without
    copying committed."""
    if n_fed >= len(committed):
        return drafts[n_fed - len(committed) :]
    return committed[n_fed:] + drafts


class ModelDrafter:
    """Samples drafts from the draft model with the shared logit processing.

    Rows are mapped onto the target's vocabulary: ids only the draft has are dropped before
    processing (never proposed), ids only the target has get probability 0.
    """

    def __init__(
        self,
        draft,
        target_vocab_size: int,
        config: GenerationConfig,
        rng,
        costs: CostModel,
        profile: StepProfiler,
        shaper=None,
        is_end: Callable[[int], bool] = _never,
    ):
        self.draft, self.vocab_size = draft, target_vocab_size
        self.sampling, self.p_min = config.sampling, config.p_min
        self.rng, self.costs, self.profile = rng, costs, profile
        self.shaper = shaper  # follows each drafted token, so row i is shaped after d_<i
        self.is_end = is_end  # the target's end-of-generation test: a block ends at such a draft

    def catch_up_length(self, committed: Sequence[int]) -> int:
        """Committed tokens the draft has not been fed, besides the last one."""
        return len(committed) - 1 - self.draft.n_past

    def propose(self, committed: list[int], n_draft: int, guess: Sequence[int], source: str) -> Proposal:
        tokens, rows, ms, forced = self.sample(committed, n_draft, guess)
        return Proposal(tokens, rows, ms, source, list(guess), later_forced=forced)

    def sample(
        self, committed: list[int], n_draft: int, guess: Sequence[int] = ()
    ) -> tuple[list[int], list, float, list[int]]:
        """Sample up to n_draft tokens, keeping each processed row; stops early when the draft's
        own p(d) falls below p_min. Returns (tokens, rows, ms inside llama_decode, the indices
        of tokens the grammar forced).

        Where the grammar forces the tokens after a draft, they are proposed as point masses
        without a decode (every rule accepts a forced token: docs/methods.md, 'Constraints: the
        order of operations on a row') and fed to the draft with its next decode.

        Drafting is autoregressive, one decode per token, except along a lookup ``guess``: one
        batch decode of [unseen committed tokens] + guess yields the draft's row after each
        guessed token, and row i+1 is the draft's true conditional for as long as the sampled
        tokens equal the guess. So the drafts have exactly the distribution of token-by-token
        drafting, at the cost of one batch (on a CPU, far less than a decode per row).
        """
        tokens: list[int] = []
        rows: list = []
        forced_indices: list[int] = []
        decode_ms = 0.0
        base = len(committed)
        guided = list(guess[: max(n_draft - 1, 0)])
        while len(tokens) < n_draft:
            if tokens and self.shaper is not None:
                forced = self.shaper.take_forced(n_draft - len(tokens))
                forced_indices += range(len(tokens), len(tokens) + len(forced))
                tokens += forced
                rows += point_mass_rows(forced, self.vocab_size)
                if len(tokens) == n_draft or self.shaper.ended:
                    break  # drafts past the end of the text would never be emitted
            pending = _unfed(self.draft.n_past, committed, tokens)
            logits, elapsed = self._decode(pending, guided)
            decode_ms += elapsed
            n_before = len(tokens)
            n_followed, n_draft = self._sample_rows(logits, guided, tokens, rows, n_draft, base)
            # The cache must hold committed + drafts only: drop guessed tokens no draft followed.
            keep = base + n_before + n_followed
            if self.draft.n_past > keep:
                self.draft.truncate(keep)
                self.profile.lap("rollback")
            guided = []
        return tokens, rows, decode_ms, forced_indices

    def _decode(self, pending: list[int], guided: list[int]) -> tuple[np.ndarray, float]:
        """Logits rows (a view of llama.cpp's buffer, valid until the next draft decode) and the
        ms inside llama_decode."""
        feed = pending + guided
        self.profile.lap("bookkeeping")
        logits = self.draft.decode(feed, output_rows=range(len(pending) - 1, len(feed)), copy=False)
        elapsed = self.draft.last_decode_ms
        self.profile.lap("batch + logits", elapsed, "draft decode")
        self.costs.record_draft(len(feed), elapsed)
        return fit_logits_to_vocab(logits, self.vocab_size), elapsed

    def _sample_rows(
        self, logits, guided, tokens: list, rows: list, n_draft: int, base: int
    ) -> tuple[int, int]:
        """Sample from the decoded rows in order while the samples follow the guess.
        Returns (how many guessed tokens the drafts followed, the possibly lowered n_draft).

        A draft whose own p(d) is below p_min is kept, verified, and ends the block: positions
        after it are rarely accepted. Dropping it instead would leave its position to the target
        alone only when the draft happened to sample an unlikely token, which biases the output
        even under SpS."""
        n_followed = 0
        shaper = self.shaper
        for index in range(len(guided) + 1):
            position = base + len(tokens)
            processed = process_decoded(self.draft, logits, self.sampling, index, shaper, position)
            row = widen_row(processed, self.vocab_size)
            token = sample_token(row, self.rng)
            if shaper is not None:
                shaper.advance(token)
            self.profile.lap("draft processing")
            tokens.append(token)
            rows.append(row)
            followed = index < len(guided) and token == guided[index]
            # Drafts after an end of generation would never be emitted, whatever the verdicts.
            if self.is_end(token) or (self.p_min and row_prob(row, token) < self.p_min):
                return n_followed + followed, len(tokens)
            if not followed or len(tokens) == n_draft:
                # Rows after this one are conditioned on a token we did not draw (or not needed).
                return n_followed + followed, n_draft
            n_followed += 1
        return n_followed, n_draft


class LookupDrafter:
    """Prompt lookup: what followed the last 2–4-gram earlier in the context, as point masses;
    with a client's predicted output (``prediction``: its tokens; ``n_prompt``: where the reply
    starts in the context), what follows in the prediction first."""

    def __init__(self, vocab_size: int, prediction: Sequence[int] = (), n_prompt: int = 0) -> None:
        self.vocab_size = vocab_size
        self.index = NgramIndex()
        self.prediction = PredictionIndex(prediction) if prediction else None
        self.n_prompt = n_prompt

    def find(self, committed: list[int], max_tokens: int) -> tuple[list[int], str]:
        """(continuation, source): what followed the context's last n-gram earlier on (see
        :class:`NgramIndex`, "lookup/<match class>"), or what follows in the prediction
        ("prediction/<match class>") when that match is at least as long, so `auto` learns how far
        each kind of match is right ("" when nothing matches)."""
        tokens, length = self.index.match(committed, max_tokens)
        if self.prediction is not None:
            predicted, predicted_length = self.prediction.match(committed[self.n_prompt :], max_tokens)
            if predicted and (predicted_length >= length or not tokens):
                return predicted, f"prediction/{match_bucket(predicted_length)}"
        return tokens, f"lookup/{match_bucket(length)}" if tokens else ""

    def propose(self, tokens: list[int], source: str) -> Proposal:
        return Proposal(tokens, point_mass_rows(tokens, self.vocab_size), 0.0, source)


class DraftSourceChooser:
    """Each step's drafts for a drafter setting: "lookup" drafts only what lookup finds; "model"
    only the model (fed a lookup guess when there is one); "model+lookup" what lookup finds when
    `auto` expects it to pay, else the model when it expects that to pay, else nothing (a plain
    step). The planner says how many tokens."""

    def __init__(
        self,
        name: str,
        planner: DraftPlanner,
        model: ModelDrafter | None,
        lookup: LookupDrafter,
        profile: StepProfiler,
        shaper=None,
        is_end: Callable[[int], bool] = _never,
    ):
        self.name, self.planner, self.model, self.lookup = name, planner, model, lookup
        self.profile, self.shaper, self.is_end = profile, shaper, is_end
        self.model_off = False  # model+lookup found that the model cannot pay here: lookup alone

    def propose(self, committed: list[int], room: int, horizon: float = 0.0) -> Proposal:
        """This step's drafts (≤ room tokens); ``horizon``: tokens the reply may still draft for.
        Under a grammar, the tokens it forces come first (no draft model needed), and the drafts
        follow them in the same block."""
        forced = self.forced(room)
        if not forced:
            return self.drafted(committed, room, horizon)
        if self.shaper.ended:  # drafts past the end of the text would never be emitted
            return Proposal().after_forced(forced, self.lookup.vocab_size)
        rest = self.drafted([*committed, *forced], room - len(forced), horizon)
        return rest.after_forced(forced, self.lookup.vocab_size)

    def forced(self, room: int) -> list[int]:
        """Up to ``room`` tokens the grammar forces from here (:meth:`LogitShaper.take_forced`)."""
        if self.shaper is None or room == 0:
            return []
        forced = self.shaper.take_forced(room)
        self.profile.lap("grammar")
        return forced

    def drafted(self, committed: list[int], room: int, horizon: float) -> Proposal:
        if room == 0:
            return Proposal()
        found, lookup_source = self.lookup.find(committed, room)
        found = self.follow(through_first_end(found, self.is_end))
        self.profile.lap("lookup")
        if self.name != "model" and found:
            n_draft = self.planner.plan(len(found), lookup_source)
            self.profile.lap("planning")
            if n_draft:
                self.unfollow(len(found) - n_draft)
                return self.lookup.propose(found[:n_draft], lookup_source)
        self.unfollow(len(found))  # the model drafts from committed, or nothing is proposed
        if self.name == "model+lookup" and not self.model_off:
            self.model_off = not self.planner.model_can_pay()
        if self.name == "lookup" or self.model_off:
            return Proposal(guess=found, lookup_source=lookup_source)
        guess = found[: room - 1]
        source = "model/guided" if guess else "model"
        n_catch_up = self.model.catch_up_length(committed)
        n_draft = self.planner.plan(room, source, len(guess), n_catch_up, horizon)
        self.profile.lap("planning")
        proposal = self.model.propose(committed, n_draft, guess, source)
        proposal.lookup_source = lookup_source
        return proposal

    def follow(self, found: list[int]) -> list[int]:
        """A lookup continuation cut before its first token the grammar refuses (the target would
        reject it with certainty), with the shaper advanced over what is kept: a proposal of it
        then needs no second walk, and :meth:`unfollow` takes back what is not proposed."""
        if self.shaper is None:
            return found
        n_ok = 0
        while n_ok < len(found) and self.shaper.allows(found[n_ok]):
            self.shaper.advance(found[n_ok])
            n_ok += 1
        return found[:n_ok]

    def unfollow(self, n_tokens: int) -> None:
        if self.shaper is not None:
            self.shaper.rewind(n_tokens)
