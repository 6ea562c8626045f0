"""Realistic pairs: vocabularies that differ at the end (within the pair check's 128 tokens), and
models that produce non-finite logits."""

import numpy as np
import pytest
from click.testing import CliRunner

from cactus_edge.cli.main import main
from cactus_edge.engine.config import DRAFTERS, METHODS
from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.engine.generation import Generation
from cactus_edge.errors import NonFiniteLogitsError
from cactus_edge.llama.model import LlamaModel
from cactus_edge.rules.sampling import SamplingConfig, to_dense

from .first_tokens import assert_first_drafted_steps_follow_the_target, sample_first_drafted_steps
from .test_engine import MIN_COMPARED, greedy_compared_length

PROMPT = "the water is hot and"
# After it both pairs' targets reply greedily for 40 tokens with no top-2 margin below 0.12: the
# two runs must agree in full (after PROMPT the larger target's margins go down to 2e-2).
NO_TIE_PROMPT = "number at of"


@pytest.fixture(scope="module", params=["larger-target", "larger-draft"])
def vocab_pair(request, tiny_larger_target, tiny_larger_draft):
    paths = tiny_larger_target if request.param == "larger-target" else tiny_larger_draft
    with Engine.load(str(paths[0]), str(paths[1]), n_ctx=512) as engine:
        assert engine.draft.vocab_size != engine.target.vocab_size
        yield engine


@pytest.fixture(scope="module")
def vocab_target_alone(vocab_pair):
    """The pair's target in a context of its own, for oracles and near-tie margins."""
    with LlamaModel(vocab_pair.target.path, n_ctx=512) as model:
        yield model


def test_the_pairs_are_the_issues_642_and_682_tokens(tiny_larger_target):
    sizes = [LlamaModel(path, n_ctx=64).vocab_size for path in tiny_larger_target]
    assert sizes == [642, 682]


@pytest.mark.statistical
def test_sps_stays_lossless_across_vocabulary_sizes(vocab_pair, vocab_target_alone):
    """The second token under SpS (the first a step drafts), given the first, over 3,000 seeds,
    against the target's own processed row after prompt + [t1] — target-only ids included (the
    draft gives them probability 0). Chi-square over the (t1, t2) cells, pooling small cells
    separately for shared and target-only t2, so that the rate of target-only ids is tested."""
    engine = vocab_pair
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    # A prompt after which the larger target puts ~9% of its mass on the ids the draft lacks (and
    # ~7% after prompt + [t1], averaged over t1).
    prompt_tokens = engine.tokenize_prompt("hello world code")
    n_runs = 3000
    steps = sample_first_drafted_steps(engine, prompt_tokens, n_runs, method="sps", n_draft=3, **sampling)
    assert steps.n_first_step_drafts == 0
    assert steps.second_step_drafted_after.total() == n_runs
    assert steps.n_second_step_accepted > n_runs * 0.3
    shared = min(engine.draft.vocab_size, engine.target.vocab_size)
    if engine.target.vocab_size > shared:
        assert steps.pair_counts[:, shared:].sum() > 50  # the target-only ids really were emitted
    target_only = np.zeros(steps.pair_counts.shape, dtype=int)
    target_only[:, shared:] = 1
    assert_first_drafted_steps_follow_the_target(
        vocab_target_alone, prompt_tokens, steps, SamplingConfig(**sampling), groups=target_only
    )


def test_draft_rows_live_on_the_target_vocabulary_and_never_propose_foreign_ids(vocab_pair):
    engine = vocab_pair
    prompt_tokens = engine.tokenize_prompt(PROMPT)
    for seed in range(50):
        settings = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "n_draft": 4, "seed": seed}
        generation = Generation(engine, list(prompt_tokens), GenerationConfig(**settings), threading_event())
        generation.reuse_prefixes()  # the draft catches up on the prompt inside sample, as in a step
        tokens, rows, _, _ = generation.drafter.model.sample(generation.committed, 4)
        assert all(row.shape[-1] == engine.target.vocab_size for row in rows)
        shared = min(engine.draft.vocab_size, engine.target.vocab_size)
        assert all(t < shared for t in tokens)
        assert all(to_dense(row)[shared:].sum() == 0 for row in rows)
        generation.settle()


def threading_event():
    import threading

    return threading.Event()


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_every_method_and_drafter_generates_on_a_mismatched_pair(vocab_pair, method, drafter):
    config = GenerationConfig(
        method=method, drafter=drafter, temperature=0.8, max_tokens=30, seed=1, n_draft=4
    )
    result = vocab_pair.generate("alpha beta the water gamma is hot and", config)
    assert result.finish_reason in ("length", "stop")
    assert vocab_pair.check_caches() == []


def test_greedy_speculation_equals_plain_greedy_on_a_mismatched_pair(vocab_pair, vocab_target_alone):
    greedy = {"temperature": 0.0, "max_tokens": 40}
    plain = vocab_pair.generate(NO_TIE_PROMPT, GenerationConfig(method="none", **greedy))
    spec = vocab_pair.generate(NO_TIE_PROMPT, GenerationConfig(method="sps", n_draft=4, **greedy))
    assert spec.stats.n_accepted > 0
    assert len(plain.tokens) == 40
    # Token-for-token, up to a legitimate flip where the target's top-2 margin is tiny.
    prompt_tokens = vocab_pair.tokenize_prompt(NO_TIE_PROMPT)
    compared = greedy_compared_length(vocab_target_alone, prompt_tokens, plain.tokens, spec.tokens)
    assert compared >= MIN_COMPARED


def test_the_cli_runs_the_issues_reproduction(tiny_larger_target):
    draft, target = tiny_larger_target
    result = CliRunner().invoke(
        main,
        [
            "generate",
            "hello",
            "--draft",
            str(draft),
            "--target",
            str(target),
            "--n-ctx",
            "512",
            "--method",
            "sps",
            "--n-draft",
            "4",
            "--max-tokens",
            "20",
            "--seed",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "disagree on the vocabulary size" not in result.output


def test_non_finite_logits_raise_a_typed_error_naming_model_and_row(tiny_pair, tiny_nan_target):
    with Engine.load(str(tiny_pair[0]), str(tiny_nan_target), n_ctx=256) as engine:
        with pytest.raises(NonFiniteLogitsError, match=r"tiny-nan-target\.gguf for output row 0"):
            engine.generate(PROMPT, GenerationConfig(n_draft=3, max_tokens=10))
        assert engine.check_caches(engine.tokenize_prompt(PROMPT)) == []


def test_the_cli_reports_non_finite_logits_as_a_backend_error(tiny_pair, tiny_nan_target):
    result = CliRunner().invoke(
        main,
        [
            "generate",
            "hello",
            "--draft",
            str(tiny_pair[0]),
            "--target",
            str(tiny_nan_target),
            "--n-ctx",
            "256",
        ],
    )
    assert result.exit_code == 6
    assert result.output.strip().splitlines()[-1].startswith("error: llama.cpp returned non-finite logits")
