"""`auto`'s batch costs kept between processes (cactus_edge.cost_cache): measured once per CPU,
model file and settings, then reused, so a one-shot generation does not re-measure them."""

import json
import os
import time

import pytest

from cactus_edge import engine as engine_module
from cactus_edge.adaptive import CALIBRATION_DRAFT_SIZES, CALIBRATION_VERIFY_SIZES
from cactus_edge.cost_cache import COST_CACHE_ENV, MAX_AGE_DAYS, cost_file, load_costs, save_costs
from cactus_edge.engine import Engine, GenerationConfig

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
    calls, real = [], engine_module.measure_batch_costs

    def counting(model, sizes, filler, repeats=1):
        calls.append(tuple(sizes))
        return real(model, sizes, filler, repeats)

    monkeypatch.setattr(engine_module, "measure_batch_costs", counting)
    return calls


def test_a_second_engine_reuses_the_first_ones_calibration(tiny_pair, cache_dir, monkeypatch):
    calls = _count_measurements(monkeypatch)
    config = GenerationConfig(method="cactus", n_draft="auto", drafter="model", max_tokens=6, seed=0)
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=1) as engine:
        first = engine.generate("the water is", config)
        measured = dict(engine.costs.verify.by_size)
    assert calls == [CALIBRATION_VERIFY_SIZES, CALIBRATION_DRAFT_SIZES]
    assert first.stats.calibration_ms > 0 and len(list(cache_dir.iterdir())) == 2
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=1) as engine:
        calibrated = []
        monkeypatch.setattr(engine.costs.verify, "record", lambda n, ms: calibrated.append((n, ms)))
        engine.generate("the fire is", config)
    assert len(calls) == 2  # nothing measured again
    kept = [json.loads(p.read_text())["ms_by_size"] for p in cache_dir.iterdir()]
    verify_kept = next(k for k in kept if len(k) == len(CALIBRATION_VERIFY_SIZES))
    # The second engine starts from exactly what the first measured (before its steps refined it).
    assert calibrated[: len(CALIBRATION_VERIFY_SIZES)] == [(int(n), ms) for n, ms in verify_kept.items()]
    assert set(measured) >= set(CALIBRATION_VERIFY_SIZES)
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=2) as engine:
        engine.generate("the fire is", config)
    assert len(calls) == 4  # another thread count costs differently: measured, kept apart
    assert len(list(cache_dir.iterdir())) == 4
