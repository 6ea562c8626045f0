"""`auto`'s batch costs kept between processes (cactus_edge.engine.cost_cache): measured once per CPU,
model file and settings, then reused, so a one-shot generation does not re-measure them."""

import json
import os
import time

import pytest

from cactus_edge.engine import calibration
from cactus_edge.engine.cost_cache import (
    COST_CACHE_ENV,
    MAX_AGE_DAYS,
    cost_file,
    load_costs,
    save_costs,
    still_holds,
)
from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.rules.draft_length import CALIBRATION_DRAFT_SIZES, CALIBRATION_VERIFY_SIZES

IDENTITY = {"file": "/models/x.gguf", "size": 10, "n_threads": 2, "cpu": "test CPU"}
SIZES = (1, 2, 3)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(COST_CACHE_ENV, str(tmp_path / "costs"))
    return tmp_path / "costs"


def test_saved_costs_come_back_for_the_same_identity_only(cache_dir):
    save_costs(IDENTITY, {1: 30.0, 2: 55.5, 3: 70.25})
    assert load_costs(IDENTITY, SIZES) == {1: 30.0, 2: 55.5, 3: 70.25}
    assert load_costs({**IDENTITY, "n_threads": 4}, SIZES) is None
    assert load_costs({**IDENTITY, "size": 11}, SIZES) is None
    assert load_costs(IDENTITY, (1, 2, 3, 4)) is None  # a size it never measured
    assert [p.name for p in cache_dir.iterdir()] == [cost_file(IDENTITY).name]  # nothing half-written


def test_stale_unreadable_or_nonsense_files_are_measured_again(cache_dir):
    save_costs(IDENTITY, {1: 30.0, 2: 55.5, 3: 70.25})
    path = cost_file(IDENTITY)
    old = time.time() - (MAX_AGE_DAYS + 1) * 86400
    os.utime(path, (old, old))
    assert load_costs(IDENTITY, SIZES) is None
    for text in (
        "{not json",
        "[]",
        json.dumps({"ms_by_size": {"1": "x"}}),
        json.dumps({"ms_by_size": {"1": -1, "2": 1, "3": 1}}),
    ):
        path.write_text(text)
        assert load_costs(IDENTITY, SIZES) is None


def test_saving_removes_expired_tables_only(cache_dir):
    other = {**IDENTITY, "size": 99}
    save_costs(other, {1: 1.0, 2: 1.0, 3: 1.0})
    save_costs({**other, "size": 98}, {1: 1.0, 2: 1.0, 3: 1.0})
    old = time.time() - (MAX_AGE_DAYS + 1) * 86400
    os.utime(cost_file(other), (old, old))
    save_costs(IDENTITY, {1: 30.0, 2: 55.5, 3: 70.25})
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted(
        cost_file(identity).name for identity in (IDENTITY, {**other, "size": 98})
    )


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(COST_CACHE_ENV, "off")
    save_costs(IDENTITY, {1: 30.0})
    assert cost_file(IDENTITY) is None and load_costs(IDENTITY, SIZES) is None


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(COST_CACHE_ENV, str(blocker / "costs"))  # a folder inside a file: OSError
    save_costs(IDENTITY, {1: 30.0, 2: 1.0, 3: 1.0})
    assert load_costs(IDENTITY, SIZES) is None


def _count_measurements(monkeypatch) -> list:
    calls, real = [], calibration.measure_batch_costs

    def counting(model, sizes, filler, repeats=1):
        calls.append(tuple(sizes))
        return real(model, sizes, filler, repeats)

    monkeypatch.setattr(calibration, "measure_batch_costs", counting)
    return calls


CONFIG = GenerationConfig(method="cactus", n_draft="auto", drafter="model", max_tokens=6, seed=0)


def _files(cache_dir) -> dict[int, dict]:
    """The kept tables by how many sizes they hold (9: the target's verify sizes, 5: the draft's)."""
    kept = [json.loads(p.read_text())["ms_by_size"] for p in cache_dir.iterdir()]
    return {len(table): {int(n): ms for n, ms in table.items()} for table in kept}


