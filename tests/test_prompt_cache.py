"""The prompt cache on the tiny pair: saving and restoring a model's cache in llama.cpp, and the
engine returning to earlier conversations from memory, token for token as from a cold cache."""

import numpy as np
import pytest

from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.engine.prompt_cache import MIN_RESTORE_GAIN, CacheEntry, PromptCache
from cactus_edge.errors import BackendError, InvalidSettingError
from cactus_edge.llama.model import LlamaModel, SavedState

from .conftest import TEST_THREADS
from .test_engine import FLIP_MARGIN, MIN_COMPARED, greedy_compared_length

GREEDY = {"temperature": 0.0, "max_tokens": 40, "seed": 0}
MIN_TOKENS = 16  # entries from this many tokens, so that the tiny models' short texts are kept


def conversation(seed: int, length: int = 120, shared: list[int] | None = None) -> list[int]:
    """A prompt of token ids (words of the tiny vocabulary), ``shared`` first."""
    rng = np.random.default_rng(seed)
    return [*(shared or []), *(int(t) for t in rng.integers(10, 600, length))]


@pytest.fixture
def engine(tiny_pair):
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS) as engine:
        engine.prompt_cache.min_tokens = MIN_TOKENS
        yield engine


@pytest.fixture(scope="module")
def model(tiny_pair):
    with LlamaModel(tiny_pair[1], n_ctx=512, n_threads=TEST_THREADS) as model:
        yield model


# --- the llama layer ---------------------------------------------------------------------------


def next_logits(model, probe=(300,)):
    logits = model.decode(list(probe))[0].copy()
    model.truncate(model.n_past - len(probe))
    return logits


def test_a_restored_state_continues_as_the_original(model):
    text = conversation(1, 80)
    model.reset()
    model.decode(text)
    expected = next_logits(model)
    saved = model.save_state()
    assert saved.tokens == tuple(text) and saved.n_bytes > 0
    model.reset()
    model.decode(conversation(2, 50))  # another text in between
    model.restore_state(saved)
    assert model.tokens == text and model.cache_range() == (0, len(text) - 1)
    np.testing.assert_allclose(next_logits(model), expected, atol=1e-5)


