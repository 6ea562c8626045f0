"""One exit path: however a generation ends, both caches hold a prefix of prompt + the tokens the
consumer received, and llama.cpp's own position range agrees with our mirror. Every test inspects
the caches right after the exit, before any later call could repair them.

Each test starts from empty caches, so the generation it checks prefills the draft lazily: the
draft catches up on the whole prompt at its first drafting step, after the first token."""

import gc

import pytest

from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.llama.model import LlamaModel
from cactus_edge.rules import acceptance

PROMPT = "the water is hot and"
GREEDY_BLOCKS = {"method": "sps", "temperature": 0.0, "n_draft": 4, "max_tokens": 40}


@pytest.fixture(autouse=True)
def empty_caches(engine):
    engine.clear_caches()


def assert_caches_hold_only(engine, expected):
    """Each cache: a prefix of ``expected``, and llama.cpp holds positions 0..n_past-1 only."""
    for name, model in (("target", engine.target), ("draft", engine.draft)):
        low, high = model.cache_range()
        assert high == model.n_past - 1, f"{name}: llama.cpp holds up to {high}, mirror {model.n_past}"
        assert model.n_past == 0 or low == 0
        assert model.n_past <= len(expected), f"{name} holds {model.n_past - len(expected)} tokens too many"
        assert model.tokens == list(expected[: model.n_past]), f"{name} holds tokens never emitted"
    assert engine.check_caches(expected) == []


def received(engine, events, prompt=PROMPT):
    return engine.tokenize_prompt(prompt) + [e.token for e in events if e.token is not None]


def multi_token_block(engine, config):
    """Index of the first event that opens a block of ≥ 3 emitted tokens (drafts accepted)."""
    events = list(engine.stream(PROMPT, config))
    for index, event in enumerate(events[:-3]):
        if event.step == events[index + 2].step and (index == 0 or events[index - 1].step != event.step):
            engine.clear_caches()  # the stream under test catches the draft up itself
            return index, events
    pytest.fail("no block of three tokens: the tiny pair should accept drafts greedily")


def test_closing_the_stream_inside_a_block_cuts_the_unreceived_tokens(engine):
    config = GenerationConfig(**GREEDY_BLOCKS)
    start, _ = multi_token_block(engine, config)
    stream = engine.stream(PROMPT, config)
    events = [next(stream) for _ in range(start + 1)]  # the block's first token only
    stream.close()
    assert_caches_hold_only(engine, received(engine, events))


def test_an_abandoned_stream_is_cleaned_and_releases_the_engine(engine):
    config = GenerationConfig(**GREEDY_BLOCKS)
    start, _ = multi_token_block(engine, config)
    stream = engine.stream(PROMPT, config)
    events = [next(stream) for _ in range(start + 1)]
    del stream
    gc.collect()
    assert_caches_hold_only(engine, received(engine, events))
    assert engine.generate(PROMPT, config, timeout=0).finish_reason == "length"  # not busy


def test_stop_string_tokens_never_shown_are_not_kept(engine):
    config = GenerationConfig(**GREEDY_BLOCKS)
    full = engine.generate(PROMPT, config)
    pieces = [engine.target.detokenize([t]) for t in full.tokens]
    # A stop string starting inside token i (its last character) and spanning the next tokens:
    # token i is shown cut short, tokens i+1.. were held back and are dropped.
    i = next(i for i in range(3, len(pieces)) if len(pieces[i]) >= 2)
    start = sum(len(p) for p in pieces[:i]) + len(pieces[i]) - 1
    stop = full.text[start : start + 6]
    assert full.text.find(stop) == start and len(stop) == 6
    engine.clear_caches()
    events = list(engine.stream(PROMPT, GenerationConfig(**GREEDY_BLOCKS, stop=(stop,))))
    assert events[-1].finish_reason == "stop"
    assert [e.token for e in events[:-1]] == full.tokens[: i + 1]
    assert "".join(e.text for e in events) == full.text[:start]
    assert_caches_hold_only(engine, received(engine, events))


