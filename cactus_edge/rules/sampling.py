"""Logit processing shared by the draft and the target: temperature → top-k → top-p → min-p → softmax.

The same function and the same settings must be applied to both models (the rules compare p and q
row by row: docs/methods.md, 'The acceptance rules'), so this module is the only place that turns
logits into probabilities. It imports numpy only.

Two representations of processed rows leave this module:
- a :class:`SparseProbs` holding only the surviving entries, when top-k is on, temperature is 0,
  or top-p alone leaves at most MAX_SPARSE_NUCLEUS tokens in every row (the nucleus);
- a dense ``np.ndarray`` of float64, shape (V,) or (n, V), otherwise (no top-k and no top-p, or
  nuclei too wide to be worth a sparse form).
Both are accepted everywhere a row of probabilities is expected (the acceptance rules, the oracle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..checks import is_int, is_number
from ..errors import NonFiniteLogitsError

__all__ = [
    "SamplingConfig",
    "SparseProbs",
    "ProbRows",
    "process_logits",
    "process_candidates",
    "has_candidate_path",
    "sample_token",
    "row_support",
    "row_prob",
    "to_dense",
    "fit_logits_to_vocab",
    "widen_row",
    "top_k_logits",
    "first_non_finite_row",
]


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution. ``top_k = 0`` and ``top_p = 1`` and ``min_p = 0`` disable
    those filters; ``temperature = 0`` means greedy (a one-hot argmax row)."""

    temperature: float = 0.6
    top_k: int = 20
    top_p: float = 0.95
    min_p: float = 0.0

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampling(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """Raise ``ValueError`` naming the first invalid parameter and its allowed range."""
    if not is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {top_k!r}")
    if not is_number(top_p) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {top_p!r}")
    if not is_number(min_p) or not (0.0 <= min_p < 1.0):
        raise ValueError(f"min_p must be in [0, 1) (0 = disabled), got {min_p!r}")


@dataclass(frozen=True)
class SparseProbs:
    """Probability rows stored by their support.

    token_ids: int64, shape (m,) for one row or (n, m) for n rows; unique within a row.
    probs: float64, same shape as token_ids; each row sums to 1; entries may be 0 (padding after
        top-p / min-p), which are simply outside the support.
    vocab_size: V, the size of the vocabulary the ids index into.
    """

    token_ids: np.ndarray
    probs: np.ndarray
    vocab_size: int

    @property
    def ndim(self) -> int:
        return self.token_ids.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.token_ids.shape[:-1], self.vocab_size)

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def __getitem__(self, index: int) -> SparseProbs:
        if self.ndim != 2:
            raise TypeError("a single SparseProbs row cannot be indexed by row")
        return SparseProbs(self.token_ids[index], self.probs[index], self.vocab_size)

    def to_dense(self) -> np.ndarray:
        """The same rows as a dense float64 array, shape (V,) or (n, V)."""
        dense = np.zeros(self.shape, dtype=np.float64)
        np.put_along_axis(dense, self.token_ids, self.probs, axis=-1)
        return dense


ProbRows = np.ndarray | SparseProbs


def to_dense(rows: ProbRows) -> np.ndarray:
    return rows.to_dense() if isinstance(rows, SparseProbs) else np.asarray(rows, dtype=np.float64)


def fit_logits_to_vocab(logits: np.ndarray, vocab_size: int) -> np.ndarray:
    """The draft's logits restricted to the target's first ``vocab_size`` ids (a view, no copy).

    Pairs may differ by a few tokens at the end of the vocabulary (llama.cpp accepts such pairs when
    the shared ids have the same texts): ids the target lacks are dropped before processing, so the
    draft never proposes them and its distribution is renormalised over the ids both models share.
    logits: (..., V_draft) → (..., min(V_draft, V)).
    """
    return logits[..., :vocab_size] if logits.shape[-1] > vocab_size else logits


