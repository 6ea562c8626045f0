"""Constraints under speculation: grammars, penalties, logit bias, logprobs (docs/methods.md,
'Constraints: the order of operations on a row').

Every check compares the engine with an independent reference: llguidance's own matcher fed the
context token by token for the mask, a loop over the context for llama.cpp's penalties, a
log-softmax of the target's logits decoded alone for logprobs.
"""

import json

import numpy as np
import pytest

from cactus_edge.constraints import shaper as constraints
from cactus_edge.constraints.grammar import TokenMask
from cactus_edge.constraints.penalties import Penalties, apply_penalties
from cactus_edge.constraints.shaper import LogitShaper
from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.drafters import DraftSourceChooser, process_decoded
from cactus_edge.errors import InvalidSettingError, NonFiniteLogitsError
from cactus_edge.rules import acceptance
from cactus_edge.rules.sampling import SamplingConfig, process_logits, to_dense

from .first_tokens import pooled_chisquare_pvalue, sample_first_drafted_steps
from .test_bench import grammar_accepts
from .test_engine import FLIP_MARGIN

PROMPT = "the water is hot and"
# Lowercase words and spaces: the mask refuses most of the tiny vocabulary (bytes, capitals,
# digits, punctuation) but leaves many tokens at every position.
WORDS_REGEX = r"[a-z ]{1,60}"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
# A literal the grammar forces from the first token on, then free words.
FORCED_LARK = 'start: "the number of people is " /[a-z ]{1,40}/'
# Free letters and forced literals in turn: forced runs start after a draft, inside a block.
ALTERNATING_LARK = 'start: /[a-z]{2}/ " is the " /[a-z]{2}/ " and the " /[a-z]{2}/ " of " /[a-z ]{1,30}/'


@pytest.fixture(autouse=True)
def empty_caches(engine):
    engine.clear_caches()


def reference_mask(engine, config, reply_tokens) -> np.ndarray:
    """bool (V,): what llguidance allows after ``reply_tokens``, from a fresh matcher."""
    matcher = engine.grammars.matcher(config.grammar_source)
    for token in reply_tokens:
        matcher.consume(token)
    return matcher.mask().allowed()


def reference_penalties(logits, context, n_prompt, penalties: Penalties) -> np.ndarray:
    """llama.cpp's llama_sampler_penalties_apply, written out token by token."""
    out = np.array(logits, dtype=np.float64)
    window = context[-penalties.repeat_last_n :] if penalties.repeat_last_n > 0 else []
    for token in set(window):
        out[token] = (
            out[token] / penalties.repeat_penalty if out[token] > 0 else out[token] * penalties.repeat_penalty
        )
    generated = context[n_prompt:]
    for token in set(generated):
        out[token] -= generated.count(token) * penalties.frequency_penalty + penalties.presence_penalty
    return out


# --- the packed mask ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [0x00, 0xFF])
def test_a_mask_allowing_nothing_or_everything_lists_its_ids(bits):
    vocab_size = 1003  # the last byte's padding bits are set with 0xFF
    mask = TokenMask(np.full(128, bits, dtype=np.uint8), vocab_size)
    expected = np.arange(vocab_size) if bits else np.empty(0, dtype=np.int64)
    np.testing.assert_array_equal(mask.allowed_ids(), expected)
    assert mask.allowed_ids().dtype == np.int64 and mask.n_allowed == expected.size


def test_a_packed_mask_answers_like_its_unpacked_rows_and_ignores_padding_bits():
    rng = np.random.default_rng(3)
    vocab_size = 1003  # not a multiple of 8 nor 32: llguidance pads the bits to whole words
    allowed = rng.random(vocab_size) < 0.3
    packed = np.packbits(np.concatenate([allowed, np.ones(21, dtype=bool)]), bitorder="little")
    mask = TokenMask(packed, vocab_size)
    np.testing.assert_array_equal(mask.allowed(), allowed)
    np.testing.assert_array_equal(mask.allowed_ids(), np.flatnonzero(allowed))
    assert mask.n_allowed == allowed.sum()
    assert [mask.allows(t) for t in range(vocab_size + 5)] == [*allowed.tolist(), *[False] * 5]
    with np.errstate(divide="ignore"):
        np.testing.assert_array_equal(mask.additive, np.log(allowed.astype(np.float32)))
    assert mask.additive.dtype == np.float32 and mask.additive.shape == (vocab_size,)


