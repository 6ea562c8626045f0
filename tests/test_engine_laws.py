"""The engine's emitted-token law at temperature > 0, past the first drafted token, against the
independent reference (tests/reference_rules.py) computed from the tiny models' own rows.

Seeded generations with a fixed block of 3 model drafts are cut into positions by their step
records, and each position is classed by what was decided *before* its token was drawn:

- ``start``: the first draft position of a block after the prefill or a bonus token;
- ``later``: draft position j ≥ 1 of a block whose first j drafts were accepted;
- ``after_rejection``: the first draft position of the block after a rejection;
- ``bonus``: the position after a fully accepted block.

Given its prefix (prompt + emitted tokens), a draft position's token follows the rule's exact
law out(p, q) of the two models' processed rows after that prefix (logit bias, then penalties
over the prefix, then temperature and top-k), and a bonus token follows q. Counts of each
(prefix, token) are compared with n(prefix) · law(token | prefix) by one chi-square over all
prefixes (cells expecting fewer than 5 pooled within their prefix; df = cells − prefixes),
significance 0.001; a token outside the law's support fails outright.

POWER. A class holds n ≈ 300–700 draws over g ≈ 5–110 prefixes (df = cells − g ≈ 20–450). The
test detects, with probability 0.8, any wrong law whose noncentrality
λ = Σ_prefix n(prefix)·Σ_x (wrong(x) − law(x))² / law(x) exceeds 37 at df 20, 68 at df 100 and
116 at df 350: at n = 600 and df 350, a shift of about 0.17 of probability between two tokens
holding 0.3 each in every prefix. The lossy laws differ from the target's row by λ ≈ 220–600
per class here. On these rows Cactus δ = 1 and δ = 0.5 emit nearly the same law (λ < 11), so the
rule's constant is pinned by tests/test_rules_reference.py, and these tests pin the engine's
wiring: which rows, shaped how, judged by which rule at which position. The repeat window is
what the shaping exercises here (verify rows shaped without the block's earlier drafts fail);
frequency and presence penalties never move a token into these rows' top 5 (the generated tokens
rank far below), so their formulas are pinned by tests/test_math_mutants.py instead.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import pytest
from scipy import stats as scipy_stats

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.llama.model import LlamaModel

from . import reference_rules as ref
from .conftest import TEST_THREADS

ALPHA = 1e-3
PROMPT = "the water is hot and"
N_RUNS = 1500
SAMPLING = {"temperature": 1.0, "top_k": 5, "top_p": 1.0}
# Bias on two of the target's likely first tokens (found below), and every penalty on.
PENALTIES = {"presence_penalty": 0.4, "frequency_penalty": 0.3, "repeat_penalty": 1.3, "repeat_last_n": 8}
BLOCK = {"n_draft": 3, "drafter": "model", "max_tokens": 6}
CLASSES = ("start", "later", "after_rejection", "bonus")


@dataclass
class Paths:
    """What seeded generations emitted, by position class: class → prefix → Counter(token)."""

    tokens: dict = field(default_factory=lambda: {c: defaultdict(Counter) for c in CLASSES})
    runs: list = field(default_factory=list)  # (emitted tokens, step records, kl_total) per run

    def add_run(self, tokens: list[int], steps, kl_total: float) -> None:
        self.runs.append((tokens, steps, kl_total))
        for cls, position in classify_positions(steps):
            self.tokens[cls][tuple(tokens[:position])][tokens[position]] += 1

    def total(self, cls: str) -> int:
        return sum(sum(c.values()) for c in self.tokens[cls].values())


def classify_positions(steps):
    """(class, index into the emitted tokens) of every position whose law is known in advance.
    A step with n_draft = m ≥ 1 and n_accepted = a judged draft positions 0..min(a, m − 1); when
    a = m, position m is the bonus."""
    position, after_rejection = 0, False
    for step in steps:
        drafted, accepted = step.n_draft, step.n_accepted
        if drafted:
            for j in range(min(accepted, drafted - 1) + 1):
                cls = "later" if j else ("after_rejection" if after_rejection else "start")
                yield cls, position + j
            if accepted == drafted:
                yield "bonus", position + drafted
        after_rejection = drafted > 0 and accepted < drafted
        position += accepted + 1


def judged_positions(steps):
    """Indices of the draft positions a rule judged, in order (every class but the bonus)."""
    return [position for cls, position in classify_positions(steps) if cls != "bonus"]


def sample_paths(engine, prompt_tokens, n_runs: int, **settings) -> Paths:
    """Generate with seeds 0..n_runs − 1 (end-of-generation tokens ignored, so every run is
    max_tokens long) and class every position."""
    paths = Paths()
    with mock.patch.object(engine.target, "is_end_of_generation", lambda token: False):
        for seed in range(n_runs):
            result = engine.generate(prompt_tokens, GenerationConfig(seed=seed, **settings))
            paths.add_run(result.tokens, result.stats.steps, result.stats.kl_total)
    return paths


class Rows:
    """Both models' processed rows after a prefix, from fresh caches, shaped by the reference."""

    def __init__(self, draft: LlamaModel, target: LlamaModel, prompt_tokens, bias, penalties) -> None:
        self.models, self.prompt_tokens = (draft, target), list(prompt_tokens)
        self.bias, self.penalties = bias, penalties
        self.cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, prefix: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(p, q) dense after prompt + prefix (prefix: the generated tokens so far)."""
        if prefix not in self.cache:
            context = self.prompt_tokens + list(prefix)
            last_n = self.penalties.get("repeat_last_n", 64)
            shaping = {
                "bias": self.bias,
                "window": context[-last_n:] if last_n else [],
                "generated": list(prefix),
                "repeat_penalty": self.penalties.get("repeat_penalty", 1.0),
                "frequency": self.penalties.get("frequency_penalty", 0.0),
                "presence": self.penalties.get("presence_penalty", 0.0),
            }
            rows = []
            for model in self.models:
                model.reset()
                logits = ref.shaped_logits(model.decode(context)[0], **shaping)
                rows.append(ref.processed(logits, SAMPLING["temperature"], SAMPLING["top_k"]))
            self.cache[prefix] = (rows[0], rows[1])
        return self.cache[prefix]


def law_pvalue(counts_by_prefix, law_of_prefix) -> float:
    """Chi-square p-value of the counts against n(prefix) · law(· | prefix), all prefixes in one
    statistic; within a prefix, cells expecting fewer than 5 are pooled (with the next-smallest
    while the pool expects fewer). Mass where the law has none gives p = 0."""
    statistic, n_cells, n_groups = 0.0, 0, 0
    for prefix, counts in counts_by_prefix.items():
        law = law_of_prefix(prefix)
        n = sum(counts.values())
        if any(law[token] <= 0 for token in counts):
            return 0.0
        support = np.flatnonzero(law > 0)
        expected = law[support] * n
        observed = np.array([counts.get(int(t), 0) for t in support], dtype=float)
        order = np.argsort(expected, kind="stable")
        expected, observed = expected[order], observed[order]
        n_pooled = int(np.searchsorted(expected, 5.0))
        while 0 < n_pooled < expected.size and expected[:n_pooled].sum() < 5.0:
            n_pooled += 1
        if n_pooled:
            expected = np.append(expected[n_pooled:], expected[:n_pooled].sum())
            observed = np.append(observed[n_pooled:], observed[:n_pooled].sum())
        statistic += float(((observed - expected) ** 2 / expected).sum())
        n_cells, n_groups = n_cells + expected.size, n_groups + 1
    if n_cells - n_groups < 1:
        return 1.0
    return float(scipy_stats.chi2.sf(statistic, n_cells - n_groups))


@pytest.fixture(scope="module")
def prompt_tokens(engine):
    return engine.tokenize_prompt(PROMPT)


@pytest.fixture(scope="module")
def fresh_models(tiny_pair):
    threads = {"n_ctx": 512, "n_threads": TEST_THREADS}
    with LlamaModel(tiny_pair[0], **threads) as draft, LlamaModel(tiny_pair[1], **threads) as target:
        yield draft, target


@pytest.fixture(scope="module")
def bias(fresh_models, prompt_tokens):
    """+1.5 on the target's third most likely first token, −1.5 on its most likely one."""
    _, target = fresh_models
    target.reset()
    ranked = np.argsort(-target.decode(list(prompt_tokens))[0])
    return {int(ranked[2]): 1.5, int(ranked[0]): -1.5}


