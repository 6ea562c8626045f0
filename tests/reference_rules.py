"""An independent reference for every acceptance rule, written from the formulas in
docs/methods.md ("The rules, as formulas") with plain dense numpy rows and loops.

It never imports cactus_edge: a wrong constant in a rule must not be wrong here too. Rows are
dense float64 vectors over the vocabulary; ``token`` is the drafted token n = d_i.
"""

from __future__ import annotations

import math

import numpy as np


def dense(row) -> np.ndarray:
    """A row as a dense float64 vector (SparseProbs rows are spread by their ids)."""
    if hasattr(row, "token_ids"):
        out = np.zeros(row.vocab_size)
        out[np.asarray(row.token_ids)] = np.asarray(row.probs, dtype=np.float64)
        return out
    return np.asarray(row, dtype=np.float64)


def normalize_positive_part(values: np.ndarray) -> np.ndarray:
    """normalize(max(0, values))."""
    positive = np.maximum(values, 0.0)
    return positive / positive.sum()


# --- Cactus: h from the target row and the drafted token ------------------------------------


def cactus_raised(target_prob: float, delta: float) -> float:
    """h(n) = min(q(n) + sqrt(2·δ·q(n)·(1 − q(n))), 1)."""
    return min(target_prob + math.sqrt(2.0 * delta * target_prob * (1.0 - target_prob)), 1.0)


def cactus_h(target_probs: np.ndarray, token: int, delta: float) -> np.ndarray:
    """h: q(n) raised to cactus_raised, every other x scaled to q(x)·(1 − h(n))/(1 − q(n));
    h = q when q(n) = 1."""
    target_prob = target_probs[token]
    if target_prob >= 1.0:
        return target_probs.copy()
    raised = cactus_raised(target_prob, delta)
    h = target_probs * (1.0 - raised) / (1.0 - target_prob)
    h[token] = raised
    return h


# --- per-position laws: (acceptance probability a_n, rejection distribution r_n) -------------


def sps_law(draft_probs, target_probs, token):
    """SpS: a = min(1, q(n)/p(n)); r = normalize(max(0, q − p))."""
    accept = min(1.0, target_probs[token] / draft_probs[token])
    return accept, _residual_or_none(target_probs, draft_probs, accept)


def cactus_law(draft_probs, target_probs, token, delta):
    """Cactus(δ): SpS's law with q replaced by h."""
    h = cactus_h(target_probs, token, delta)
    accept = min(1.0, h[token] / draft_probs[token])
    return accept, _residual_or_none(h, draft_probs, accept)


def _residual_or_none(target_like, draft_probs, accept):
    if accept >= 1.0:
        return None  # never rejected: no residual is drawn
    return normalize_positive_part(target_like - draft_probs)


def tas_threshold(target_probs, posterior_threshold=0.09, posterior_alpha=0.3) -> float:
    """min(τ, α·exp(−H(q))), H the entropy in nats."""
    support = target_probs[target_probs > 0]
    entropy = -sum(float(x) * math.log(float(x)) for x in support)
    return min(posterior_threshold, posterior_alpha * math.exp(-entropy))


def tas_law(draft_probs, target_probs, token, posterior_threshold=0.09, posterior_alpha=0.3):
    """TAS: accept iff q(n) > threshold; on rejection emit argmax q (the lowest id among ties)."""
    accepted = target_probs[token] > tas_threshold(target_probs, posterior_threshold, posterior_alpha)
    if accepted:
        return 1.0, None
    argmax = np.zeros_like(target_probs)
    argmax[int(np.argmax(target_probs))] = 1.0
    return 0.0, argmax


def exact_match_law(draft_probs, target_probs, token):
    """Exact match: y ~ q is kept iff y = n, so a = q(n) and r = q conditioned on y ≠ n."""
    accept = float(target_probs[token])
    if accept >= 1.0:
        return 1.0, None
    others = target_probs.copy()
    others[token] = 0.0
    return accept, others / others.sum()


def law_for(name: str, **params):
    """The per-position law of a rule by name: sps, cactus (delta), tas (posterior_threshold,
    posterior_alpha) or exact."""
    laws = {
        "sps": sps_law,
        "cactus": lambda p, q, n: cactus_law(p, q, n, params["delta"]),
        "tas": lambda p, q, n: tas_law(p, q, n, **params),
        "exact": exact_match_law,
    }
    return laws[name]


# --- the single-position output law (docs/methods.md, 'The exact oracle') --------------------


