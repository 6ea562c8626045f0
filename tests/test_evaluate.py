"""HumanEval plumbing on a 2-problem subset: code extraction, the sandbox (incl. its timeout),
resumable output, the report's statistics."""

import json

import numpy as np
import pytest

from cactus_edge.cli.bench import Variant
from cactus_edge.cli.humaneval import (
    evaluate,
    extract_code,
    load_problems,
    mcnemar_pvalue,
    paired_difference_interval,
    report,
    run_tests,
    wilson_interval,
)
from cactus_edge.engine.engine import GenerationResult, GenerationStats

PROBLEMS = [
    {
        "task_id": "Tiny/0",
        "prompt": 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n',
        "entry_point": "total",
        "test": (
            "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"
        ),
    },
    {
        "task_id": "Tiny/1",
        "prompt": 'def double(x):\n    """Twice x."""\n',
        "entry_point": "double",
        "test": "def check(candidate):\n    assert candidate(4) == 8\n",
    },
]


@pytest.fixture
def problems_file(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def test_code_block_replies_and_bare_bodies_both_run(problems_file):
    problems = load_problems(problems_file)
    reply = "Sure:\n```python\ndef total(xs):\n    return sum(xs)\n```\nDone."
    assert run_tests(problems[0], extract_code(problems[0], reply)).passed
    assert run_tests(problems[1], extract_code(problems[1], "    return 2 * x\n")).passed
    wrong = run_tests(problems[1], extract_code(problems[1], "```python\ndef double(x):\n    return x\n```"))
    assert not wrong.passed and "AssertionError" in wrong.detail


def test_sandbox_times_out_and_is_isolated(problems_file):
    problem = load_problems(problems_file)[1]
    looping = "```python\ndef double(x):\n    while True:\n        pass\n```"
    assert run_tests(problem, extract_code(problem, looping), timeout=1.0).detail == "timeout"
    reads_env = (
        "```python\nimport os\ndef double(x):\n    assert 'HOME' not in os.environ\n    return 2 * x\n```"
    )
    assert run_tests(problem, extract_code(problem, reads_env)).passed  # a clean environment


class ScriptedEngine:
    """Answers every problem with a fixed reply per method; counts generations, logs the calls."""

    def __init__(self, replies):
        self.replies, self.calls, self.seeds, self.log = replies, 0, [], []

    def clear_caches(self):
        self.log.append("clear")

    def chat(self, messages, config):
        self.calls += 1
        self.seeds.append(config.seed)
        self.log.append("chat")
        stats = GenerationStats(method=config.method, n_tokens=10, n_verifier_calls=4, n_accepted=6)
        return GenerationResult(self.replies[config.method], [], "stop", stats)


def test_evaluation_is_resumable_and_reported(problems_file, tmp_path):
    problems = load_problems(problems_file)[1:]
    variants = [Variant("sps", n_draft=4), Variant("tas", n_draft=4)]
    engine = ScriptedEngine({"sps": "    return 2 * x\n", "tas": "    return x + 1\n"})
    out = tmp_path / "samples.jsonl"
    settings = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    records = list(evaluate(engine, problems, variants, settings, out))
    assert [r["passed"] for r in records] == [True, False]
    assert list(evaluate(engine, problems, variants, settings, out)) == []  # resumed: nothing left
    assert engine.calls == 2
    table = report(out, variants)
    assert "| sps k=4 | 1.000 (1/1) |" in table and "| tas k=4 | 0.000 (0/1) |" in table
    assert all(r["finish_reason"] == "stop" for r in map(json.loads, out.read_text().splitlines()))
    assert engine.seeds == [0, 0]  # a slice without first_index: seeds from 0
    assert engine.log == ["clear", "chat"] * 2  # every sample starts from empty caches


def test_a_slice_keeps_the_full_runs_seeds(problems_file, tmp_path):
    """Seeds are indices in the full problem set, so resuming a long run in slices (--offset)
    samples exactly what one full run samples."""
    engine = ScriptedEngine({"sps": "    return 2 * x\n"})
    settings = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    problems = load_problems(problems_file)
    variants = [Variant("sps", n_draft=4)]
    list(evaluate(engine, problems[1:], variants, settings, tmp_path / "s.jsonl", first_index=1))
    assert engine.seeds == [1]


def test_report_counts_token_limit_hits_and_kl(tmp_path):
    """A sample hit the limit when it finished by length; samples written before finish reasons
    were recorded count by their token count."""
    variants = [Variant("sps", n_draft=4), Variant("tas", n_draft=4), Variant("cactus", n_draft=4)]
    rows = [
        ("HumanEval/0", "sps k=4", True, 0.0, 64, "stop"),  # stopped right at the limit
        ("HumanEval/1", "sps k=4", False, 0.0, 30, "stop"),
        ("HumanEval/0", "tas k=4", True, 0.01, 64, "length"),
        ("HumanEval/1", "tas k=4", False, 0.01, 30, "length"),
        ("HumanEval/0", "cactus δ=1 k=4", True, 0.02, 64, None),  # old sample at the limit
        ("HumanEval/1", "cactus δ=1 k=4", True, 0.04, 30, None),
    ]
    out = tmp_path / "samples.jsonl"
    out.write_text(
        "".join(
            json.dumps(
                {
                    "task_id": t,
                    "variant": v,
                    "passed": ok,
                    "kl_mean": kl,
                    "n_tokens": n,
                    "acceptance_length": 2.0,
                    "tokens_per_second": 5.0,
                    "finish_reason": reason,
                }
            )
            + "\n"
            for t, v, ok, kl, n, reason in rows
        )
    )
    table = report(out, variants, max_tokens=64)
    assert "| sps k=4 | 0.500 (1/2) | 0.09–0.91 | 2.00 | 5.0 | – | 0 | – | – |" in table
    tas = "| tas k=4 | 0.500 (1/2) | 0.09–0.91 | 2.00 | 5.0 | 0.0100 | 2 | 1.00 (+0 / −0) | +0.000 ("
    assert tas in table
    low, high = paired_difference_interval(1, 1, 0, 0)  # cactus: both solved 0, only cactus 1
    cactus = (
        "| cactus δ=1 k=4 | 1.000 (2/2) | 0.34–1.00 | 2.00 | 5.0 | 0.0300 | 1 | 1.00 (+1 / −0) | "
        f"+0.500 ({low:+.3f} to {high:+.3f}) |".replace("-", "−")
    )
    assert cactus in table


@pytest.mark.parametrize(
    "cells",
    [(0.70, 0.05, 0.05, 0.20), (0.70, 0.08, 0.03, 0.19), (0.40, 0.10, 0.05, 0.45), (0.85, 0.02, 0.06, 0.07)],
)
def test_paired_difference_interval_covers_the_true_difference_95_percent_of_the_time(cells):
    """Coverage by simulation: 164 paired outcomes drawn from (both solve, only A, only B,
    neither), 4,000 times with a fixed seed; the interval must hold A's rate minus B's in
    93–97.5% of them (the standard error of the estimate is 0.35 points). Ignoring the pairing
    (phi = 0) or flipping its sign gives 99.7–100%."""
    rng = np.random.default_rng(0)
    truth = cells[1] - cells[2]
    draws = rng.multinomial(164, cells, size=4000)
    intervals = [paired_difference_interval(*map(int, counts)) for counts in draws]
    coverage = np.mean([low <= truth <= high for low, high in intervals])
    assert 0.93 <= coverage <= 0.975


def test_paired_difference_interval_edges():
    assert paired_difference_interval(0, 0, 0, 0) == (-1.0, 1.0)
    low, high = paired_difference_interval(100, 0, 0, 64)  # identical outcomes
    assert low < 0 < high and low == pytest.approx(-high)
    low, high = paired_difference_interval(0, 164, 0, 0)  # A solves all, B none
    assert 0.9 < low <= high == 1.0


def test_interval_and_paired_test():
    low, high = wilson_interval(40, 100)
    assert 0.30 < low < 0.31 and 0.49 < high < 0.50
    assert mcnemar_pvalue(0, 0) == 1.0
    assert mcnemar_pvalue(10, 0) == pytest.approx(2 / 1024)
    assert mcnemar_pvalue(5, 5) == 1.0


def test_eval_command_on_the_tiny_pair(tiny_args, problems_file, tmp_path):
    """End to end through the real engine: the tiny random model writes junk, which the sandbox
    runs and fails; the report and the resumable JSONL are still complete."""
    from click.testing import CliRunner

    from cactus_edge.cli.main import main

    out = tmp_path / "he.jsonl"
    args = [
        "eval",
        "humaneval",
        *tiny_args,
        *["--methods", "none,sps,cactus", "--deltas", "1.0", "--n-draft", "3"],
        "--problems",
        str(problems_file),
        *["--max-tokens", "16", "--timeout", "5"],
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["task_id"], r["variant"]) for r in records] == [
        (task, variant) for task in ("Tiny/0", "Tiny/1") for variant in ("none", "sps k=3", "cactus δ=1 k=3")
    ]
    assert "| sps k=3 |" in out.with_suffix(".md").read_text()
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and len(out.read_text().splitlines()) == 6  # resumed, nothing redone

    # The second problem alone (--offset 1) is sampled as in the full run: with the full run's
    # seed for it, and from empty caches (a prefix cached by the first problem changes samples).
    sliced = tmp_path / "he-offset.jsonl"
    sliced_args = [*args[: args.index("--out")], "--offset", "1", "--out", str(sliced)]
    assert CliRunner().invoke(main, sliced_args).exit_code == 0
    assert [json.loads(line)["completion"] for line in sliced.read_text().splitlines()] == [
        r["completion"] for r in records[3:]
    ]