def test_a_state_restored_in_part_equals_that_prefix(model):
    text = conversation(3, 80)
    model.reset()
    model.decode(text[:50])
    expected = next_logits(model)
    model.decode(text[50:])
    saved = model.save_state()
    model.reset()
    model.restore_state(saved, 50)
    assert model.tokens == text[:50] and model.cache_range() == (0, 49)
    np.testing.assert_allclose(next_logits(model), expected, atol=FLIP_MARGIN)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_state_is_refused_and_leaves_an_empty_consistent_cache(model, damage):
    model.reset()
    model.decode(conversation(4, 40))
    saved = model.save_state()
    data = {
        "truncated": saved.data[: len(saved.data) // 2],
        "garbage": bytearray(b"\x07" * len(saved.data)),
        "empty": bytearray(b"\x00" * 8),
    }[damage]
    model.decode([301, 302])
    with pytest.raises(BackendError):
        model.restore_state(SavedState(saved.tokens, bytearray(data)))
    assert model.tokens == [] and model.cache_range() == (-1, -1)


def test_a_state_of_another_shape_is_refused(model, tmp_path):
    """llama.cpp checks layers and row sizes (a model of the same shape would pass: what makes a
    state belong to a model is ours to check, as the engine's entries only ever meet their own)."""
    from .tiny_gguf import write_tiny_llama

    deeper = write_tiny_llama(tmp_path / "deeper.gguf", seed=2, n_layer=3)
    with LlamaModel(deeper, n_ctx=512, n_threads=TEST_THREADS) as other:
        other.decode(conversation(5, 30))
        foreign = other.save_state()
    with pytest.raises(BackendError):
        model.restore_state(foreign)
    assert model.tokens == [] and model.cache_range() == (-1, -1)


# --- the engine --------------------------------------------------------------------------------


def test_returning_to_a_conversation_restores_it_and_replies_as_from_a_cold_cache(engine, target_alone):
    first, second = conversation(10), conversation(11)
    cold = engine.generate(first, GenerationConfig(method="none", **GREEDY))
    engine.generate(second, GenerationConfig(method="none", **GREEDY))
    assert engine.prompt_cache.counters.saves == 1  # the first conversation, before it was cut
    again = engine.generate(first, GenerationConfig(method="none", **GREEDY))
    assert again.stats.prompt_cache == "memory"
    assert again.stats.n_prompt_decoded == 1  # everything but the last prompt token came back
    assert greedy_compared_length(target_alone, first, cold.tokens, again.tokens) >= MIN_COMPARED
    assert engine.check_caches([*first, *again.tokens]) == []


def test_a_restored_draft_drafts_as_a_cold_one(engine, target_alone):
    first, second = conversation(20), conversation(21)
    config = GenerationConfig(method="sps", n_draft=4, drafter="model", **GREEDY)
    engine.clear_caches()
    cold = engine.generate(first, config)
    engine.generate(second, config)
    again = engine.generate(first, config)
    assert again.stats.prompt_cache == "memory"
    compared = greedy_compared_length(target_alone, first, cold.tokens, again.tokens)
    assert compared >= MIN_COMPARED
    if compared == len(cold.tokens):  # no near-tie flipped: the same drafts were accepted
        assert again.stats.accepted_by_position == cold.stats.accepted_by_position


def test_conversations_sharing_a_system_prompt_restore_only_the_shared_part(engine):
    system = conversation(30, 60)
    first = conversation(31, 80, shared=system)
    other = conversation(32, 80, shared=system)
    unrelated = conversation(33, 100)
    engine.generate(first, GenerationConfig(method="none", **GREEDY))
    engine.generate(unrelated, GenerationConfig(method="none", **GREEDY))
    reply = engine.generate(other, GenerationConfig(method="none", **GREEDY))
    assert reply.stats.prompt_cache == "memory"
    assert reply.stats.n_prompt_decoded == len(other) - len(system)
    assert engine.check_caches([*other, *reply.tokens]) == []


def test_an_unrelated_prompt_restores_nothing(engine):
    engine.generate(conversation(40), GenerationConfig(method="none", **GREEDY))
    engine.generate(conversation(41), GenerationConfig(method="none", **GREEDY))
    fresh = conversation(42)
    reply = engine.generate(fresh, GenerationConfig(method="none", **GREEDY))
    assert reply.stats.prompt_cache != "memory"
    assert reply.stats.n_prompt_decoded == len(fresh)  # the seeds share no first token


def test_a_gain_below_the_threshold_keeps_the_live_cache(engine):
    base = conversation(50, 100)
    engine.generate(base, GenerationConfig(method="none", **GREEDY))
    engine.generate(conversation(51), GenerationConfig(method="none", **GREEDY))
    near = [*base[: MIN_RESTORE_GAIN - 2], 5]
    reply = engine.generate(near, GenerationConfig(method="none", **GREEDY))
    assert reply.stats.prompt_cache != "memory"


def test_the_bound_holds_and_least_recently_used_go_first(engine):
    prompts = [conversation(60 + i) for i in range(4)]
    engine.generate(prompts[0], GenerationConfig(method="none", **GREEDY))
    engine.generate(prompts[1], GenerationConfig(method="none", **GREEDY))
    one_entry = engine.prompt_cache.n_bytes
    assert one_entry > 0
    engine.prompt_cache.max_bytes = int(one_entry * 2.5)  # room for two entries of this size
    for prompt in prompts[2:]:
        engine.generate(prompt, GenerationConfig(method="none", **GREEDY))
    assert engine.prompt_cache.n_bytes <= engine.prompt_cache.max_bytes
    assert engine.prompt_cache.counters.evictions >= 1
    oldest = engine.generate(prompts[0], GenerationConfig(method="none", **GREEDY))
    assert oldest.stats.prompt_cache != "memory"  # evicted first
    recent = engine.generate(prompts[2], GenerationConfig(method="none", **GREEDY))
    assert recent.stats.prompt_cache == "memory"


def test_zero_turns_the_cache_off(tiny_pair):
    with Engine.load(
        str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS, cache_ram_mib=0
    ) as engine:
        engine.prompt_cache.min_tokens = MIN_TOKENS
        first = conversation(70)
        engine.generate(first, GenerationConfig(method="none", **GREEDY))
        engine.generate(conversation(71), GenerationConfig(method="none", **GREEDY))
        again = engine.generate(first, GenerationConfig(method="none", **GREEDY))
        assert again.stats.prompt_cache != "memory" and len(engine.prompt_cache) == 0


@pytest.mark.parametrize("bound", [-1, 1.5, "big", True])
def test_an_invalid_bound_is_refused_before_any_model_loads(tiny_pair, monkeypatch, bound):
    from cactus_edge.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(InvalidSettingError, match="cache_ram_mib"):
        Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), cache_ram_mib=bound)


