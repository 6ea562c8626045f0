"""Speculative greedy against an independent plain argmax loop.

The other "speculative greedy equals plain greedy" tests compare the engine with itself at k = 0,
so a bug both paths share (processing a greedy row, the first token after the prefill, the end
of generation, the prompt's ids) cannot show there. Here the reference is an argmax loop over
llama-cpp-python's own ``Llama``: it decodes the prompt in one batch, then one token at a time,
and takes numpy's argmax of the last logits row; no cactus_edge code decides anything in it.
Both start from the same ids: the engine's tokenization of the prompt, checked against
``Llama.tokenize`` of the same text.

Same computation: llama.cpp's default context enables flash attention on the CPU (the engine's
contexts use that default); ``Llama`` disables it unless asked, and without it its logits differ
from the engine's by up to 1.6 on SmolLM2: another computation, not a rounding. With it, the
engine's plain path reproduces the reference's logits bit for bit on both models; the engine's
verify batches (k + 1 rows) moved the tiny target's f32 logits by up to 4e-3 (|logits| ≤ 19),
SmolLM2's (Q4_1) not at all.

Near-ties: at the first difference, the engine's choice must score within TIE_TOLERANCE of the
reference's argmax in the reference's own row (a flip such a difference in rounding can
explain); then the two continue from different prefixes and the comparison stops there. Any
other difference fails. The prompts were picked so that the reference has no near-tie at all
(test_the_prompts_have_no_near_tie): every case must match in full, and each asserts a minimum
compared length besides.
"""

from __future__ import annotations

from dataclasses import dataclass

import llama_cpp
import numpy as np
import pytest

from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.llama.model import _COMPUTE
from cactus_edge.rules.draft_length import CostModel

# In logits: 2.5 times the largest difference a verify batch made on the tiny target (4.05e-3).
TIE_TOLERANCE = 1e-2
MAX_TOKENS = 64
# Words of tests/tiny_gguf.py's BASE_WORDS after which the tiny target's greedy reply has no top-2
# margin below 6e-2, six times TIE_TOLERANCE (of ~120 random word lists, among those with the
# widest smallest margin). Four run to max_tokens, one ends with an end-of-generation token.
PROMPTS = (
    "with else import thing some",
    "way will there like",  # a repetitive continuation: lookup drafts are accepted
    "have know which python",
    "how no long for",
    "find people like world None you",  # ends with "stop"
)
MIN_COMPARED = 48  # per prompt, or the reference's whole reply when it is shorter

CASES = {
    "plain": {"method": "none"},
    "sps model k=1": {"method": "sps", "drafter": "model", "n_draft": 1},
    "sps model k=3": {"method": "sps", "drafter": "model", "n_draft": 3},
    "sps model k=6": {"method": "sps", "drafter": "model", "n_draft": 6},
    "cactus(delta=1) model k=4": {"method": "cactus", "delta": 1.0, "drafter": "model", "n_draft": 4},
    "tas model k=4": {"method": "tas", "drafter": "model", "n_draft": 4},
    "exact model k=4": {"method": "exact", "drafter": "model", "n_draft": 4},
    "sps lookup k=4": {"method": "sps", "drafter": "lookup", "n_draft": 4},
    "cactus(delta=1) lookup k=8": {"method": "cactus", "delta": 1.0, "drafter": "lookup", "n_draft": 8},
    "exact model+lookup k=5": {"method": "exact", "drafter": "model+lookup", "n_draft": 5},
    "sps auto model": {"method": "sps", "drafter": "model", "n_draft": "auto"},
    "tas auto lookup": {"method": "tas", "drafter": "lookup", "n_draft": "auto"},
    "cactus(delta=1) auto model+lookup": {"method": "cactus", "delta": 1.0, "n_draft": "auto"},
}


