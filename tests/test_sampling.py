"""Logit processing: each filter against a plain sort-based reference, both storage paths."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from cactus_edge.errors import NonFiniteLogitsError
from cactus_edge.rules.sampling import (
    SamplingConfig,
    SparseProbs,
    process_candidates,
    process_logits,
    row_prob,
    sample_token,
    to_dense,
    top_k_logits,
)


def reference_process(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """Straightforward full-sort implementation of temperature → top-k → top-p → min-p → softmax."""
    logits = np.asarray(logits, dtype=np.float64)
    out = np.zeros_like(logits)
    if config.temperature == 0:
        out[np.argmax(logits)] = 1.0
        return out
    order = np.argsort(-logits, kind="stable")
    if config.top_k:
        order = order[: config.top_k]
    scaled = logits[order] / config.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = np.ones(len(order), dtype=bool)
    if config.top_p < 1:
        cumulative = np.cumsum(probs)
        n_keep = int(np.searchsorted(cumulative, config.top_p) + 1)
        keep[n_keep:] = False
    keep &= probs >= config.min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    out[order] = probs / probs.sum()
    return out


CONFIGS = [
    SamplingConfig(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0),
    SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingConfig(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
    SamplingConfig(temperature=1.3, top_k=50, top_p=1.0, min_p=0.05),
    SamplingConfig(temperature=0.8, top_k=0, top_p=0.8, min_p=0.1),
    SamplingConfig(temperature=0.0, top_k=20, top_p=0.95, min_p=0.0),
]


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
@pytest.mark.parametrize("vocab_size", [300, 151_936])
def test_matches_reference(config, vocab_size):
    rng = np.random.default_rng(vocab_size)
    logits = (rng.standard_normal((3, vocab_size)) * 4).astype(np.float32)
    processed = process_logits(logits, config)
    dense = to_dense(processed)
    assert dense.shape == (3, vocab_size)
    # Full rows (dense, or a top-p nucleus) are exponentiated in float32 (relative error ~1e-7);
    # the top-k path in float64.
    float64 = config.top_k or config.temperature == 0
    tolerance = {"atol": 1e-12} if float64 else {"rtol": 2e-6, "atol": 1e-15}
    for row_logits, row in zip(logits, dense, strict=True):
        np.testing.assert_allclose(row, reference_process(row_logits, config), **tolerance)
        assert abs(row.sum() - 1) < 1e-9
    if config.top_k or config.temperature == 0 or config.top_p < 1:
        assert isinstance(processed, SparseProbs)


@pytest.mark.parametrize("config", [c for c in CONFIGS if not c.top_k and c.top_p < 1], ids=repr)
def test_a_top_p_only_row_is_its_nucleus_as_the_dense_path_computed_it(config):
    """The sparse nucleus holds exactly what the dense top-p path keeps (the old representation):
    the same ids, the same probabilities to float64 rounding."""
    from cactus_edge.rules import sampling

    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((4, 151_936)) * 4).astype(np.float32)
    processed = process_logits(logits, config)
    assert isinstance(processed, SparseProbs) and processed.token_ids.shape[1] <= sampling.MAX_SPARSE_NUCLEUS
    for index, row in enumerate(logits):
        dense = sampling._apply_top_p_dense(sampling._softmax_row(row, config.temperature), config.top_p)
        dense = sampling._apply_min_p(dense[None, :], config.min_p)[0]
        np.testing.assert_allclose(to_dense(processed[index]), dense, rtol=1e-12, atol=1e-15)
        assert np.count_nonzero(processed[index].probs) == np.count_nonzero(dense)


def test_a_wide_nucleus_stays_dense():
    """Near-uniform logits: top-p 0.9 keeps ~90% of the vocabulary, too wide for a sparse row."""
    logits = np.random.default_rng(1).standard_normal((2, 20_000)).astype(np.float32) * 0.01
    processed = process_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=0.9))
    assert isinstance(processed, np.ndarray) and np.count_nonzero(processed[0]) > 10_000
    mixed = logits.copy()
    mixed[0, 7] = 50.0  # the first row is narrow, the second wide: the whole block is dense
    processed = process_logits(mixed, SamplingConfig(temperature=1.0, top_k=0, top_p=0.9))
    assert isinstance(processed, np.ndarray) and np.flatnonzero(processed[0]).tolist() == [7]
    assert np.count_nonzero(processed[1]) > 10_000


def test_nuclei_of_different_sizes_pad_with_unused_ids():
    logits = np.full((2, 1000), -10.0, dtype=np.float32)
    logits[0, [5, 9]] = 10.0  # two tokens hold the mass
    logits[1, [1, 2, 3, 700]] = 10.0  # four do
    processed = process_logits(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=0.99))
    assert processed.token_ids.shape == (2, 4)
    assert sorted(processed.token_ids[0][processed.probs[0] > 0]) == [5, 9]
    assert all(len(set(row)) == 4 for row in processed.token_ids.tolist())  # padding ids are unique
    np.testing.assert_allclose(processed.probs.sum(axis=1), 1.0)


def test_single_row_keeps_its_shape():
    logits = np.linspace(-3, 3, 100).astype(np.float32)
    sparse = process_logits(logits, SamplingConfig(top_k=10))
    assert isinstance(sparse, SparseProbs) and sparse.shape == (100,)
    dense = process_logits(logits, SamplingConfig(top_k=0, top_p=1.0))
    assert dense.shape == (100,)


def test_greedy_is_one_hot_argmax():
    logits = np.array([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]], dtype=np.float32)
    dense = to_dense(process_logits(logits, SamplingConfig(temperature=0)))
    np.testing.assert_array_equal(dense, [[0, 1, 0], [1, 0, 0]])


def test_top_k_with_peaked_and_tied_logits_is_exact():
    # The subsample bound in the sparse path must hold for adversarial rows too.
    vocab_size = 151_936
    peaked = np.full(vocab_size, -10.0, dtype=np.float32)
    peaked[[5, 77_000, 151_935]] = [9.0, 8.0, 7.0]
    tied = np.zeros(vocab_size, dtype=np.float32)
    tied[-30:] = 1.0
    for logits in (peaked, tied):
        probs = process_logits(logits, SamplingConfig(temperature=1.0, top_k=20, top_p=1.0))
        expected = np.sort(logits)[-20:]
        np.testing.assert_array_equal(np.sort(logits[probs.token_ids]), expected)


@pytest.mark.parametrize("vocab_size", [151_936, 151_936 + 37, 50_000])
def test_top_k_by_groups_is_exact_on_adversarial_rows(vocab_size):
    # The top values all in one interleaved group, in the ids past the last whole group, spread
    # out, and tied: each must come back exactly, in the order of a stable full sort (descending
    # value, ties by lower id), whatever the grouping.
    rng = np.random.default_rng(vocab_size)
    n_groups = vocab_size // 64
    rows = rng.standard_normal((8, vocab_size)).astype(np.float32)
    rows[0, 7 + n_groups * np.arange(30)] = 50 + np.arange(30)  # one group holds them all
    rows[1, -37:] = 60.0 + np.arange(37)  # the tail (or the end of the last group)
    rows[2, rng.choice(vocab_size, 25, replace=False)] = 40.0
    rows[3] = 0.0  # everything tied
    rows[4] = -np.inf  # finite in 3 groups only, 30 entries each: fewer groups than n_keep
    finite = np.concatenate([g + n_groups * np.arange(30) for g in (5, 9, 11)])
    rows[4, finite] = np.round(rng.standard_normal(finite.size))  # with ties
    rows[5] = -np.inf  # fewer finite entries than n_keep, one past the last whole group
    rows[5, [3, 64 * n_groups + 2 if vocab_size % 64 > 2 else 17, 900]] = [1.0, 2.0, 1.0]
    # Finite in 60 groups only (a wide grammar mask): more than n_keep, far fewer than all, ties
    # at the floor; then the same groups all tied.
    some_groups = np.concatenate(
        [g + n_groups * np.arange(64) for g in rng.choice(n_groups, 60, replace=False)]
    )
    rows[6:] = -np.inf
    rows[6, some_groups] = np.round(rng.standard_normal(some_groups.size))
    rows[7, some_groups] = 1.0
    for n_keep in (1, 20, 50):
        ids, values = top_k_logits(rows, n_keep)
        assert ids.shape == values.shape == (8, n_keep)
        for row, row_ids, row_values in zip(rows, ids, values, strict=True):
            assert len(set(row_ids.tolist())) == n_keep
            np.testing.assert_array_equal(row[row_ids], row_values)
            np.testing.assert_array_equal(row_ids, np.argsort(-row, kind="stable")[:n_keep])


@pytest.mark.parametrize(
    ("where", "vocab_size"), [(0, 151_936), (12_345, 151_936), (151_935, 151_936), (151_972, 151_973)]
)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_a_single_non_finite_logit_is_caught_on_every_path(config, bad, where, vocab_size):
    # 151,973 = 64 · 2,374 + 37: the last id is past the last whole group of the top-k path.
    logits = np.random.default_rng(where).standard_normal((3, vocab_size)).astype(np.float32)
    logits[1, where] = bad
    with pytest.raises(NonFiniteLogitsError) as caught:
        process_logits(logits, config)
    assert caught.value.row == 1
    dead = np.full((1, 151_936), -np.inf, dtype=np.float32)  # no finite logit at all
    with pytest.raises(NonFiniteLogitsError):
        process_logits(dead, config)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
    ],
)
def test_invalid_settings_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingConfig(**kwargs)


def test_sampling_a_long_dense_row_by_blocks_is_exact():
    """The blockwise search over a 151,936-entry row draws with the row's own probabilities."""
    rng = np.random.default_rng(1)
    row = np.zeros(151_936)
    hot = np.array([3, 1023, 1024, 50_000, 151_935])
    row[hot] = [0.1, 0.2, 0.3, 0.15, 0.25]
    draws = np.array([sample_token(row, rng) for _ in range(20_000)])
    assert set(np.unique(draws)) <= set(hot)
    counts = np.array([(draws == t).sum() for t in hot])
    assert scipy_stats.chisquare(counts, row[hot] * 20_000).pvalue > 1e-3