@pytest.mark.parametrize("token", [0, 7, 8, 500, 1002])
def test_a_mask_allowing_one_token_names_it_and_padding_bits_do_not_count(token):
    vocab_size = 1003
    allowed = np.arange(vocab_size) == token
    padded = np.concatenate([allowed, np.ones(21, dtype=bool)])  # padding bits set, as llguidance may
    assert TokenMask(np.packbits(padded, bitorder="little"), vocab_size).sole_id() == token
    allowed[(token + 1) % vocab_size] = True
    assert TokenMask(np.packbits(allowed, bitorder="little"), vocab_size).sole_id() is None
    assert TokenMask(np.packbits(np.zeros(vocab_size, bool), bitorder="little"), vocab_size).sole_id() is None


# --- penalties and the shaper, alone --------------------------------------------------------------


def test_penalties_follow_llama_cpp_semantics():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50).astype(np.float32)
    context = [3, 7, 7, 9, 3, 3, 11, 7, 42]
    penalties = Penalties(repeat_penalty=1.3, repeat_last_n=5, frequency_penalty=0.4, presence_penalty=0.7)
    shaped = logits.copy()
    window = np.array(context[-5:])
    apply_penalties(shaped, window, np.array(context[4:]), penalties)
    np.testing.assert_allclose(shaped, reference_penalties(logits, context, 4, penalties), rtol=1e-6)
    assert shaped[0] == logits[0]  # an unseen token is untouched


def test_the_shaper_follows_advance_and_rewind_and_its_trigger():
    """The grammar starts right after its trigger, rewinding before it switches it off again."""

    class Matcher:
        def __init__(self):
            self.consumed = []

        def mask(self):
            return TokenMask(np.packbits(np.arange(10) < 5, bitorder="little"), 10)

        def consume(self, token):
            self.consumed.append(token)

        def rollback(self, n):
            del self.consumed[-n:]

    shaper = LogitShaper([1, 2], new_matcher=Matcher, trigger=[8, 9])
    for token in (3, 8):
        shaper.advance(token)
    assert not shaper.constrained
    shaper.advance(9)
    assert shaper.constrained and shaper.grammar_start == 5
    shaper.advance(4)
    assert shaper.matcher.consumed == [4]
    assert np.isinf(shaper.shape(np.zeros(10, dtype=np.float32), 6)[5:]).all()
    assert not np.isinf(shaper.shape(np.zeros(10, dtype=np.float32), 4)).any()  # before the trigger
    shaper.rewind(1)
    assert shaper.matcher.consumed == [] and shaper.constrained
    shaper.rewind(1)
    assert not shaper.constrained and shaper.context == [1, 2, 3, 8]
    assert shaper.problems([1, 2, 3, 8]) == []
    assert shaper.problems([1, 2, 3]) != []


# --- the engine under a grammar --------------------------------------------------------------------


# After it the constrained target's greedy replies (15 to 40 tokens under the four constraints
# below) have no top-2 margin below 0.14: speculation and plain must agree in full. (After PROMPT,
# ALTERNATING_LARK's reply has one of 5.6e-3 at token 9.)
GREEDY_PROMPT = "way will there like"
MIN_CONSTRAINED_COMPARED = 15


@pytest.mark.parametrize(
    "constraint",
    [
        {"regex": WORDS_REGEX},
        {"json_schema": SCHEMA},
        {"grammar": FORCED_LARK},
        {"grammar": ALTERNATING_LARK},
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "method,drafter", [("sps", "model"), ("cactus", "model+lookup"), ("exact", "lookup")]
)
def test_greedy_constrained_speculation_equals_greedy_constrained_plain(engine, constraint, method, drafter):
    settings = {"temperature": 0.0, "max_tokens": 40, **constraint}
    plain = engine.generate(GREEDY_PROMPT, GenerationConfig(method="none", **settings))
    engine.clear_caches()
    spec = engine.generate(
        GREEDY_PROMPT, GenerationConfig(method=method, drafter=drafter, n_draft=4, **settings)
    )
    context = engine.tokenize_prompt(GREEDY_PROMPT)
    compared = next(
        (i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens, strict=False)) if a != b),
        min(len(spec.tokens), len(plain.tokens)),
    )
    if spec.tokens != plain.tokens:  # allowed only at a near-tie of the constrained target
        engine.clear_caches()
        # The grammar as it stands after the reply's first tokens (a matcher that consumed them).
        shaper = engine.reply_shaper(context, GenerationConfig(method="none", **settings))
        for token in plain.tokens[:compared]:
            shaper.advance(token)
        logits = shaper.shape(
            engine.target.teacher_forced(context + plain.tokens[:compared], [-1])[0], shaper.position
        )
        finite = np.sort(logits[np.isfinite(logits)])
        assert finite[-1] - finite[-2] < FLIP_MARGIN, f"token {compared} differs away from a near-tie"
    assert compared >= MIN_CONSTRAINED_COMPARED, (compared, plain.tokens, spec.tokens)
    mask_ok = [
        reference_mask(engine, spec_config := GenerationConfig(**constraint), spec.tokens[:i])[t]
        for i, t in enumerate(spec.tokens)
    ]
    assert all(mask_ok), "a token the grammar refuses was emitted"
    if "json_schema" in constraint and spec.finish_reason == "stop":
        json.loads(spec.text)
    assert spec_config.grammar_source is not None
    assert engine.check_caches(context + spec.tokens) == []


