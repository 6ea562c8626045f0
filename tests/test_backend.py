"""The llama.cpp backend on tiny random-weight models: real llama.cpp, seconds per test."""

import time

import numpy as np
import pytest

from cactus_edge.errors import (
    BackendError,
    ContextLengthError,
    InvalidModelFileError,
    ModelNotFoundError,
)
from cactus_edge.llama.model import Detokenizer, LlamaModel

# Batched and one-token decoding sum in different orders; f32 logits of std ~4 differ by ~1e-3.
LOGIT_ATOL = 2e-2


@pytest.fixture(scope="module")
def draft(tiny_pair):
    with LlamaModel(tiny_pair[0], n_ctx=256, n_batch=16) as model:
        yield model


def test_vocabulary_facts(draft):
    assert draft.vocab_size == 642 or draft.vocab_size > 300
    assert draft.add_bos and draft.bos_token == 1
    assert draft.eos_token == 2 and draft.eot_token == 4
    assert draft.is_end_of_generation(2) and draft.is_end_of_generation(4)
    assert not draft.is_end_of_generation(300)
    assert "im_start" in draft.chat_template
    assert draft.n_ctx == 256 and draft.n_ctx_train == 512


def test_requested_rows_equal_one_token_at_a_time(draft):
    draft.reset()
    tokens = draft.tokenize("def quick sort(list): return sorted(list) # the fast way, with more words")
    assert len(tokens) > 16  # longer than n_batch: exercises chunking
    rows = [0, 5, len(tokens) - 1, -2]
    batched = draft.decode(tokens, output_rows=rows)
    assert batched.shape == (4, draft.vocab_size) and batched.dtype == np.float32
    draft.reset()
    single = np.stack([draft.decode([token])[0] for token in tokens])
    np.testing.assert_allclose(batched, single[[0, 5, len(tokens) - 1, len(tokens) - 2]], atol=LOGIT_ATOL)
    assert draft.n_past == len(tokens)


def test_teacher_forced_rows_equal_a_fresh_decode_and_leave_the_cache_empty(draft):
    tokens = draft.tokenize("the water is hot and the fire is warm")
    draft.reset()
    draft.decode(tokens[:2])  # whatever the cache held before is dropped first
    rows = draft.teacher_forced(tokens, [3, len(tokens) - 1])
    assert draft.n_past == 0 and draft.tokens == []
    draft.reset()
    expected = draft.decode(tokens[:4])[0]
    draft.reset()
    np.testing.assert_allclose(rows[0], expected, atol=LOGIT_ATOL)
    assert rows.shape == (2, draft.vocab_size)


@pytest.mark.parametrize("n_rows", [1, 5])
def test_logits_without_copy_are_a_read_only_view_of_the_same_rows(draft, n_rows):
    # The engine's hot path reads llama.cpp's output buffer in place.
    prompt = draft.tokenize("the water is hot and")
    block = [300, 301, 302, 303, 304][:n_rows]
    draft.reset()
    draft.decode(prompt, output_rows=())
    copied = draft.decode(block, output_rows=range(n_rows))
    draft.reset()
    draft.decode(prompt, output_rows=())
    view = draft.decode(block, output_rows=range(n_rows), copy=False)
    assert not view.flags.owndata and not view.flags.writeable
    np.testing.assert_array_equal(view, copied)
    # Rows that are not consecutive (or a chunked decode's early rows) still come back, copied.
    draft.reset()
    scattered = draft.decode([*prompt, *block], output_rows=[0, -1], copy=False)
    assert scattered.flags.owndata
    np.testing.assert_allclose(scattered[1], copied[-1], atol=LOGIT_ATOL)  # other batch shapes


def test_truncate_and_redecode_equals_a_fresh_run(draft):
    draft.reset()
    prompt = draft.tokenize("the water is hot and")
    draft.decode(prompt)
    draft.decode([300, 301, 302, 303], output_rows=[0, 1, 2, 3])  # a rejected draft block
    draft.truncate(len(prompt) + 1)
    after_rollback = draft.decode([400, 401], output_rows=[0, 1])
    assert draft.tokens == [*prompt, 300, 400, 401]
    draft.reset()
    fresh = draft.decode([*prompt, 300, 400, 401], output_rows=[-2, -1])
    np.testing.assert_allclose(after_rollback, fresh, atol=LOGIT_ATOL)


def test_truncate_bounds_are_checked(draft):
    draft.reset()
    draft.decode([1, 300])
    with pytest.raises(ValueError, match="cache holds 2"):
        draft.truncate(5)
    draft.truncate(0)
    assert draft.n_past == 0


def test_detokenizer_never_splits_a_character(draft):
    text = "café ✓ naïve 🙂 done"
    tokens = draft.tokenize(text, add_special=False)
    # 'é', '✓' and '🙂' are not in the tiny vocabulary: they arrive as 2-4 byte-fallback tokens.
    assert len(tokens) > len(text.split())
    detok = Detokenizer(draft)
    pieces = [detok.add(token) for token in tokens]
    # SPM vocabularies (like the tiny one) add a space prefix to the text they tokenize.
    assert "".join(pieces) + detok.flush() == " " + text
    assert all("\ufffd" not in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)  # some tokens held back mid-character


def test_tokenize_special_tokens(draft):
    assert draft.tokenize("<|im_start|>", add_special=False, parse_special=True) == [3]
    assert draft.tokenize("hi", add_special=True)[0] == 1


def test_context_overflow_is_a_clear_error(draft):
    draft.reset()
    with pytest.raises(ContextLengthError, match="context full"):
        draft.decode([300] * 257)
    assert draft.n_past == 0
    draft.decode([300] * 250)
    with pytest.raises(ContextLengthError):
        draft.decode([300] * 10)
    assert draft.n_past == 250