def shaped_rows(fresh_models, prompt_tokens, bias) -> Rows:
    return Rows(*fresh_models, prompt_tokens, bias, PENALTIES)


def settings_for(method: str, bias, **extra) -> dict:
    return {"method": method, **BLOCK, **SAMPLING, **PENALTIES, "logit_bias": bias, **extra}


def out_law(law):
    """law(prefix) → the rule's output law after that prefix, from a rule's per-position law."""
    return lambda rows: lambda prefix: ref.output_law(law, *rows(prefix))


def target_law(rows):
    return lambda prefix: rows(prefix)[1]


@pytest.mark.statistical
@pytest.mark.parametrize(
    ("method", "extra", "law"),
    [("cactus", {"delta": 1.0}, ref.law_for("cactus", delta=1.0)), ("tas", {}, ref.law_for("tas"))],
    ids=["cactus-1", "tas"],
)
def test_lossy_rules_follow_their_law_at_every_kind_of_position(
    engine, fresh_models, prompt_tokens, bias, method, extra, law
):
    """Cactus δ = 1 and TAS, with logit bias and all three penalties on, 1,500 seeded
    generations of 6 tokens (prefill, a block of 3 drafts, what follows): each class of position
    against the reference, and the same counts tell the lossy law from the target's own row
    (power: the module's docstring)."""
    rows = shaped_rows(fresh_models, prompt_tokens, bias)
    paths = sample_paths(engine, prompt_tokens, N_RUNS, **settings_for(method, bias, **extra))
    for cls in CLASSES:
        assert paths.total(cls) >= 300, (cls, paths.total(cls))  # every class is well populated
        expected = target_law(rows) if cls == "bonus" else out_law(law)(rows)
        pvalue = law_pvalue(paths.tokens[cls], expected)
        assert pvalue > ALPHA, f"{method} {cls}: chi-square p = {pvalue:.3g}"
    for cls in ("start", "later", "after_rejection"):
        assert law_pvalue(paths.tokens[cls], target_law(rows)) < ALPHA, cls  # lossy: not q