def test_forced_tokens_are_proposed_without_the_draft_model(engine, monkeypatch):
    config = GenerationConfig(
        method="sps", drafter="model", n_draft=8, temperature=0.0, max_tokens=30, grammar=FORCED_LARK
    )
    draft_decodes = []
    real_decode = engine.draft.decode
    monkeypatch.setattr(
        engine.draft, "decode", lambda *a, **k: draft_decodes.append(a[0]) or real_decode(*a, **k)
    )
    result = engine.generate(PROMPT, config)
    assert result.text.startswith("the number of people is ")
    forced_steps = [s for s in result.stats.steps if s.n_forced]
    assert forced_steps, "the literal was never proposed as forced tokens"
    assert result.stats.n_forced >= 4  # the literal is several tokens; only the first is the prefill's
    # Every forced token is accepted: the constrained target is a point mass on it (a block of
    # forced tokens alone is accepted whole; n_forced counts the accepted ones).
    assert all(s.n_accepted == s.n_draft == s.n_forced for s in forced_steps if s.drafter == "forced")
    assert any(s.drafter == "forced" for s in forced_steps)
    # A reply the grammar forces whole never decodes the draft model: after the first step (the
    # prefill's) every block is forced tokens, all accepted (the bonus token is the target's),
    # the last one the end of text.
    engine.clear_caches()
    draft_decodes.clear()
    whole = engine.generate(PROMPT, config.with_changes(grammar='start: "the number of people is the water"'))
    assert whole.text == "the number of people is the water"
    assert draft_decodes == []
    assert {s.drafter for s in whole.stats.steps[1:]} == {"forced"}
    assert all(s.n_accepted == s.n_forced == s.n_draft for s in whole.stats.steps[1:])


def test_forced_tokens_after_a_draft_cost_no_draft_decode_and_no_target_logits(engine, monkeypatch):
    """Inside a block, the tokens a grammar forces after a model draft are taken as point masses
    without a draft decode, and the verify asks llama.cpp for no logits where the grammar allows
    one token. (That the reply is plain greedy's is the equality test's, with ALTERNATING_LARK.)"""
    from cactus_edge.engine.drafters import ModelDrafter

    config = GenerationConfig(
        method="sps", drafter="model", n_draft=6, temperature=0.0, max_tokens=40, grammar=ALTERNATING_LARK
    )
    n_prompt = len(engine.tokenize_prompt(PROMPT))
    draft_feeds, verify_rows, proposals = [], [], []
    real_draft, real_target, real_propose = engine.draft.decode, engine.target.decode, ModelDrafter.propose

    def draft_decode(tokens, *args, **kwargs):
        draft_feeds.append(list(tokens))
        return real_draft(tokens, *args, **kwargs)

    def target_decode(tokens, output_rows=(-1,), **kwargs):
        verify_rows.append((len(tokens), list(output_rows)))
        return real_target(tokens, output_rows, **kwargs)

    def propose(drafter, committed, *args):
        n_decodes, reply = len(draft_feeds), list(committed[n_prompt:])
        proposal = real_propose(drafter, committed, *args)
        proposals.append((proposal, reply, list(proposal.tokens), len(draft_feeds) - n_decodes))
        return proposal

    monkeypatch.setattr(engine.draft, "decode", draft_decode)
    monkeypatch.setattr(engine.target, "decode", target_decode)
    monkeypatch.setattr(ModelDrafter, "propose", propose)
    spec = engine.generate(PROMPT, config)
    with_forced = [entry for entry in proposals if entry[0].later_forced]
    assert with_forced, "no block had a forced run after a draft"
    for proposal, reply, drafted, n_decodes in with_forced:
        # Indices taken before after_forced shifted them: into the tokens the drafter returned.
        later = [index - proposal.n_forced for index in proposal.later_forced]
        # At most one decode per model draft (a lookup guess may batch several); none per forced.
        assert n_decodes <= len(drafted) - len(later)
        for index in later:  # the grammar allowed that token alone there, or only end tokens
            allowed = np.flatnonzero(reference_mask(engine, config, reply + drafted[:index])).tolist()
            ends = all(engine.target.is_end_of_generation(t) for t in allowed)
            assert allowed == [drafted[index]] or (ends and drafted[index] == allowed[0])
    # Rows where the grammar allowed one token were not computed: fewer rows than k + 1.
    blocks = zip(verify_rows[1:], _blocks(spec), strict=True)
    assert any(len(rows) < n_draft + 1 for (_, rows), (n_draft, _) in blocks)
    assert spec.stats.n_forced > sum(s.n_forced for s in spec.stats.steps if s.drafter == "forced")
    assert engine.check_caches(engine.tokenize_prompt(PROMPT) + spec.tokens) == []
    # Logprobs report the raw rows, so every row is computed then.
    verify_rows.clear()
    engine.clear_caches()
    logged = engine.generate(PROMPT, config.with_changes(logprobs=True))
    blocks = zip(verify_rows[1:], _blocks(logged), strict=True)
    assert all(len(rows) == n_draft + 1 for (_, rows), (n_draft, _) in blocks)