def test_a_refused_restore_drops_the_entry_and_prefills(engine, target_alone, monkeypatch):
    first = conversation(80)
    cold = engine.generate(first, GenerationConfig(method="none", **GREEDY))
    engine.generate(conversation(81), GenerationConfig(method="none", **GREEDY))

    def refuse(saved, n_tokens=None):
        engine.target.reset()
        raise BackendError("refused")

    monkeypatch.setattr(engine.target, "restore_state", refuse)
    again = engine.generate(first, GenerationConfig(method="none", **GREEDY))
    assert again.stats.n_prompt_decoded == len(first)
    assert greedy_compared_length(target_alone, first, cold.tokens, again.tokens) >= MIN_COMPARED
    assert engine.check_caches([*first, *again.tokens]) == []
    kept = [entry.states["target"].tokens for entry in engine.prompt_cache.entries()]
    assert all(tokens[: len(first)] != tuple(first) for tokens in kept)  # the refused entry is gone


def test_a_generation_cancelled_after_a_restore_leaves_consistent_caches(engine):
    first = conversation(90)
    engine.generate(first, GenerationConfig(method="none", **GREEDY))
    engine.generate(conversation(91), GenerationConfig(method="none", **GREEDY))
    stream = engine.stream(first, GenerationConfig(method="sps", n_draft=3, drafter="model", **GREEDY))
    shown = [next(stream).token for _ in range(3)]
    stream.close()
    assert engine.check_caches([*first, *shown]) == []


def test_an_entry_that_another_covers_is_dropped():
    def state(tokens):
        return SavedState(tuple(tokens), bytearray(len(tokens)))

    cache = PromptCache(100)
    short = CacheEntry({"target": state([1, 2, 3])})
    cache.add(short)
    cache.add(CacheEntry({"target": state([1, 2, 3, 4, 5])}))
    assert short not in cache.entries() and len(cache) == 1
    cache.add(CacheEntry({"target": state([9] * 101)}))  # larger than the bound: not kept
    assert len(cache) == 1


def _entry(tokens, key=None):
    return CacheEntry({"target": SavedState(tuple(tokens), bytearray(len(tokens)))}, key=key)


def test_the_key_breaks_ties_and_never_beats_a_longer_prefix():
    cache = PromptCache(10_000)
    system = list(range(1, 41))
    mine, theirs = _entry([*system, 7, 7], key="a"), _entry([*system, 8, 8], key="b")
    longer = _entry([*system, 9, 9, 9], key="b")
    cache.add(mine)
    cache.add(theirs)
    new_prompt = [*system, 5, 5]
    assert cache.best("target", new_prompt, "a") == (mine, len(system))
    assert cache.best("target", new_prompt, "b") == (theirs, len(system))
    assert cache.best("target", new_prompt) == (theirs, len(system))  # no key: the most recent
    cache.add(longer)
    assert cache.best("target", [*system, 9, 9, 5], "a") == (longer, len(system) + 2)
    assert cache.best("target", [3, 3, 3], "a") == (None, 0)  # its key restores no differing token


def test_a_request_with_a_key_restores_its_own_entry_among_equals(engine):
    system = conversation(160, 60)
    first = conversation(161, 80, shared=system)
    second = conversation(162, 80, shared=system)

    def ask(prompt, key):
        return engine.generate(prompt, GenerationConfig(method="none", cache_key=key, **GREEDY))

    ask(first, "a")
    ask(second, "b")  # saves the first conversation under "a"
    ask(conversation(163), None)  # saves the second under "b"
    keys = {entry.states["target"].tokens[: len(first)]: entry.key for entry in engine.prompt_cache.entries()}
    assert keys[tuple(first)] == "a" and keys[tuple(second)] == "b"
    new = conversation(164, 80, shared=system)
    reply = ask(new, "a")
    assert reply.stats.prompt_cache == "memory"
    assert reply.stats.n_prompt_decoded == len(new) - len(system)  # only the shared part came back
    # The key's entry was restored (touched), then the live cache saved: without the key the more
    # recent "b" would have been.
    assert [entry.key for entry in engine.prompt_cache.entries()] == ["b", "a", None]
    assert engine.check_caches([*new, *reply.tokens]) == []