@pytest.mark.statistical
def test_a_zero_budget_follows_the_target_at_drafted_positions(engine, fresh_models, prompt_tokens, bias):
    """Cactus δ = 1 under kl_budget 0 is SpS: every drafted position, including later positions
    of a block and positions after a rejection, follows the target's own row (bias and penalties
    on), and the same counts reject the Cactus law that an ignored budget would give."""
    rows = shaped_rows(fresh_models, prompt_tokens, bias)
    settings = settings_for("cactus", bias, delta=1.0, kl_budget=0.0)
    paths = sample_paths(engine, prompt_tokens, N_RUNS, **settings)
    for cls in CLASSES:
        assert paths.total(cls) >= 300, (cls, paths.total(cls))
        pvalue = law_pvalue(paths.tokens[cls], target_law(rows))
        assert pvalue > ALPHA, f"{cls}: chi-square p = {pvalue:.3g}"
    assert all(kl_total == 0.0 for _, _, kl_total in paths.runs)
    cactus = out_law(ref.law_for("cactus", delta=1.0))(rows)
    assert law_pvalue(paths.tokens["later"], cactus) < ALPHA


def replay_budget(steps, tokens, rows, budget: float, law) -> tuple[float, list[bool]]:
    """The budget's decisions recomputed from the reference: position by position, the lossy
    rule judges while the running sum plus that position's exact KL(out ‖ q) stays within the
    budget; from the first position that would exceed it, SpS judges the rest. Returns the sum
    and, per judged position, whether it was lossy."""
    spent, exhausted, lossy = 0.0, budget <= 0, []
    for position in judged_positions(steps):
        draft_probs, target_probs = rows(tuple(tokens[:position]))
        kl = ref.kl(ref.output_law(law, draft_probs, target_probs), target_probs)
        if not exhausted and spent + kl <= budget:
            spent += kl
            lossy.append(True)
        else:
            exhausted = True
            lossy.append(False)
    return spent, lossy


def test_a_budget_bounds_the_realised_kl_on_every_path(engine, fresh_models, prompt_tokens, bias):
    """kl_budget 0.5 with Cactus δ = 1 (per-position KL here 0.02–0.6 nats), 300 seeded
    generations of 10 tokens, the budget's decisions recomputed from the reference on every path:
    the sum of the exact per-position KL of the positions it leaves lossy stays within the budget
    (a position that would exceed it is judged by SpS, and so is every later one) and equals the
    reported kl_total (to 0.1%: the engine's rows come from batched decodes); and the tokens follow
    those decisions: the Cactus law where the replay is lossy, the target's row after it ends."""
    budget = 0.5
    law = ref.law_for("cactus", delta=1.0)
    rows = shaped_rows(fresh_models, prompt_tokens, bias)
    settings = settings_for("cactus", bias, delta=1.0, kl_budget=budget)
    paths = sample_paths(engine, prompt_tokens, 300, **{**settings, "max_tokens": 10})
    by_decision = {True: defaultdict(Counter), False: defaultdict(Counter)}
    largest_spent = 0.0
    for tokens, steps, kl_total in paths.runs:
        spent, lossy = replay_budget(steps, tokens, rows, budget, law)
        assert spent <= budget
        assert kl_total == pytest.approx(spent, rel=1e-3, abs=1e-6)
        for position, was_lossy in zip(judged_positions(steps), lossy, strict=True):
            by_decision[was_lossy][tuple(tokens[:position])][tokens[position]] += 1
        largest_spent = max(largest_spent, spent)
    assert largest_spent > budget / 2  # the lossy rule really spends
    n_lossy, n_lossless = (sum(sum(c.values()) for c in by_decision[key].values()) for key in (True, False))
    assert n_lossy >= 300 and n_lossless >= 300, (n_lossy, n_lossless)  # and the budget really ends
    assert law_pvalue(by_decision[True], out_law(law)(rows)) > ALPHA
    assert law_pvalue(by_decision[False], target_law(rows)) > ALPHA