def widen_row(row: ProbRows, vocab_size: int) -> ProbRows:
    """One processed row over a smaller vocabulary, as a row over ``vocab_size`` ids: the ids it
    lacks get probability 0, so draft and target rows live on the same index set."""
    if isinstance(row, SparseProbs):
        if row.vocab_size == vocab_size:
            return row
        return SparseProbs(row.token_ids, row.probs, vocab_size)
    if row.shape[-1] == vocab_size:
        return row
    return np.pad(row, (0, vocab_size - row.shape[-1]))


def row_support(row: ProbRows) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids, probs) of the strictly positive entries of one row. O(V) for a dense row."""
    if isinstance(row, SparseProbs):
        keep = row.probs > 0
        return row.token_ids[keep], row.probs[keep].astype(np.float64, copy=False)
    ids = np.flatnonzero(row)
    return ids, np.asarray(row[ids], dtype=np.float64)


def row_prob(row: ProbRows, token: int) -> float:
    """Probability of ``token`` in one row (0 when outside the support)."""
    if isinstance(row, SparseProbs):
        hit = np.flatnonzero(row.token_ids == token)
        return float(row.probs[hit[0]]) if hit.size else 0.0
    return float(row[token])


def sample_token(row: ProbRows, rng: np.random.Generator) -> int:
    """Draw one token id from one row with a single uniform draw from ``rng``."""
    if isinstance(row, SparseProbs):
        return int(row.token_ids[sample_index(row.probs, rng)])
    return sample_index(np.asarray(row, dtype=np.float64), rng)  # zero entries are never drawn


_BLOCK = 1024


def sample_index(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Index drawn with probability proportional to ``weights`` (non-negative, positive sum);
    zero-weight entries are never drawn. Long rows are searched block by block, so a 151,936-entry
    row costs one pass of block sums, not a full cumulative sum."""
    if len(weights) <= 4 * _BLOCK:
        return _search(weights, rng.random())
    n_blocks = -(-len(weights) // _BLOCK)
    padded = np.zeros(n_blocks * _BLOCK)
    padded[: len(weights)] = weights
    block_sums = padded.reshape(n_blocks, _BLOCK).sum(axis=1)
    u = rng.random()
    block = _search(block_sums, u)
    below = block_sums[:block].sum()
    # Where u falls inside the chosen block, as a fraction of that block's mass.
    inner = min(max((u * block_sums.sum() - below) / block_sums[block], 0.0), np.nextafter(1.0, 0.0))
    return block * _BLOCK + _search(padded[block * _BLOCK : (block + 1) * _BLOCK], inner)


def _search(weights: np.ndarray, u: float) -> int:
    cumulative = np.cumsum(weights, dtype=np.float64)
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    if index >= len(weights):  # u rounded up to the total: take the last positive entry
        index = int(np.flatnonzero(weights > 0)[-1])
    return index


def process_logits(logits: np.ndarray, config: SamplingConfig) -> ProbRows:
    """Turn logits into the processed distribution shared by draft and target.

    logits: float array, shape (V,) or (n, V).
    Returns SparseProbs (top-k on, greedy, or a narrow top-p nucleus) or a dense float64 array of
    the input's shape.
    """
    logits = np.asarray(logits)
    if logits.ndim not in (1, 2):
        raise ValueError(f"logits must have shape (V,) or (n, V), got {logits.shape}")
    single = logits.ndim == 1
    rows = logits[None, :] if single else logits
    vocab_size = rows.shape[1]
    if config.greedy:
        ids = np.argmax(rows, axis=-1)[:, None].astype(np.int64)  # a NaN is its row's argmax
        _check_finite(np.take_along_axis(rows, ids, axis=-1)[:, 0])
        result: ProbRows = SparseProbs(ids, np.ones(ids.shape, dtype=np.float64), vocab_size)
    elif 0 < config.top_k < vocab_size:
        result = _process_top_k(rows, config)
    else:
        result = _process_dense(rows, config)
    if single:
        return result[0]
    return result


def _process_top_k(rows: np.ndarray, config: SamplingConfig) -> SparseProbs:
    """Sparse path: only the top-k logits of each row are ever exponentiated; all rows at once."""
    ids, values = top_k_logits(rows, config.top_k)  # sorted: column 0 holds each row's max
    return _top_k_probs(ids, values, rows.shape[1], config)


def _top_k_probs(ids: np.ndarray, values: np.ndarray, vocab_size: int, config: SamplingConfig) -> SparseProbs:
    """Rows' top-k (ids, logits), both (n, k) and sorted by descending logit → their processed
    distribution (temperature, top-p, min-p)."""
    scaled = values.astype(np.float64) / config.temperature
    probs = np.exp(scaled - scaled[:, :1])
    probs /= probs.sum(axis=-1, keepdims=True)
    probs = _apply_top_p_sorted(probs, config.top_p)
    probs = _apply_min_p(probs, config.min_p)
    return SparseProbs(ids, probs, vocab_size)


def has_candidate_path(config: SamplingConfig, vocab_size: int) -> bool:
    """Whether :func:`process_candidates` applies: greedy, or top-k on."""
    return config.greedy or 0 < config.top_k < vocab_size


def process_candidates(
    candidate_ids: np.ndarray, candidate_logits: np.ndarray, vocab_size: int, config: SamplingConfig
) -> SparseProbs:
    """:func:`process_logits` of one row (V,) that is -inf outside ``candidate_ids`` (int64
    (m,), ascending; ``candidate_logits`` float32 (m,) their logits), found from those entries
    alone: the same SparseProbs (ids, order and padding included) without a pass over V. For
    a grammar's narrow masks; only where :func:`has_candidate_path` holds."""
    values = np.asarray(candidate_logits)
    # One max decides the error (a NaN is the max). Few calls: each costs microseconds on the
    # caches a forward pass has just flushed.
    if not values.size or not math.isfinite(values.max()):
        raise non_finite_row_error(0)  # NaN, +inf, or no finite entry
    ids = candidate_ids
    if config.greedy:
        best = int(np.argmax(values))  # the first maximum: the lowest id, as argmax over V
        return SparseProbs(ids[best : best + 1], np.ones(1, dtype=np.float64), vocab_size)
    n_keep = config.top_k
    if ids.size > n_keep:
        # The entries at or above the k-th largest (ties included), in id order, before sorting.
        kth = np.partition(values, ids.size - n_keep)[ids.size - n_keep]
        kept = np.flatnonzero(values >= kth) if kth > -np.inf else np.flatnonzero(values > -np.inf)
        ids, values = ids[kept], values[kept]
    elif values.min() == -np.inf:
        kept = np.flatnonzero(values > -np.inf)
        ids, values = ids[kept], values[kept]
    # Stable on ascending ids: ties keep the lower id first, as top_k_logits orders them.
    order = np.argsort(-values, kind="stable")[:n_keep]
    top_ids, top_values = ids[order].astype(np.int64, copy=False), values[order]
    if order.size < n_keep:
        top_ids, top_values = _pad_with_lowest_ids(top_ids, top_values, n_keep)
    return _top_k_probs(top_ids[None], top_values[None], vocab_size, config)[0]


def _pad_with_lowest_ids(ids: np.ndarray, values: np.ndarray, n_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's top entries (fewer than n_keep finite) padded as top_k_logits pads such a row:
    with the lowest ids outside ``ids``, at -inf."""
    n_pad = n_keep - ids.size
    padding = np.setdiff1d(np.arange(n_pad + ids.size), ids)[:n_pad]
    return (
        np.concatenate([ids, padding]).astype(np.int64),
        np.concatenate([values, np.full(n_pad, -np.inf, dtype=values.dtype)]),
    )


_GROUP_SIZE = 64


def top_k_logits(rows: np.ndarray, n_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """The n_keep largest logits of each row, exactly, by descending value, ties by lower id (so
    the result does not depend on how they were found).

    rows: (n, V) float32; returns (ids int64 (n, n_keep), values float32 (n, n_keep)).
    Raises NonFiniteLogitsError for a row holding a NaN or +inf, or no finite logit.

    Each row is split into V / 64 interleaved groups (ids j, j + G, j + 2G, ...: a strided max
    over contiguous memory is one vectorized pass). Let ``floor`` be the n_keep-th largest group
    maximum: at least n_keep entries reach it, so every top entry does too, and lies in a group
    whose maximum reaches it. Only those groups' entries at or above ``floor`` are sorted (a few
    dozen); when many groups tie at the floor, the entries above it and the lowest ids at it.
    """
    n_rows, vocab_size = rows.shape
    n_groups = vocab_size // _GROUP_SIZE
    if n_groups < 8 * n_keep:  # small vocabulary: sort it all
        return _top_k_by_sorting(rows, n_keep)
    whole = n_groups * _GROUP_SIZE
    group_max = rows[:, :whole].reshape(n_rows, _GROUP_SIZE, n_groups).max(axis=1)  # a NaN wins
    tail = rows[:, whole:]  # ids past the last whole group: candidates of their own
    row_max = group_max.max(axis=-1)  # a NaN wins
    _check_finite(np.maximum(row_max, tail.max(axis=-1)) if tail.size else row_max)
    ids = np.empty((n_rows, n_keep), dtype=np.int64)
    for index in range(n_rows):
        ids[index] = _top_k_of_row(rows[index], group_max[index], whole, n_keep)
    return ids, np.take_along_axis(rows, ids, axis=-1)


def _top_k_of_row(row: np.ndarray, group_max: np.ndarray, whole: int, n_keep: int) -> np.ndarray:
    """The top-k ids of one finite row (V,), given its group maxima (n_groups,), in few numpy
    calls: each costs microseconds on the caches a forward pass has just flushed."""
    offsets = _group_offsets(group_max.size)
    finite = group_max > -np.inf
    n_finite = np.count_nonzero(finite)
    if n_finite < n_keep:  # finite entries in fewer than n_keep groups: a grammar's mask
        return _top_k_of_few_finite(row, np.flatnonzero(finite), offsets, whole, n_keep)
    # Partitioning thousands of tied -inf (a masked row) costs ten times a real row's.
    ranked = group_max if n_finite == group_max.size else group_max[finite]
    floor = np.partition(ranked, n_finite - n_keep)[n_finite - n_keep]
    groups = np.flatnonzero(group_max >= floor)
    if groups.size > 4 * n_keep:  # many groups tie at the floor
        return _top_k_around_floor(row, floor, n_keep)
    candidates = (groups[:, None] + offsets).ravel()
    if whole < row.size:
        candidates = np.concatenate([candidates, np.arange(whole, row.size)])
    candidate_values = row[candidates]
    keep = np.flatnonzero(candidate_values >= floor)
    candidates, candidate_values = candidates[keep], candidate_values[keep]
    return candidates[np.lexsort((candidates, -candidate_values))[:n_keep]]


def _top_k_of_few_finite(
    row: np.ndarray, groups: np.ndarray, offsets: np.ndarray, whole: int, n_keep: int
) -> np.ndarray:
    """Top-k ids of a row (V,) whose finite entries all lie in ``groups`` (fewer than n_keep)
    or the tail past ``whole``: the largest of them sorted, then the lowest ids at -inf (as
    :func:`_top_k_around_floor` orders them, without a pass over the whole row)."""
    candidates = (groups[:, None] + offsets).ravel()
    if whole < row.size:
        candidates = np.concatenate([candidates, np.arange(whole, row.size)])
    candidates = candidates[row[candidates] > -np.inf]
    finite = candidates[np.lexsort((candidates, -row[candidates]))][:n_keep]
    return np.concatenate([finite, _first_equal(row, -np.inf, n_keep - finite.size)])


def _top_k_around_floor(row: np.ndarray, floor: float, n_keep: int) -> np.ndarray:
    """Top-k ids of one row (V,) given a value ``floor`` that at least n_keep entries reach and
    fewer than n_keep groups exceed: the entries above it (at most 64·(n_keep − 1)), sorted, then
    the lowest ids equal to it. Two passes over the row instead of sorting thousands of ties."""
    above = np.flatnonzero(row > floor)
    above = above[np.lexsort((above, -row[above]))][:n_keep]
    return np.concatenate([above, _first_equal(row, floor, n_keep - above.size)])


_SCAN_BLOCK = 4096


def _first_equal(row: np.ndarray, value: float, count: int) -> np.ndarray:
    """The ``count`` lowest ids of ``row`` equal to ``value``, scanning block by block: under a
    grammar's mask most of a row is -inf and the first block holds them, where listing all the
    ties (150k ids) cost most of the row's processing."""
    found: list[np.ndarray] = []
    for start in range(0, row.size, _SCAN_BLOCK):
        if count <= 0:
            break
        hits = np.flatnonzero(row[start : start + _SCAN_BLOCK] == value)[:count] + start
        found.append(hits)
        count -= hits.size
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def _top_k_by_sorting(rows: np.ndarray, n_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """top_k_logits for a small vocabulary: a stable sort of each whole row."""
    _check_finite(rows.max(axis=-1))
    ids = np.argsort(-rows, axis=-1, kind="stable")[:, :n_keep].astype(np.int64)
    return ids, np.take_along_axis(rows, ids, axis=-1)


_offsets: dict[tuple[int, int], np.ndarray] = {}


def _group_offsets(n_groups: int) -> np.ndarray:
    """The ids of group 0 (group j is these + j), cached per vocabulary and group size."""
    key = (n_groups, _GROUP_SIZE)
    if key not in _offsets:
        _offsets[key] = n_groups * np.arange(_GROUP_SIZE, dtype=np.int64)
    return _offsets[key]


def first_non_finite_row(row_maxima: np.ndarray) -> int | None:
    """The first row whose largest logit is not finite (it holds a NaN, +inf, or nothing but
    -inf), or None. row_maxima: shape (n,)."""
    bad = np.flatnonzero(~np.isfinite(row_maxima))
    return int(bad[0]) if bad.size else None


def _check_finite(row_maxima: np.ndarray, first_row: int = 0) -> None:
    row = first_non_finite_row(row_maxima)
    if row is not None:
        raise non_finite_row_error(row + first_row)


def non_finite_row_error(row: int) -> NonFiniteLogitsError:
    """The error for non-finite logits in row ``row`` of a processed block (the backend names the
    model and cache position when it re-raises it)."""
    return NonFiniteLogitsError(f"non-finite logits (NaN or inf) in row {row}", row=row)


# A top-p-only row is returned sparse (its nucleus) when every row's nucleus has at most this many
# tokens: the rules, the sampler and the per-step KL then work on m entries instead of V.
MAX_SPARSE_NUCLEUS = 2048


def _process_dense(rows: np.ndarray, config: SamplingConfig) -> ProbRows:
    if config.top_p < 1.0:
        nuclei = []
        for index, row in enumerate(rows):
            nuclei.append(_nucleus(row, config, index))
            if nuclei[-1][0].size > MAX_SPARSE_NUCLEUS:
                break  # one wide row makes the block dense: stop computing nuclei
        else:
            return _apply_min_p_sparse(_stack_nuclei(nuclei, rows.shape[1]), config.min_p)
    probs = np.empty(rows.shape, dtype=np.float64)
    for index, row in enumerate(rows):
        probs[index] = _softmax_row(row, config.temperature, index)
        if config.top_p < 1.0:
            probs[index] = _apply_top_p_dense(probs[index], config.top_p)
    return _apply_min_p(probs, config.min_p)


def _nucleus(logits: np.ndarray, config: SamplingConfig, row_index: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-p nucleus of one full row, exactly as the dense path keeps it: (ids int64 (m,),
    probs float64 (m,)), descending probability, renormalised. Only the softmax's exp and sum
    touch all V entries."""
    exp = _exp_row(logits, config.temperature, row_index)  # float32 (V,), max entry 1
    ids, probs = _top_p_set(exp, exp.sum(dtype=np.float64), config.top_p)
    return ids, probs / probs.sum()


def _top_p_set(weights: np.ndarray, total: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of top entries of a non-negative row (V,) whose mass weights / total
    reaches top_p (at least one entry), without sorting V entries: (ids, weights / total) by
    descending weight, ties by id. Any set {weight >= t} is a top set, so once its mass reaches
    top_p it contains the answer: lower t until it does, and sort only that set."""
    threshold = weights.max() * 1e-3
    while True:
        candidates = np.flatnonzero(weights >= threshold)
        if weights[candidates].sum(dtype=np.float64) / total >= top_p or threshold == 0.0:
            break
        threshold = threshold * 1e-3 if threshold > 1e-300 else 0.0
    probs = weights[candidates].astype(np.float64) / total
    order = np.argsort(-probs, kind="stable")  # ties by id: candidates are ascending
    ids, probs = candidates[order], probs[order]
    keep = (np.cumsum(probs) - probs) < top_p
    return ids[keep], probs[keep]


def _stack_nuclei(nuclei: list[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> SparseProbs:
    """Rows of different support sizes as one (n, m) SparseProbs: shorter rows are padded with
    ids outside their support at probability 0 (ids stay unique within a row)."""
    width = max(ids.size for ids, _ in nuclei)
    all_ids = np.empty((len(nuclei), width), dtype=np.int64)
    all_probs = np.zeros((len(nuclei), width), dtype=np.float64)
    for index, (ids, probs) in enumerate(nuclei):
        all_ids[index, : ids.size] = ids
        all_probs[index, : ids.size] = probs
        if ids.size < width:
            spare = np.setdiff1d(np.arange(width + ids.size), ids, assume_unique=True)
            all_ids[index, ids.size :] = spare[: width - ids.size]
    return SparseProbs(all_ids, all_probs, vocab_size)


def _apply_min_p_sparse(rows: SparseProbs, min_p: float) -> SparseProbs:
    return SparseProbs(rows.token_ids, _apply_min_p(rows.probs, min_p), rows.vocab_size)


def _exp_row(logits: np.ndarray, temperature: float, row_index: int) -> np.ndarray:
    """exp((logits − max) / temperature) of one full row in float32 (max entry exactly 1)."""
    scaled = np.asarray(logits, dtype=np.float32) * np.float32(1.0 / temperature)
    top = scaled.max()
    _check_finite(np.array([top]), first_row=row_index)
    scaled -= top
    np.exp(scaled, out=scaled)
    return scaled


def _softmax_row(logits: np.ndarray, temperature: float, row_index: int = 0) -> np.ndarray:
    """Softmax of one full row: exp in float32 (twice as fast over V entries; relative error
    ~1e-7), the sum and the result in float64."""
    probs = _exp_row(logits, temperature, row_index).astype(np.float64)
    probs /= probs.sum()
    return probs


def _apply_top_p_sorted(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest prefix of each descending row whose mass reaches top_p (at least one)."""
    if top_p >= 1.0:
        return probs
    mass_before = np.cumsum(probs, axis=-1) - probs
    kept = np.where(mass_before < top_p, probs, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


def _apply_top_p_dense(row: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p on one dense probability row (V,), renormalised, without sorting V entries."""
    kept_ids, kept = _top_p_set(row, 1.0, top_p)
    out = np.zeros_like(row)
    out[kept_ids] = kept / kept.sum()
    return out


def _apply_min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Drop entries below min_p × the row's largest probability (scale-free, so the order with
    respect to renormalisation does not matter)."""
    if min_p <= 0.0:
        return probs
    threshold = min_p * probs.max(axis=-1, keepdims=True)
    kept = np.where(probs >= threshold, probs, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)