def _blocks(result) -> list[tuple[int, int]]:
    """(n_draft, n_accepted) of each verify after the prefill."""
    return [(s.n_draft, s.n_accepted) for s in result.stats.steps[1:]]


@pytest.mark.parametrize("wide_pool", [1, 4])  # 1: the wide shortcut never settles a row
@pytest.mark.parametrize("narrow", ["none", "some", "all"])
def test_rows_settled_from_candidates_equal_whole_shaped_rows(engine, monkeypatch, narrow, wide_pool):
    config = GenerationConfig(
        regex=WORDS_REGEX, top_k=6, logit_bias={5: 3.0}, presence_penalty=0.7, max_tokens=8, seed=4
    )
    prompt = engine.tokenize_prompt(PROMPT)
    reply = engine.generate(PROMPT, config.with_changes(method="none")).tokens
    shaper = engine.reply_shaper(prompt, config)
    for token in reply[:-1]:
        shaper.advance(token)
    sizes = sorted(shaper.mask_at(len(prompt) + i).n_allowed for i in range(len(reply)))
    assert sizes[0] < sizes[-1]  # the positions differ, so "some" splits them
    limit = {"none": -1, "some": sizes[len(sizes) // 2], "all": sizes[-1]}[narrow]
    monkeypatch.setattr(constraints, "NARROW_MASK", limit)
    monkeypatch.setattr(constraints, "WIDE_POOL", wide_pool)
    rows = np.random.default_rng(5).standard_normal((len(reply), engine.target.vocab_size)).astype(np.float32)
    settled = [shaper.candidates(row, len(prompt) + i, 6) is not None for i, row in enumerate(rows)]
    if narrow == "none":  # every mask wide: the shortcut settles some rows, or none with a pool of 1
        assert any(settled) == (wide_pool > 1)
    expected = process_logits(shaper.shape(rows, len(prompt)), config.sampling)
    found = process_decoded(engine.target, rows, config.sampling, None, shaper, len(prompt))
    np.testing.assert_array_equal(found.token_ids, expected.token_ids)
    np.testing.assert_array_equal(found.probs, expected.probs)
    one = process_decoded(engine.target, rows, config.sampling, 2, shaper, len(prompt) + 2)
    np.testing.assert_array_equal(one.token_ids, expected.token_ids[2])


class _FixedMatcher:
    """A grammar that allows the same ids at every position."""

    def __init__(self, allowed):
        self.allowed_row, self.consumed = allowed, []

    def mask(self):
        return TokenMask(np.packbits(self.allowed_row, bitorder="little"), self.allowed_row.size)

    def consume(self, token):
        self.consumed.append(token)


def test_a_wide_mask_that_refuses_the_rows_top_entries_still_gives_the_shaped_rows_answer(monkeypatch):
    # The raw rows' largest entries are mostly refused, so the allowed top k often lies outside
    # the pool of the row's 4k largest: the shortcut must see that and shape the row whole.
    vocab_size, sampling = 4096, SamplingConfig(temperature=0.8, top_k=8, top_p=0.95)
    rng = np.random.default_rng(11)
    allowed = rng.random(vocab_size) < 0.6
    monkeypatch.setattr(constraints, "NARROW_MASK", 16)  # every mask here is wide
    shaper = LogitShaper([1, 2], new_matcher=lambda: _FixedMatcher(allowed))
    # Coarse values: many ties, some at the pool's smallest value (where only ids decide).
    rows = (np.round(rng.standard_normal((40, vocab_size)) * 4) / 4).astype(np.float32)
    refused = np.flatnonzero(~allowed)
    for index, row in enumerate(rows):
        row[rng.choice(refused, 2 + index, replace=False)] += 6.0  # 2..41 refused entries on top
    settled = 0
    for row in rows:
        expected = process_logits(shaper.shape(row, 2), sampling)
        settled += shaper.candidates(row, 2, sampling.top_k) is not None
        found = process_decoded(None, row, sampling, None, shaper, 2)
        np.testing.assert_array_equal(found.token_ids, expected.token_ids)
        np.testing.assert_array_equal(found.probs, expected.probs)
    assert 0 < settled < len(rows)  # both the shortcut and the fallback ran


def test_a_lookup_proposal_is_cut_before_the_first_token_the_grammar_refuses(engine):
    config = GenerationConfig(regex=WORDS_REGEX)
    prompt = engine.tokenize_prompt(PROMPT)
    shaper = engine.reply_shaper(prompt, config)
    capital = engine.target.tokenize("X", add_special=False)[-1]
    words = engine.target.tokenize(" water hot", add_special=False)
    chooser = DraftSourceChooser("lookup", None, None, None, None, shaper)
    assert chooser.follow([*words, capital, *words]) == words
    assert shaper.context == prompt + words  # the shaper follows what was kept
    chooser.unfollow(len(words))
    assert shaper.context == prompt


@pytest.mark.statistical
def test_sps_under_a_grammar_and_penalties_emits_the_constrained_targets_distribution(engine, target_alone):
    """The second token (the first a step drafts) against the target's row after prompt + [t1],
    masked by a fresh matcher and penalised by the reference loop: chi-square over 3,000 seeds."""
    sampling = {"temperature": 1.0, "top_k": 8, "top_p": 1.0}
    constraint = {
        "regex": WORDS_REGEX,
        "presence_penalty": 1.0,
        "frequency_penalty": 0.5,
        "repeat_penalty": 1.5,
    }
    prompt = engine.tokenize_prompt(PROMPT)
    steps = sample_first_drafted_steps(
        engine, prompt, 3000, method="sps", n_draft=3, **sampling, **constraint
    )
    assert steps.n_second_step_accepted > 300
    config = GenerationConfig(**constraint)
    expected = np.zeros_like(steps.pair_counts, dtype=float)
    for t1 in np.flatnonzero(steps.first_token_counts):
        context = [*prompt, int(t1)]
        target_alone.reset()
        logits = reference_penalties(target_alone.decode(context)[0], context, len(prompt), config.penalties)
        logits[~reference_mask(engine, config, [int(t1)])] = -np.inf
        row = to_dense(process_logits(logits.astype(np.float32), SamplingConfig(**sampling)))
        expected[t1] = steps.first_token_counts[t1] * row
    assert steps.pair_counts[expected == 0].sum() == 0, "a second token outside the constrained support"
    pvalue = pooled_chisquare_pvalue(steps.pair_counts, expected)
    assert pvalue > 1e-3, f"chi-square p = {pvalue:.3g}"


# --- exits ----------------------------------------------------------------------------------------


def test_every_exit_leaves_the_grammar_at_the_received_reply(engine, monkeypatch):
    """Closing inside a block, a stop string, max_tokens, cancel and an exception mid-step: the
    matcher's consumed tokens equal the reply the consumer received (check_caches)."""
    config = GenerationConfig(method="sps", n_draft=4, temperature=0.0, max_tokens=30, regex=WORDS_REGEX)
    prompt = engine.tokenize_prompt(PROMPT)
    full = engine.generate(PROMPT, config)
    assert engine.check_caches(prompt + full.tokens) == []

    engine.clear_caches()
    stream = engine.stream(PROMPT, config)
    events = [next(stream) for _ in range(3)]
    stream.close()
    assert engine.check_caches(prompt + [e.token for e in events]) == []

    engine.clear_caches()
    stopped = engine.generate(PROMPT, config.with_changes(stop=(full.text[6:9],)))
    assert engine.check_caches(prompt + stopped.tokens) == []

    engine.clear_caches()
    short = engine.generate(PROMPT, config.with_changes(max_tokens=7))
    assert engine.check_caches(prompt + short.tokens) == []

    engine.clear_caches()
    real_verify = acceptance.SpeculativeSampling.verify
    calls = []

    def failing_verify(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_verify(self, *args)

    monkeypatch.setattr(acceptance.SpeculativeSampling, "verify", failing_verify)
    received = []
    with pytest.raises(RuntimeError):
        for event in engine.stream(PROMPT, config):
            received += [event.token] if event.token is not None else []
    assert engine.check_caches(prompt + received) == []


# --- logprobs --------------------------------------------------------------------------------------


def test_logprobs_are_the_targets_raw_log_softmax_for_drafted_tokens_too(engine, target_alone):
    config = GenerationConfig(
        method="sps", n_draft=4, temperature=0.0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    spec = engine.generate(PROMPT, config)
    assert sum(s.n_accepted for s in spec.stats.steps) > 0  # some tokens were drafts
    prompt = engine.tokenize_prompt(PROMPT)
    logits = target_alone.teacher_forced(
        prompt + spec.tokens, range(len(prompt) - 1, len(prompt) + len(spec.tokens) - 1)
    )
    reference = logits.astype(np.float64) - np.log(
        np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True)
    )
    assert len(spec.logprobs) == len(spec.tokens)
    n_ordered = 0
    for index, (entry, token) in enumerate(zip(spec.logprobs, spec.tokens, strict=True)):
        assert entry.token == token
        assert entry.logprob == pytest.approx(reference[index, token], abs=1e-3)
        top_ids = [t for t, _ in entry.top]
        assert len(top_ids) == 3
        top_two = np.sort(reference[index])[-2:]
        if top_two[1] - top_two[0] >= FLIP_MARGIN:  # a near-tie may order differently across CPUs
            assert top_ids[0] == int(np.argmax(reference[index]))
            n_ordered += 1
    assert n_ordered > len(spec.tokens) // 2
    engine.clear_caches()
    plain = engine.generate(PROMPT, config.with_changes(method="none"))
    if plain.tokens == spec.tokens:
        np.testing.assert_allclose(
            [e.logprob for e in plain.logprobs], [e.logprob for e in spec.logprobs], atol=1e-3
        )


# --- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings,param",
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": {"type": "objectx"}}, "json_schema"),
        ({"json_schema": {"type": "string", "format": "no-such-format"}}, "json_schema"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"regex": "(unclosed"}, "regex"),
        ({"regex": "a", "grammar": 'start: "a"'}, "regex"),
        ({"grammar_trigger": "<tool_call>"}, "grammar_trigger"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repeat_penalty": 0.0}, "repeat_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {5: 500}}, "logit_bias"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_invalid_constraints_name_their_field(settings, param):
    with pytest.raises(InvalidSettingError) as caught:
        GenerationConfig(**settings)
    assert caught.value.param == param


def test_a_logit_bias_outside_the_vocabulary_is_refused_before_generating(engine):
    with pytest.raises(InvalidSettingError, match="logit_bias"):
        engine.generate(PROMPT, GenerationConfig(logit_bias={10**6: 1.0}))


def test_logit_bias_moves_the_greedy_choice(engine):
    base = engine.generate(PROMPT, GenerationConfig(method="none", temperature=0.0, max_tokens=3))
    chosen = base.tokens[0] + 1
    biased = engine.generate(
        PROMPT, GenerationConfig(method="sps", temperature=0.0, max_tokens=3, logit_bias={chosen: 100})
    )
    assert biased.tokens == [chosen] * 3


def test_a_forced_only_block_teaches_auto_nothing_about_its_lookup_guess():
    """A block of forced tokens behind which lookup only guessed: its first emitted token is the
    forced one, not the token the guess was about, so no lookup outcome may be recorded."""
    from cactus_edge.engine.drafters import DraftPlanner, Proposal
    from cactus_edge.rules.draft_length import CostModel

    planner = DraftPlanner(GenerationConfig(), CostModel(), {})
    proposal = Proposal(tokens=[5], rows=[None], n_forced=1, guess=[7], lookup_source="lookup/2")
    planner.learn(proposal, (1.0,), emitted_first=5)
    assert planner.trackers == {}


def test_forced_tokens_inside_a_block_teach_auto_nothing(monkeypatch):
    """auto learns the acceptance of drafts only: a forced token after a draft is accepted
    whenever it is reached, so its verdict is left out, leading or not."""
    from cactus_edge.engine.drafters import DraftPlanner, Proposal
    from cactus_edge.rules.draft_length import AcceptanceTracker, CostModel

    recorded = []
    monkeypatch.setattr(AcceptanceTracker, "record", lambda tracker, probs: recorded.append(probs))
    planner = DraftPlanner(GenerationConfig(), CostModel(), {})
    proposal = Proposal(tokens=[4, 5, 6, 7, 8], rows=[None] * 5, source="model", later_forced=[3])
    proposal.after_forced([3], vocab_size=10)  # a leading forced token too: indices shift by one
    assert proposal.forced_indices == [0, 4]
    planner.learn(proposal, (1.0, 0.5, 0.6, 0.7, 1.0, 0.8), emitted_first=3)
    assert recorded == [(0.5, 0.6, 0.7, 0.8)]


def test_the_tokenizer_index_is_built_once_and_each_compile_is_timed(tiny_pair, monkeypatch):
    """warm_up(grammars=True) builds the index up front (a server does, so no request pays it),
    and only once; each grammar's compile time is kept beside it."""
    import llguidance.llamacpp

    from cactus_edge.constraints.grammar import grammar_source
    from cactus_edge.engine.engine import Engine

    builds = []
    build = llguidance.llamacpp.lltokenizer_from_vocab
    monkeypatch.setattr(
        llguidance.llamacpp, "lltokenizer_from_vocab", lambda *a, **k: builds.append(1) or build(*a, **k)
    )
    with Engine.load(None, str(tiny_pair[1]), n_ctx=128) as engine:
        grammars = engine.grammars
        assert grammars.tokenizer_ms is None and not builds
        engine.warm_up(grammars=True)
        index_ms = grammars.tokenizer_ms
        assert index_ms is not None and index_ms > 0 and len(builds) == 1
        engine.check_request([1, 2], GenerationConfig(method="none", regex="[a-c]{1,4}"))
        source = grammar_source(None, None, "[a-c]{1,4}")
        assert set(grammars.compile_ms) == {source} and grammars.compile_ms[source] > 0
        assert grammars.tokenizer_ms == index_ms and len(builds) == 1


def test_a_non_finite_shaped_row_is_named_by_its_row_and_cache_position():
    """A NaN among a shaped block's candidates is reported at its own row (the backend turns the
    row into the cache position it names), whether the row was settled from candidates or whole."""
    vocab_size, sampling = 512, SamplingConfig(temperature=0.8, top_k=8)
    allowed = np.zeros(vocab_size, dtype=bool)
    allowed[:40] = True  # a narrow mask: rows settle from their allowed entries
    # The rows are the last 4 of a 10-token cache: the first predicts context index 7.
    shaper = LogitShaper([1, 2, 3, 4, 5, 6, 7], new_matcher=lambda: _FixedMatcher(allowed))
    rows = np.random.default_rng(3).standard_normal((4, vocab_size)).astype(np.float32)
    rows[2, 7] = np.nan  # an allowed entry of the third row

    class Model:
        def non_finite_error(self, row, position):
            return ValueError(f"row {row} at position {position}")

    with pytest.raises(ValueError, match="row 2 at position 8"):
        process_decoded(Model(), rows, sampling, None, shaper, 7)


class _SequenceMatcher(_FixedMatcher):
    """A grammar whose allowed ids depend on how many tokens it has consumed."""

    def __init__(self, masks):
        super().__init__(masks[0])
        self.masks = masks

    def mask(self):
        self.allowed_row = self.masks[len(self.consumed)]
        return super().mask()


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=0.8, top_k=8),
        SamplingConfig(temperature=1.2, top_k=0, top_p=0.9),
        SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),
    ],
    ids=["greedy", "top-k", "top-p", "min-p"],
)
def test_a_verify_with_fixed_rows_left_out_gives_the_rows_processing_all_would(sampling):
    """Positions where the grammar allows one token, between and around positions it leaves open:
    the rows merge_rows builds from the computed rows alone equal processing every row, with
    bias and penalties on (they cannot move a point mass)."""
    from cactus_edge.engine.generation import fixed_rows, merge_rows

    vocab_size, rng = 300, np.random.default_rng(8)
    masks = [
        rng.random(vocab_size) < 0.3,
        np.arange(vocab_size) == 17,
        rng.random(vocab_size) < 0.5,
        np.arange(vocab_size) == 250,
        rng.random(vocab_size) < 0.2,
    ]
    shaper = LogitShaper(
        [1, 2],
        new_matcher=lambda: _SequenceMatcher(masks),
        bias=(np.array([17, 40]), np.array([-100.0, 3.0])),
        penalties=Penalties(repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    )
    for mask in masks[:4]:  # a draft block of 4 tokens the grammar allows; row 4 is the bonus
        shaper.advance(int(np.flatnonzero(mask)[-1]))
    fixed = fixed_rows(shaper, 2, 4)
    assert fixed == {1: 17, 3: 250}
    logits = rng.standard_normal((5, vocab_size)).astype(np.float32) * 3
    whole = process_decoded(None, logits, sampling, None, shaper, 2)
    target = type("Target", (), {"vocab_size": vocab_size})()
    merged = merge_rows(target, logits[[0, 2, 4]], sampling, shaper, 2, fixed)
    assert len(merged) == 5
    for index in range(5):
        np.testing.assert_array_equal(to_dense(merged[index]), to_dense(whole[index]))


def test_a_non_finite_row_after_a_fixed_one_is_named_by_its_row_in_the_verify():
    """With a fixed row left out of the decode, the computed rows are renumbered back: the error
    names the verify's row and its cache position, not the row's index among those computed."""
    from cactus_edge.engine.generation import merge_rows

    vocab_size, sampling = 64, SamplingConfig(temperature=0.8, top_k=8)
    shaper = LogitShaper([1, 2, 3, 4, 5, 6, 7], new_matcher=lambda: _FixedMatcher(np.ones(vocab_size, bool)))
    logits = np.random.default_rng(4).standard_normal((2, vocab_size)).astype(np.float32)
    logits[1, 3] = np.nan  # the second computed row: row 2 of the verify (row 0 is fixed)

    class Target:
        vocab_size = 64

        def non_finite_error(self, row, position):
            return NonFiniteLogitsError(f"row {row} at position {position}", row=row)

    with pytest.raises(NonFiniteLogitsError, match="row 2 at position 8"):
        merge_rows(Target(), logits, sampling, shaper, 7, {0: 5})
    rows = merge_rows(Target(), logits[:1], sampling, shaper, 7, {0: 5, 2: 9})
    assert [r.token_ids.tolist() for r in (rows[0], rows[2])] == [[5], [9]] and len(rows) == 3


def test_json_is_laid_out_as_json_dumps_so_keys_and_separators_are_forced():
    import llguidance

    from cactus_edge.constraints.grammar import grammar_source, parse_json_schema

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    answer = {"name": "Ada", "age": 36}
    assert grammar_accepts(schema, json.dumps(answer))
    assert not grammar_accepts(schema, json.dumps(answer, indent=2))
    assert not grammar_accepts(schema, json.dumps(answer, separators=(",", ":")))
    # After a value the grammar forces the separator, the next key and its colon: free drafts.
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, grammar_source(parse_json_schema(schema), None, None))
    assert matcher.consume_tokens(tokenizer.tokenize_bytes(b'{"name": "Ada"'))
    assert tokenizer.decode_bytes(matcher.compute_ff_tokens()) == b', "age": '
    # A schema's own x-guidance wins, key by key; choosing its whitespace drops our separators.
    assert grammar_accepts(
        {"x-guidance": {"whitespace_flexible": True}, **schema}, json.dumps(answer, indent=2)
    )
    assert not grammar_accepts(
        {"x-guidance": {"coerce_one_of": True}, **schema}, json.dumps(answer, indent=2)
    )
    colon_only = {"x-guidance": {"key_separator": ":"}, **schema}
    assert grammar_accepts(colon_only, '{"name":"Ada", "age":36}')
    assert not grammar_accepts(colon_only, '{"name":"Ada",\n"age":36}')