def test_a_kept_table_holds_while_a_fresh_single_token_decode_agrees_with_it():
    kept = {1: 30.0, 2: 50.0}
    assert still_holds(kept, {1: 30.0}) and still_holds(kept, {1: 44.0}) and still_holds(kept, {1: 21.0})
    assert not still_holds(kept, {1: 46.0}) and not still_holds(kept, {1: 19.0}) and not still_holds(kept, {})


def test_a_second_engine_reuses_the_first_ones_calibration(tiny_pair, cache_dir, monkeypatch):
    calls = _count_measurements(monkeypatch)
    # The tiny models decode in ~0.1 ms, too noisy for the drift check: it is tested on its own.
    checks = []
    monkeypatch.setattr(calibration, "still_holds", lambda kept, fresh: checks.append(fresh) or True)
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=1) as engine:
        first = engine.generate("the water is", CONFIG)
        assert engine.costs.kept == set()
    assert calls == [CALIBRATION_VERIFY_SIZES, CALIBRATION_DRAFT_SIZES]
    assert first.stats.n_verifier_calls > 1 and len(list(cache_dir.iterdir())) == 2
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=1) as engine:
        calibrated = []
        monkeypatch.setattr(engine.costs.verify, "record", lambda n, ms: calibrated.append((n, ms)))
        engine.generate("the fire is", CONFIG)
    assert calls[2:] == [(1,), (1,)] and len(checks) == 2  # one check decode per model, no table
    assert engine.costs.kept == {"target", "draft"}
    # The second engine starts from exactly what the first measured (before its steps refined it).
    n_sizes = len(CALIBRATION_VERIFY_SIZES)
    assert dict(calibrated[:n_sizes]) == _files(cache_dir)[n_sizes]
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=2) as engine:
        engine.generate("the fire is", CONFIG)
    assert calls[4:] == [CALIBRATION_VERIFY_SIZES, CALIBRATION_DRAFT_SIZES]  # other threads: measured
    assert len(list(cache_dir.iterdir())) == 4


def test_a_kept_table_that_no_longer_holds_is_measured_again(tiny_pair, cache_dir, monkeypatch):
    calls = _count_measurements(monkeypatch)
    with Engine.load(None, str(tiny_pair[1]), n_ctx=512, n_threads=1) as engine:
        engine.generate("the water is", CONFIG.with_changes(drafter="lookup"))
        (path,) = cache_dir.iterdir()
        record = json.loads(path.read_text())
        record["ms_by_size"] = {n: ms * 1000 for n, ms in record["ms_by_size"].items()}  # under load
        path.write_text(json.dumps(record))
        engine.reset_estimates()
        engine.generate("the water is", CONFIG.with_changes(drafter="lookup"))
    assert calls == [CALIBRATION_VERIFY_SIZES, (1,), CALIBRATION_VERIFY_SIZES]
    assert max(json.loads(path.read_text())["ms_by_size"].values()) < max(record["ms_by_size"].values()) / 2


def test_costs_measured_behind_a_long_prompt_are_not_kept(tiny_pair, cache_dir, monkeypatch):
    monkeypatch.setattr(calibration, "MAX_KEPT_CONTEXT", 16)  # the tiny models hold 512 tokens
    with Engine.load(None, str(tiny_pair[1]), n_ctx=512, n_threads=1) as engine:
        prompt = engine.tokenize_prompt("the water is hot and the fire is warm " * 8)[:40]
        result = engine.generate(prompt, CONFIG.with_changes(drafter="lookup"))
        assert result.stats.calibration_ms > 0 and not cache_dir.exists()
        engine.clear_caches()
        engine.reset_estimates()
        engine.generate(prompt[:8], CONFIG.with_changes(drafter="lookup"))
    assert len(list(cache_dir.iterdir())) == 1  # the same engine behind a short prompt: kept