def test_invalid_token_is_refused_before_llama_cpp(draft):
    draft.reset()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        draft.decode([draft.vocab_size + 5])


def test_load_errors_are_typed(tmp_path, tiny_pair):
    with pytest.raises(ModelNotFoundError):
        LlamaModel(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(InvalidModelFileError):
        LlamaModel(junk)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_pair[0].read_bytes()[:-4096])
    with pytest.raises(InvalidModelFileError, match="truncated"):
        LlamaModel(truncated)
    with pytest.raises(ContextLengthError, match="trained context of 512"):
        LlamaModel(tiny_pair[0], n_ctx=4096)


def test_corrupt_header_that_passes_our_reader_is_a_backend_error(tmp_path, tiny_pair):
    data = bytearray(tiny_pair[0].read_bytes())
    # Rename a required tensor: our header reader is happy, llama.cpp refuses to load.
    index = data.find(b"output_norm.weight")
    data[index : index + 6] = b"xxxxxx"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(BackendError, match="could not load"):
        LlamaModel(broken, n_ctx=128)


def test_every_decode_runs_on_one_native_thread_whichever_thread_calls(draft, monkeypatch):
    """llama.cpp's OpenMP build keeps a worker team per calling thread; two calling threads halve
    decode speed on 2 cores, so every decode goes through the backend's one compute thread."""
    import threading

    import llama_cpp

    real_decode, callers = llama_cpp.llama_decode, []

    def recording_decode(ctx, batch):
        callers.append(threading.get_ident())
        return real_decode(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", recording_decode)
    draft.reset()
    tokens = draft.tokenize("the water is hot")
    draft.decode(tokens[:2])
    worker = threading.Thread(target=draft.decode, args=(tokens[2:],))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and draft.tokens == tokens
    assert len(callers) == 2 and len(set(callers)) == 1
    assert callers[0] not in (threading.get_ident(), worker.ident)


def test_an_interrupt_during_a_decode_waits_for_it_and_leaves_the_cache_as_before(draft, monkeypatch):
    """Ctrl-C while llama.cpp decodes: the native call cannot be stopped, so the caller waits for
    it, drops what it added, and only then raises; the mirror and the cache still agree."""
    import signal
    import threading

    import llama_cpp

    real_decode, finished = llama_cpp.llama_decode, threading.Event()

    def slow_interrupted_decode(ctx, batch):
        # A real SIGINT to the main thread, which is waiting for this call: it wakes the wait.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.2)
        status = real_decode(ctx, batch)
        finished.set()
        return status

    draft.reset()
    tokens = draft.tokenize("the water is hot and the fire is warm")
    draft.decode(tokens[:3])
    monkeypatch.setattr(llama_cpp, "llama_decode", slow_interrupted_decode)
    with pytest.raises(KeyboardInterrupt):
        draft.decode(tokens[3:])
    assert finished.is_set()  # raised only after the native call returned
    monkeypatch.setattr(llama_cpp, "llama_decode", real_decode)
    assert draft.tokens == tokens[:3] and draft.cache_range() == (0, 2)
    resumed = draft.decode(tokens[3:])[-1]
    draft.reset()
    np.testing.assert_allclose(resumed, draft.decode(tokens)[-1], atol=LOGIT_ATOL)


def _interrupt_main_after(seconds: float):
    import signal
    import threading

    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    return timer


def test_a_call_interrupted_before_it_started_is_withdrawn():
    """Ctrl-C while a call waits behind another: it never runs, and the caller returns at once."""
    import threading

    from cactus_edge.llama.model import _COMPUTE

    release, busy, ran = threading.Event(), threading.Event(), []
    blocker = threading.Thread(target=_COMPUTE.call, args=(lambda: (busy.set(), release.wait(10)),))
    blocker.start()
    assert busy.wait(10)
    timer = _interrupt_main_after(0.1)
    try:
        with pytest.raises(KeyboardInterrupt):
            _COMPUTE.call(ran.append, "ran")
        assert not release.is_set()  # returned while the first call was still running
    finally:
        timer.cancel()
        release.set()
        blocker.join(10)
    assert _COMPUTE.call(lambda: "later") == "later" and ran == []


def test_an_interrupt_is_not_lost_when_the_running_call_fails():
    import threading

    from cactus_edge.llama.model import _COMPUTE

    def failing_after_the_interrupt():
        delivered = threading.Event()
        timer = _interrupt_main_after(0.0)
        timer.join()
        delivered.wait(0.2)  # the caller is woken meanwhile and must keep waiting
        raise ValueError("the call's own failure")

    with pytest.raises(KeyboardInterrupt) as raised:
        _COMPUTE.call(failing_after_the_interrupt)
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(ValueError):  # without an interrupt, the call's exception as it is
        _COMPUTE.call(int, "x")


def test_decode_time_includes_waiting_for_the_backend(tiny_pair, monkeypatch):
    """On an asynchronous backend (RPC, CUDA, Metal) llama_decode can return before the compute
    ends; the wait for it is part of a decode's cost, which `auto` learns from last_decode_ms."""
    import llama_cpp

    synchronize = llama_cpp.llama_synchronize

    def slow_synchronize(ctx):  # what a backend still computing looks like
        time.sleep(0.05)
        return synchronize(ctx)

    with LlamaModel(tiny_pair[1], n_ctx=64) as model:
        monkeypatch.setattr(llama_cpp, "llama_synchronize", slow_synchronize)
        model.decode([1, 2, 3])
        assert model.last_decode_ms >= 50