def test_end_of_generation_inside_an_accepted_block_is_not_kept(engine, monkeypatch):
    config = GenerationConfig(**GREEDY_BLOCKS)
    start, events = multi_token_block(engine, config)
    eog = events[start + 1].token  # an accepted draft token, mid-block
    assert events[start + 1].from_draft
    monkeypatch.setattr(engine.target, "is_end_of_generation", lambda token: token == eog)
    stopped = list(engine.stream(PROMPT, config))
    assert stopped[-1].finish_reason == "stop"
    assert eog not in [e.token for e in stopped[:-1]]
    assert_caches_hold_only(engine, received(engine, stopped))


@pytest.mark.parametrize("max_tokens", [1, 6, 11])
def test_length_leaves_exactly_the_received_tokens(engine, max_tokens):
    events = list(engine.stream(PROMPT, GenerationConfig(**{**GREEDY_BLOCKS, "max_tokens": max_tokens})))
    assert events[-1].finish_reason == "length" and len(events) - 1 == max_tokens
    assert_caches_hold_only(engine, received(engine, events))


def test_cancel_leaves_exactly_the_received_tokens(engine):
    import threading

    cancel = threading.Event()
    events = []
    for event in engine.stream(PROMPT, GenerationConfig(**GREEDY_BLOCKS), cancel=cancel):
        events.append(event)
        if len(events) == 5:
            cancel.set()
    assert events[-1].finish_reason == "cancelled"
    assert_caches_hold_only(engine, received(engine, events))


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_exception_inside_a_step_leaves_no_drafts_in_the_caches(engine, monkeypatch, error):
    """The rule fails after the target has scored the drafts: without the cleanup both caches
    would hold drafts that were never emitted."""
    real_verify = acceptance.AcceptanceRule.verify
    calls = []

    def failing_verify(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return real_verify(self, *args, **kwargs)

    monkeypatch.setattr(acceptance.AcceptanceRule, "verify", failing_verify)
    events = []
    with pytest.raises(type(error)):
        for event in engine.stream(PROMPT, GenerationConfig(**GREEDY_BLOCKS)):
            events.append(event)
    assert len(calls) == 3 and events
    assert_caches_hold_only(engine, received(engine, events))


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_exception_in_the_drafts_catch_up_leaves_consistent_caches(engine, monkeypatch, error):
    """The draft's first decode, the lazy catch-up on the prompt after the first token, fails
    midway: llama.cpp may keep part of the batch, and the exit path must cut it."""
    real_chunk = LlamaModel._decode_chunk

    def failing(self, chunk, rows):
        if self is engine.draft and self.n_past == 0:
            real_chunk(self, chunk, rows)  # llama.cpp holds the chunk, the mirror too
            raise error
        real_chunk(self, chunk, rows)

    monkeypatch.setattr(LlamaModel, "_decode_chunk", failing)
    events = []
    with pytest.raises(type(error)):
        for event in engine.stream(PROMPT, GenerationConfig(**GREEDY_BLOCKS)):
            events.append(event)
    monkeypatch.undo()
    assert len(events) == 1  # the first token came before any draft work
    assert_caches_hold_only(engine, received(engine, events))


def test_an_interrupt_between_llama_decode_and_the_mirror_is_repaired(engine, monkeypatch):
    """KeyboardInterrupt lands after llama_decode returned but before our mirror learnt of the
    tokens: llama.cpp then holds positions the mirror does not. Only a check against llama.cpp's
    own position range finds them."""
    real_chunk = LlamaModel._decode_chunk
    calls = []

    def interrupted(self, chunk, rows):
        real_chunk(self, chunk, rows)
        calls.append(1)
        if self is engine.target and len(calls) > 6:
            del self.tokens[len(self.tokens) - len(chunk) :]  # as if the interrupt came first
            raise KeyboardInterrupt

    monkeypatch.setattr(LlamaModel, "_decode_chunk", interrupted)
    events = []
    with pytest.raises(KeyboardInterrupt):
        for event in engine.stream(PROMPT, GenerationConfig(**GREEDY_BLOCKS)):
            events.append(event)
    monkeypatch.undo()
    assert_caches_hold_only(engine, received(engine, events))


def test_after_any_exit_the_next_generation_equals_a_fresh_engines(engine, tiny_pair):
    config = GenerationConfig(**GREEDY_BLOCKS)
    stream = engine.stream("the code is", config)
    next(stream), next(stream)
    stream.close()
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512) as fresh:
        assert engine.generate(PROMPT, config).tokens == fresh.generate(PROMPT, config).tokens