@pytest.mark.parametrize("no_forcing", [True, False])
def test_a_grammar_that_forbids_forcing_forces_no_tokens(no_forcing):
    # llguidance's no_forcing: asking for its forced bytes would force them anyway (a shortcut
    # once taken here), and later forced tokens and masks would follow from them.
    import llguidance

    from cactus_edge.constraints.grammar import GrammarMatcher

    tokenizer = llguidance.LLTokenizer("byte")
    head = '%llguidance {"no_forcing": true}\n' if no_forcing else ""
    source = llguidance.LLMatcher.grammar_from_lark(head + 'start: "JSON" /[a-z]+/')
    matcher = GrammarMatcher(llguidance.LLMatcher(tokenizer, source), tokenizer.vocab_size)
    assert tokenizer.decode_bytes(matcher.forced()) == (b"" if no_forcing else b"JSON")
    assert tokenizer.decode_bytes(matcher.forced()) == (b"" if no_forcing else b"JSON")  # asked twice


@pytest.mark.parametrize("text", ["true", "[1]"])
def test_schema_text_that_is_no_object_is_a_typed_error_never_a_crash(text):
    from cactus_edge.constraints.grammar import grammar_source

    with pytest.raises(InvalidSettingError) as raised:
        grammar_source(text, None, None)
    assert raised.value.param == "json_schema"