def test_sample_token_follows_the_row():
    rng = np.random.default_rng(0)
    probs = process_logits(np.log(np.array([0.5, 0.3, 0.2, 1e-9])), SamplingConfig(1.0, 3, 1.0))
    counts = np.bincount([sample_token(probs, rng) for _ in range(20_000)], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.2, 0], atol=0.015)
    assert row_prob(probs, 3) == 0.0


@pytest.mark.parametrize("first_tie", [0, 4095, 4096, 9000, 151_000])
@pytest.mark.parametrize("count", [0, 1, 20])
def test_the_lowest_ids_at_a_tie_are_found_block_by_block(first_tie, count):
    """_first_equal equals listing every tie and keeping the first ones, wherever they start."""
    from cactus_edge.rules.sampling import _first_equal

    row = np.arange(151_936, dtype=np.float32)
    row[first_tie::7] = -np.inf
    expected = np.flatnonzero(row == -np.inf)[:count]
    np.testing.assert_array_equal(_first_equal(row, -np.inf, count), expected)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.greedy or c.top_k], ids=repr)
@pytest.mark.parametrize("vocab_size", [151_936, 151_973])
@pytest.mark.parametrize("n_allowed", [1, 3, 19, 20, 21, 500])
@pytest.mark.parametrize("n_minus_inf", [0, 2])
def test_candidates_give_what_the_masked_row_gives(config, vocab_size, n_allowed, n_minus_inf):
    # A grammar's narrow mask: the row is -inf outside the allowed ids. Processing the allowed
    # entries alone must give the dense path's SparseProbs exactly: ids, order, padding, probs.
    # Some allowed entries may be -inf themselves (a -inf bias): they pad, never rank.
    rng = np.random.default_rng(n_allowed * 7 + vocab_size)
    logits = np.round(rng.standard_normal(vocab_size) * 2, 1).astype(np.float32)  # with ties
    allowed = np.sort(rng.choice(vocab_size, n_allowed, replace=False))
    allowed[-1] = vocab_size - 1  # one in the tail past the last whole group, where there is one
    allowed[0] = 2  # a low id: padding must skip it (the lowest ids at -inf, not 0, 1, 2, ...)
    allowed = np.unique(allowed)
    if n_minus_inf and allowed.size > n_minus_inf:
        logits[allowed[1 : 1 + n_minus_inf]] = -np.inf
    masked = np.full(vocab_size, -np.inf, dtype=np.float32)
    masked[allowed] = logits[allowed]
    expected = process_logits(masked, config)
    found = process_candidates(allowed, logits[allowed], vocab_size, config)
    np.testing.assert_array_equal(found.token_ids, expected.token_ids)
    np.testing.assert_array_equal(found.probs, expected.probs)
    assert found.vocab_size == vocab_size


def test_candidates_refuse_nan_and_an_all_refused_row_like_the_dense_path():
    config = SamplingConfig(temperature=0.6, top_k=20, top_p=0.95)
    ids = np.array([3, 9], dtype=np.int64)
    for values in ([1.0, np.nan], [1.0, np.inf], [-np.inf, -np.inf]):
        with pytest.raises(NonFiniteLogitsError):
            process_candidates(ids, np.array(values, dtype=np.float32), 100, config)