class FixedCosts(CostModel):
    """A cost table under which drafting pays, which measured timings do not change: `auto`'s
    block lengths then follow what it learns about acceptance alone, not this machine's load
    (on 2 busy cores a stalled decode once made `auto` stop drafting for a whole reply)."""

    def __init__(self) -> None:
        super().__init__(calibrated={"target", "draft"})
        for n_tokens in range(1, 16):
            self.verify.record(n_tokens, 1.0 + 0.05 * n_tokens)
            self.draft.record(n_tokens, 0.1 + 0.02 * n_tokens)

    def record_draft(self, n_tokens: int, ms: float) -> None:
        pass

    def record_verify(self, n_tokens: int, ms: float) -> None:
        pass


@dataclass(frozen=True)
class Reply:
    """The reference's greedy reply: ``rows[i]`` is the logits row that chose ``tokens[i]``, or
    (one more row when ``finish`` is "stop") the end-of-generation token that ended it."""

    tokens: list[int]
    rows: np.ndarray
    finish: str
    end_ids: np.ndarray  # every id llama.cpp counts as an end of generation

    def margins(self) -> np.ndarray:
        """Top-2 logit margin of each row."""
        top = np.sort(self.rows, axis=1)[:, -2:]
        return top[:, 1] - top[:, 0]