def output_law(law, draft_probs, target_probs) -> np.ndarray:
    """out(x) = Σ_n p(n)·[1{x = n}·a_n + (1 − a_n)·r_n(x)], enumerated over the draft's support."""
    draft_probs, target_probs = dense(draft_probs), dense(target_probs)
    out = np.zeros_like(target_probs)
    for token in np.flatnonzero(draft_probs > 0):
        accept, residual = law(draft_probs, target_probs, int(token))
        out[token] += draft_probs[token] * accept
        if accept < 1.0:
            out += draft_probs[token] * (1.0 - accept) * residual
    return out


def acceptance_rate(law, draft_probs, target_probs) -> float:
    """Σ_n p(n)·a_n: the probability that the drafted token is kept."""
    draft_probs, target_probs = dense(draft_probs), dense(target_probs)
    return sum(
        float(draft_probs[n]) * law(draft_probs, target_probs, int(n))[0] for n in np.flatnonzero(draft_probs)
    )


def kl(dist_a, dist_b) -> float:
    """KL(a ‖ b) in nats; inf where a has mass that b lacks."""
    total = 0.0
    for a, b in zip(dense(dist_a), dense(dist_b), strict=True):
        if a > 0:
            if b <= 0:
                return math.inf
            total += a * math.log(a / b)
    return total


def block_law(law, draft_rows, target_rows) -> dict[tuple[int, ...], float]:
    """The exact law of what one verified block emits, with rows fixed per position: the accepted
    prefix then the recovered or bonus token, as a tuple. draft_rows: k rows; target_rows: k + 1
    (the last is the bonus position, sampled from q_k as it is)."""
    draft_rows = [dense(r) for r in draft_rows]
    target_rows = [dense(r) for r in target_rows]
    outcomes: dict[tuple[int, ...], float] = {}

    def walk(position: int, prefix: tuple[int, ...], weight: float) -> None:
        if position == len(draft_rows):
            for bonus in np.flatnonzero(target_rows[position]):
                _add(outcomes, (*prefix, int(bonus)), weight * target_rows[position][bonus])
            return
        draft_probs, target_probs = draft_rows[position], target_rows[position]
        for token in np.flatnonzero(draft_probs > 0):
            accept, residual = law(draft_probs, target_probs, int(token))
            mass = weight * draft_probs[token]
            if accept > 0:
                walk(position + 1, (*prefix, int(token)), mass * accept)
            if accept < 1:
                for emitted in np.flatnonzero(residual > 0):
                    _add(outcomes, (*prefix, int(emitted)), mass * (1 - accept) * residual[emitted])

    walk(0, (), 1.0)
    return outcomes


def _add(outcomes: dict, key: tuple[int, ...], mass: float) -> None:
    outcomes[key] = outcomes.get(key, 0.0) + mass


# --- penalties and bias on raw logits, and processing -----------------------------------------


def shaped_logits(
    logits, bias=None, window=(), generated=(), repeat_penalty=1.0, frequency=0.0, presence=0.0
):
    """Raw logits → + bias, then the repeat penalty over ``window`` (a positive logit divided by
    it, a non-positive one multiplied), then − (c·frequency + presence) for each generated token
    seen c > 0 times."""
    out = np.array(logits, dtype=np.float64)
    for token, value in (bias or {}).items():
        out[token] += value
    if repeat_penalty != 1.0:
        for token in set(window):
            out[token] = out[token] / repeat_penalty if out[token] > 0 else out[token] * repeat_penalty
    for token in set(generated):
        out[token] -= list(generated).count(token) * frequency + presence
    return out


def processed(logits, temperature: float, top_k: int) -> np.ndarray:
    """softmax(logits / T) over the top-k logits (ties by lower id), zero elsewhere."""
    logits = np.asarray(logits, dtype=np.float64)
    keep = np.argsort(-logits, kind="stable")[:top_k]
    scaled = logits[keep] / temperature
    weights = np.exp(scaled - scaled.max())
    out = np.zeros_like(logits)
    out[keep] = weights / weights.sum()
    return out


def processed_full(logits, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """softmax(logits / T) over the top-k logits (0: all; ties by lower id), then the shortest
    prefix by descending probability (ties by lower id) whose mass reaches top_p, then the entries
    ≥ min_p × the largest; renormalised, zero elsewhere. Computed in float64 from a full sort."""
    logits = np.asarray(logits, dtype=np.float64)
    order = np.argsort(-logits, kind="stable")
    if top_k:
        order = order[:top_k]
    scaled = logits[order] / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    kept = []
    mass = 0.0
    for index, prob in zip(order, probs, strict=True):
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append((int(index), float(prob)))
        mass += float(prob)
    largest = max(prob for _, prob in kept)
    kept = [(index, prob) for index, prob in kept if prob >= min_p * largest]
    out = np.zeros_like(logits)
    total = sum(prob for _, prob in kept)
    for index, prob in kept:
        out[index] = prob / total
    return out
