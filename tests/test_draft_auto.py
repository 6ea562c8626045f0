"""`--draft auto`: the smallest local model that shares the target's tokenizer, or prompt lookup
when none does."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from cactus_edge.catalog.drafts import DraftSearch, find_draft
from cactus_edge.cli.main import main

from .tiny_gguf import write_tiny_llama


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A models folder: the target, an incompatible smallest model, a compatible small draft, and
    a compatible model larger than the target (never a draft)."""
    folder = tmp_path / "models"
    folder.mkdir()
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(folder))
    write_tiny_llama(folder / "target.gguf", seed=1)
    other_words = ("alpha", "beta", "gamma")
    write_tiny_llama(folder / "other-words.gguf", seed=2, n_embd=16, n_ff=32, words=other_words)
    write_tiny_llama(folder / "small-draft.gguf", seed=3, n_embd=32, n_ff=64)
    write_tiny_llama(folder / "bigger.gguf", seed=4, n_embd=128, n_ff=256)
    return folder


def test_the_smallest_compatible_model_is_chosen(models):
    search = find_draft(models / "target.gguf", models_dir=models)
    assert search.draft.name == "small-draft.gguf"
    assert search.n_tried == 2  # the incompatible smaller model first, then the draft


def test_no_compatible_model_means_none(models):
    (models / "small-draft.gguf").unlink()
    search = find_draft(models / "target.gguf", models_dir=models)
    assert search.draft is None and search.n_tried == 1


def test_the_cli_says_which_draft_it_chose_or_falls_back_to_lookup(models):
    runner = CliRunner()
    args = ["generate", "hi", "--target", str(models / "target.gguf"), "--draft", "auto"]
    args += ["--n-ctx", "256", "--threads", "1", "--max-tokens", "3"]
    chosen = runner.invoke(main, args)
    assert chosen.exit_code == 0, chosen.output
    assert "[models] --draft auto chose small-draft.gguf" in chosen.stderr
    assert "[models] draft small-draft.gguf -> target target.gguf" in chosen.stderr
    (models / "small-draft.gguf").unlink()
    fallback = runner.invoke(main, args)
    assert fallback.exit_code == 0, fallback.output
    assert "the one smaller local model does not share target.gguf's tokenizer" in fallback.stderr
    assert "drafting by prompt lookup (add one with --draft FILE)" in fallback.stderr
    assert "[models] target target.gguf, no draft model" in fallback.stderr


@pytest.mark.parametrize(
    ("n_tried", "line"),
    [
        (0, "--draft auto: no local model is smaller than t.gguf"),
        (1, "--draft auto: the one smaller local model does not share t.gguf's tokenizer"),
        (3, "--draft auto: none of the 3 smaller local models shares t.gguf's tokenizer"),
    ],
)
def test_the_fallback_line_counts_what_was_tried(n_tried, line):
    assert DraftSearch(None, n_tried).outcome("t.gguf") == line
    assert DraftSearch(Path("/m/d.gguf"), n_tried).outcome("t.gguf") == "--draft auto chose d.gguf"