def test_a_key_that_is_not_a_string_is_refused():
    with pytest.raises(InvalidSettingError, match="cache_key"):
        GenerationConfig(cache_key=5)


# --- on disk -----------------------------------------------------------------------------------


def disk_engine(tiny_pair, folder, **caches):
    engine = Engine.load(
        str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS, cache_dir=folder, **caches
    )
    engine.prompt_cache.min_tokens = MIN_TOKENS
    return engine


def kept_files(folder):
    return sorted(folder.glob("*/*.kvc"))


def test_a_kept_conversation_comes_back_after_a_restart(tiny_pair, tmp_path, target_alone):
    first = conversation(100)
    with disk_engine(tiny_pair, tmp_path) as engine:
        cold = engine.generate(first, GenerationConfig(method="sps", n_draft=3, drafter="model", **GREEDY))
        assert engine.keep_conversation()
    assert len(kept_files(tmp_path)) == 1
    with disk_engine(tiny_pair, tmp_path) as restarted:  # a new process would see the same folder
        config = GenerationConfig(method="sps", n_draft=3, drafter="model", **GREEDY)
        again = restarted.generate(first, config)
        assert again.stats.prompt_cache == "disk" and again.stats.n_prompt_decoded == 1
        assert restarted.prompt_cache.counters.disk_hits == 1
        assert greedy_compared_length(target_alone, first, cold.tokens, again.tokens) >= MIN_COMPARED
        assert restarted.check_caches([*first, *again.tokens]) == []


def test_evicted_entries_spill_to_the_folder_and_come_back(tiny_pair, tmp_path):
    prompts = [conversation(110 + i) for i in range(3)]
    with disk_engine(tiny_pair, tmp_path, cache_ram_mib=0) as engine:  # memory holds nothing
        for prompt in prompts:
            engine.generate(prompt, GenerationConfig(method="none", **GREEDY))
        assert len(kept_files(tmp_path)) == 2  # the first two, each saved as the next came
        again = engine.generate(prompts[0], GenerationConfig(method="none", **GREEDY))
        assert again.stats.prompt_cache == "disk"


def _keep_one(tiny_pair, folder, seed=120):
    with disk_engine(tiny_pair, folder) as engine:
        engine.generate(conversation(seed), GenerationConfig(method="none", **GREEDY))
        assert engine.keep_conversation()
    (path,) = kept_files(folder)
    return path


def damaged(data: bytearray, damage: str) -> bytearray:
    if damage == "cut short":
        return data[: len(data) - 100]
    if damage == "a few bytes":
        return data[:6]
    if damage == "a flipped byte":
        data[-50] ^= 0xFF
    elif damage == "a token changed":  # the 100th: the prompt still matches what comes before it
        at = data.index(b'"tokens":[') + len(b'"tokens":[')
        for _ in range(99):
            at = data.index(b",", at) + 1
        data[at] = ord("1") if data[at] != ord("1") else ord("2")  # same length: sizes still match
    else:
        data[:4] = b"JUNK"
    return data


@pytest.mark.parametrize(
    "damage", ["cut short", "a few bytes", "a flipped byte", "a token changed", "not a cache file"]
)
def test_a_damaged_file_is_deleted_with_a_warning_and_never_restored(tiny_pair, tmp_path, caplog, damage):
    path = _keep_one(tiny_pair, tmp_path)
    path.write_bytes(bytes(damaged(bytearray(path.read_bytes()), damage)))
    with disk_engine(tiny_pair, tmp_path) as engine:
        reply = engine.generate(conversation(120), GenerationConfig(method="none", **GREEDY))
        assert reply.stats.prompt_cache != "disk"
        assert reply.stats.n_prompt_decoded == len(conversation(120))
    assert not path.exists()
    warnings = [record.getMessage() for record in caplog.records]
    assert any(path.name in warning and "deleted" in warning for warning in warnings)