class ArgmaxLoop:
    """Plain greedy decoding with llama-cpp-python's ``Llama``, one token per decode."""

    def __init__(self, path, n_ctx: int, n_threads: int) -> None:
        # n_threads as the engine's: one OpenMP team size for every decode of the process.
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            logits_all=False,
            verbose=False,
            seed=0,
            flash_attn=True,
        )
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = self.llm.n_vocab()
        self.end_ids = np.array(
            [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)], dtype=np.int64
        )

    def reply(self, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> Reply:
        # On the thread that runs every llama_decode of the process: a second decoding thread
        # would keep a second OpenMP team, which halves every later decode's speed on 2 cores.
        return _COMPUTE.call(self._reply, list(prompt_ids), max_tokens)

    def _reply(self, prompt_ids: list[int], max_tokens: int) -> Reply:
        self.llm.reset()
        self.llm.eval(prompt_ids)
        tokens, rows = [], []
        end = set(self.end_ids.tolist())
        for _ in range(max_tokens):
            last = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
            rows.append(np.ctypeslib.as_array(last, shape=(self.n_vocab,)).copy())
            token = int(np.argmax(rows[-1]))
            if token in end:
                return Reply(tokens, np.stack(rows), "stop", self.end_ids)
            tokens.append(token)
            self.llm.eval([token])
        return Reply(tokens, np.stack(rows), "length", self.end_ids)

    def close(self) -> None:
        self.llm.close()


def compared_length(reference: Reply, result) -> int:
    """How many tokens of the engine's ``result`` were compared with the reference: all of them,
    finish reason included, when they agree to the end; else the index of the first difference,
    where the engine's choice (a token, or ending the reply) must be a near-tie of the reference's
    argmax in the reference's row. Fails on any other difference."""
    expected, actual = reference.tokens, result.tokens
    common = min(len(expected), len(actual))
    index = next((i for i in range(common) if expected[i] != actual[i]), common)
    if index == len(expected) == len(actual):
        assert result.finish_reason == reference.finish, (result.finish_reason, reference.finish)
        return index
    assert index < len(reference.rows), (
        f"the engine went on past the reference's {len(expected)} tokens ({result.finish_reason})"
    )
    row = reference.rows[index]
    if index < len(actual):
        chosen, what = float(row[actual[index]]), f"token {actual[index]}"
    else:
        assert result.finish_reason == "stop", f"{result.finish_reason} after {index} tokens"
        chosen, what = float(row[reference.end_ids].max()), "the end of the reply"
    wanted = "the end" if index == len(expected) else f"token {expected[index]}"
    shortfall = float(row.max()) - chosen
    assert shortfall <= TIE_TOLERANCE, (
        f"token {index}: the engine chose {what} where plain greedy chose {wanted}, whose logit is "
        f"{shortfall:.3g} higher (near-ties within {TIE_TOLERANCE} are excused)"
    )
    return index


@pytest.fixture(scope="module")
def reference_loop(tiny_pair, engine):
    loop = ArgmaxLoop(tiny_pair[1], n_ctx=512, n_threads=engine.target.n_threads)
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def references(engine, reference_loop) -> dict[str, tuple[list[int], Reply]]:
    """{prompt: (the engine's prompt ids, the reference's reply)}."""
    replies = {}
    for prompt in PROMPTS:
        prompt_ids = engine.tokenize_prompt(prompt)
        assert reference_loop.llm.tokenize(prompt.encode()) == prompt_ids, prompt
        replies[prompt] = (prompt_ids, reference_loop.reply(prompt_ids))
    return replies


def test_the_prompts_have_no_near_tie(references):
    """Every case must then match the reference in full; 4 × 64 + 52 tokens per case."""
    for prompt, (_, reply) in references.items():
        margins = reply.margins()
        assert margins.min() > 3 * TIE_TOLERANCE, (prompt, int(margins.argmin()), float(margins.min()))
    lengths = [len(reply.tokens) for _, reply in references.values()]
    finishes = [reply.finish for _, reply in references.values()]
    assert lengths == [MAX_TOKENS] * 4 + [52] and finishes == ["length"] * 4 + ["stop"]


@pytest.mark.parametrize("settings", CASES.values(), ids=CASES.keys())
def test_greedy_equals_an_independent_argmax_loop(engine, references, settings):
    config = GenerationConfig(temperature=0.0, max_tokens=MAX_TOKENS, seed=0, **settings)
    engine.use_estimates(FixedCosts(), {})  # and nothing learnt about acceptance before this case
    compared, steps = [], []
    for prompt_ids, reference in references.values():
        engine.clear_caches()  # each prompt from empty caches: the batch shapes do not depend on order
        result = engine.generate(prompt_ids, config)
        compared.append(compared_length(reference, result))
        assert compared[-1] >= min(MIN_COMPARED, len(reference.tokens)), (compared, prompt_ids)
        steps += result.stats.steps
    # Prompts without a near-tie (test above): nothing can be excused, every reply matched whole.
    assert compared == [len(reference.tokens) for _, reference in references.values()]
    if config.method == "none":
        assert all(step.n_draft == 0 for step in steps)
        return
    assert sum(step.n_accepted for step in steps) > 0  # drafts were really verified and kept
    # Both ways a block ends: a rejection (the target's token in its place) and a bonus token.
    assert any(step.n_accepted < step.n_draft for step in steps)
    assert any(0 < step.n_draft == step.n_accepted for step in steps)
    if config.drafter != "model":
        assert any(step.drafter == "lookup" and step.n_accepted for step in steps)


@pytest.mark.slow
def test_greedy_equals_an_independent_argmax_loop_on_smollm2(smollm2_path):
    """SmolLM2 drafting for itself, a chat prompt whose reference reply has no near-tie in 64
    tokens (smallest top-2 margin 6.8e-2); its logits do not move with the batch shape."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with Engine.load(str(smollm2_path), str(smollm2_path), n_ctx=1024) as engine:
        loop = ArgmaxLoop(smollm2_path, n_ctx=1024, n_threads=engine.target.n_threads)
        try:
            prompt_ids = engine.tokenize_chat(messages)
            reference = loop.reply(prompt_ids)
            assert reference.margins().min() > 3 * TIE_TOLERANCE
            config = GenerationConfig(
                method="sps", drafter="model", n_draft=4, temperature=0.0, max_tokens=MAX_TOKENS, seed=0
            )
            result = engine.generate(prompt_ids, config)
        finally:
            loop.close()
    assert compared_length(reference, result) == len(reference.tokens) == MAX_TOKENS
    assert result.stats.acceptance_length > 2.5  # self-drafting: nearly every draft accepted