def test_another_setups_files_are_neither_restored_nor_deleted(tiny_pair, tmp_path):
    """An engine of another context size shares the folder: it restores none of the first one's
    files and deletes none of them (they are valid for the first setup)."""
    path = _keep_one(tiny_pair, tmp_path)
    with Engine.load(
        str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=256, n_threads=TEST_THREADS, cache_dir=tmp_path
    ) as other_context:
        assert other_context.prompt_cache.folder.files() == []
        reply = other_context.generate(conversation(120), GenerationConfig(method="none", **GREEDY))
        assert reply.stats.prompt_cache != "disk"
    assert path.exists()


def use_f32_cells(monkeypatch):
    """Models created from now on keep f32 KV cells (llama.cpp's default is f16)."""
    from cactus_edge.llama import model as model_module

    defaults = model_module.llama_cpp.llama_context_default_params
    ggml_type_f32 = 0

    def with_f32_cells():
        params = defaults()
        params.type_k = params.type_v = ggml_type_f32
        return params

    monkeypatch.setattr(model_module.llama_cpp, "llama_context_default_params", with_f32_cells)


def test_another_kv_type_never_restores_a_saved_state(tiny_pair, tmp_path, model, monkeypatch):
    """Saved with f16 cells: an engine with f32 cells finds no file of its setup (and deletes none),
    and llama.cpp refuses the state itself."""
    path = _keep_one(tiny_pair, tmp_path)
    model.reset()
    model.decode(conversation(5, 30))
    f16_state = model.save_state()
    use_f32_cells(monkeypatch)
    with Engine.load(
        str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS, cache_dir=tmp_path
    ) as f32_engine:
        assert f32_engine.target.kv_types == (0, 0) != model.kv_types
        assert f32_engine.prompt_cache.folder.files() == []
        reply = f32_engine.generate(conversation(120), GenerationConfig(method="none", **GREEDY))
        assert reply.stats.prompt_cache != "disk"
        f32_engine.target.reset()
        with pytest.raises(BackendError):
            f32_engine.target.restore_state(f16_state)
        assert f32_engine.target.tokens == [] and f32_engine.target.cache_range() == (-1, -1)
    assert path.exists()


def test_a_file_moved_into_another_setups_folder_is_deleted_not_restored(tiny_pair, tmp_path, caplog):
    path = _keep_one(tiny_pair, tmp_path)
    with Engine.load(
        str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=256, n_threads=TEST_THREADS, cache_dir=tmp_path
    ) as other_context:
        moved = other_context.prompt_cache.folder.folder / path.name
        path.rename(moved)
        other_context.prompt_cache.folder.scan()
        assert other_context.prompt_cache.folder.files() == []
    assert not moved.exists()
    assert any("written for other models" in record.getMessage() for record in caplog.records)


def test_the_folder_of_a_changed_model_file_is_deleted_at_start(tiny_pair, tmp_path, caplog):
    import shutil

    from .tiny_gguf import write_tiny_llama

    draft, target = tmp_path / "draft.gguf", tmp_path / "target.gguf"
    shutil.copy(tiny_pair[0], draft)
    shutil.copy(tiny_pair[1], target)
    folder = tmp_path / "kv"
    with disk_engine((draft, target), folder) as engine:
        engine.generate(conversation(150), GenerationConfig(method="none", **GREEDY))
        assert engine.keep_conversation()
        setup_folder = engine.prompt_cache.folder.folder
    write_tiny_llama(target, seed=5)  # the file is replaced: its cached states mean nothing now
    with disk_engine(tiny_pair, folder):
        pass
    assert not setup_folder.exists()
    assert any("changed or missing model files" in record.getMessage() for record in caplog.records)


def test_an_unwritable_folder_is_refused_before_any_model_loads(tiny_pair, tmp_path, monkeypatch):
    from cactus_edge.engine import engine as engine_module
    from cactus_edge.errors import CacheFolderError

    monkeypatch.setattr(engine_module, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(CacheFolderError, match="cannot write the prompt cache folder"):
        Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), cache_dir=blocked / "cache")


def test_a_full_disk_is_a_warning_and_the_reply_still_comes(tiny_pair, tmp_path, monkeypatch, caplog):
    import errno

    from cactus_edge.engine import cache_files

    with disk_engine(tiny_pair, tmp_path) as engine:
        engine.generate(conversation(130), GenerationConfig(method="none", **GREEDY))

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(cache_files.os, "fsync", full)
        assert not engine.keep_conversation()
        reply = engine.generate(conversation(131), GenerationConfig(method="none", **GREEDY))
        assert reply.finish_reason == "length"
    assert kept_files(tmp_path) == [] and list(tmp_path.glob("*/*partial*")) == []
    assert any("No space left" in record.getMessage() for record in caplog.records)


def test_the_folder_keeps_its_bound(tiny_pair, tmp_path):
    with disk_engine(tiny_pair, tmp_path, cache_ram_mib=0) as engine:
        engine.generate(conversation(140), GenerationConfig(method="none", **GREEDY))
        engine.generate(conversation(141), GenerationConfig(method="none", **GREEDY))
        one_file = engine.prompt_cache.folder.n_bytes
        engine.prompt_cache.folder.max_bytes = int(one_file * 1.5)
        for seed in (142, 143):
            engine.generate(conversation(seed), GenerationConfig(method="none", **GREEDY))
        assert 0 < engine.prompt_cache.folder.n_bytes <= engine.prompt_cache.folder.max_bytes
        assert sum(path.stat().st_size for path in kept_files(tmp_path)) <= int(one_file * 1.5)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cache-ram", "-1"], "Invalid value for '--cache-ram'"),
        (["--cache-ram", "lots"], "Invalid value for '--cache-ram'"),
        (["--cache-disk", "0", "--cache-dir", "x"], "Invalid value for '--cache-disk'"),
        (["--cache-dir", "{blocked}/cache"], "cannot write the prompt cache folder"),
    ],
)
def test_bad_cache_flags_are_one_line_errors_before_serving(tiny_args, tmp_path, flags, message):
    from click.testing import CliRunner

    from cactus_edge.cli.main import main

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    flags = [flag.format(blocked=blocked) for flag in flags]
    result = CliRunner().invoke(main, ["serve", *tiny_args, "--port", "0", *flags])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_a_file_the_bound_deleted_is_written_again_when_kept(tiny_pair, tmp_path):
    with disk_engine(tiny_pair, tmp_path) as engine:
        engine.generate(conversation(160), GenerationConfig(method="none", **GREEDY))
        assert engine.keep_conversation()
        (path,) = kept_files(tmp_path)
        engine.prompt_cache.folder.forget(path, "deleted by the test")
        assert engine.keep_conversation() and kept_files(tmp_path) == [path]


def test_a_kept_file_llama_cpp_refuses_is_deleted(tiny_pair, tmp_path, monkeypatch):
    path = _keep_one(tiny_pair, tmp_path)
    with disk_engine(tiny_pair, tmp_path) as engine:

        def refuse(saved, n_tokens=None):
            engine.target.reset()
            raise BackendError("refused")

        monkeypatch.setattr(engine.target, "restore_state", refuse)
        reply = engine.generate(conversation(120), GenerationConfig(method="none", **GREEDY))
        assert reply.stats.prompt_cache is None and engine.prompt_cache.counters.hits == 0
        assert engine.check_caches([*conversation(120), *reply.tokens]) == []
    assert not path.exists()


@pytest.mark.parametrize("where", ["restore", "save"])
def test_an_interrupt_while_a_cache_is_saved_or_restored_leaves_the_caches_consistent(
    engine, monkeypatch, where
):
    """Ctrl-C inside a restore (after llama.cpp took the state) or inside a save: the generation
    ends with the interrupt, every cache is a prefix of the prompt as llama.cpp and the mirror
    agree, and the next request runs normally."""
    first, second = conversation(170), conversation(171)
    engine.generate(first, GenerationConfig(method="none", **GREEDY))
    engine.generate(second, GenerationConfig(method="none", **GREEDY))
    model = engine.target
    original = getattr(model, f"{where}_state")

    def interrupted(*args, **kwargs):
        original(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(model, f"{where}_state", interrupted)
    prompt = first if where == "restore" else conversation(172)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompt, GenerationConfig(method="none", **GREEDY))
    assert engine.check_caches(prompt) == []
    monkeypatch.undo()
    reply = engine.generate(prompt, GenerationConfig(method="none", **GREEDY))
    assert engine.check_caches([*prompt, *reply.tokens]) == []
