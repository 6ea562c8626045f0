#!/usr/bin/env python3
"""The quality cost of a re-quantized model: KL(reference ‖ candidate) on the reference's own text.

    .venv/bin/python scripts/quant_kl.py --reference NAME|PATH --candidate NAME|PATH \\
        [--prompts bundled|FILE] [--per-category N] [--max-tokens 128] [--seed 0] [--out DIR]

For each bench prompt (rendered with the reference's chat template, as `cactus-edge bench` does)
the reference samples a continuation of up to --max-tokens at temperature 1 (no top-k, no top-p;
seed --seed + prompt index). Prompt + continuation is then teacher-forced through both models, one
decode each, and every position where the reference sampled a token (its end-of-generation token
too) is scored over the full vocabulary, in float64 at temperature 1: KL(reference ‖ candidate) in
nats, and whether both models' most likely tokens agree. Both models must share a vocabulary size.

Reported: positions, mean / median / p90 KL, top-1 agreement, mean KL per prompt category; a
Markdown table on stdout and everything in DIR/quant_kl.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from cactus_edge.backend import LlamaModel
from cactus_edge.bench import load_prompts, per_category
from cactus_edge.config import GenerationConfig
from cactus_edge.engine import Engine
from cactus_edge.errors import CactusEdgeError
from cactus_edge.gguf_info import read_gguf
from cactus_edge.machine import cpu_model_name
from cactus_edge.registry import resolve_model_path

ROWS_PER_CHUNK = 64  # float64 work on at most this many logit rows at a time


def describe_file(path: Path) -> str:
    return f"{path.name} ({path.stat().st_size / 1e6:,.1f} MB)"


def select_prompts(prompts_arg: str, n_per_category: int | None) -> list[dict]:
    prompts = load_prompts(None if prompts_arg == "bundled" else prompts_arg)
    return per_category(prompts, n_per_category) if n_per_category else prompts


def context_size(path: Path, wanted: int) -> int:
    """``wanted``, or the model's trained context if that is smaller."""
    trained = read_gguf(path).context_length
    return min(wanted, trained) if trained else wanted


def check_same_vocabulary(reference: Path, candidate: Path) -> None:
    """Refuse, before loading any weights, a pair whose vocabulary sizes differ."""
    reference_vocab, candidate_vocab = read_gguf(reference).vocab_size, read_gguf(candidate).vocab_size
    if reference_vocab != candidate_vocab:
        raise SystemExit(
            f"error: the vocabularies differ ({reference.name}: {reference_vocab:,} tokens, "
            f"{candidate.name}: {candidate_vocab:,}); KL needs the same vocabulary in both models"
        )


def sample_continuation(
    engine: Engine, prompt_ids: list[int], max_tokens: int, seed: int
) -> tuple[list[int], bool]:
    """The reference's continuation at temperature 1, and whether it ended by its own
    end-of-generation token (not counted in the tokens, but sampled: a scored position too)."""
    config = GenerationConfig(
        method="none", temperature=1.0, top_k=0, top_p=1.0, max_tokens=max_tokens, seed=seed
    )
    result = engine.generate(prompt_ids, config)
    return result.tokens, result.finish_reason == "stop"


def log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    shifted = rows - rows.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def score_positions(
    reference_logits: np.ndarray, candidate_logits: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: KL(reference ‖ candidate) in nats (float64) and whether the argmaxes agree."""
    kls, agrees = [], []
    for start in range(0, len(reference_logits), ROWS_PER_CHUNK):
        reference_rows = reference_logits[start : start + ROWS_PER_CHUNK]
        candidate_rows = candidate_logits[start : start + ROWS_PER_CHUNK]
        reference_logp, candidate_logp = log_softmax(reference_rows), log_softmax(candidate_rows)
        kl = (np.exp(reference_logp) * (reference_logp - candidate_logp)).sum(axis=1)
        kls.append(np.maximum(kl, 0.0))  # rounding can leave a tiny negative for equal rows
        agrees.append(reference_rows.argmax(axis=1) == candidate_rows.argmax(axis=1))
    return np.concatenate(kls), np.concatenate(agrees)


def score_prompt(engine: Engine, candidate: LlamaModel, prompt_ids: list[int], args, seed: int) -> dict:
    continuation, ended = sample_continuation(engine, prompt_ids, args.max_tokens, seed)
    n_scored = len(continuation) + ended
    fed_ids = (prompt_ids + continuation)[: len(prompt_ids) + n_scored - 1]
    scored = range(len(fed_ids) - n_scored, len(fed_ids))
    reference_logits = engine.target.teacher_forced(fed_ids, scored)
    candidate_logits = candidate.teacher_forced(fed_ids, scored)
    kls, agrees = score_positions(reference_logits, candidate_logits)
    return {
        "n_prompt": len(prompt_ids),
        "continuation": continuation,
        "ended_by_eog": ended,
        "kl": kls.tolist(),
        "top1_agree": agrees.tolist(),
    }


def run(engine: Engine, candidate: LlamaModel, prompts: list[dict], args) -> list[dict]:
    records = []
    for index, entry in enumerate(prompts):
        prompt_ids = engine.tokenize_chat([{"role": "user", "content": entry["prompt"]}])
        if len(prompt_ids) + args.max_tokens > engine.target.n_ctx:
            print(f"prompt {index:>2} skipped: {len(prompt_ids)} tokens + --max-tokens exceed n_ctx")
            continue
        record = score_prompt(engine, candidate, prompt_ids, args, seed=args.seed + index)
        records.append({"prompt": index, "category": entry["category"], **record})
        print(
            f"prompt {index:>2} {entry['category']:<14} {len(record['kl']):>4} positions, "
            f"mean KL {statistics.fmean(record['kl']):.4f}"
        )
    return records


def summarize(records: list[dict]) -> dict:
    kls = np.array([kl for r in records for kl in r["kl"]], dtype=np.float64)
    agrees = [agree for r in records for agree in r["top1_agree"]]
    by_category: dict[str, list[float]] = {}
    for r in records:
        by_category.setdefault(r["category"], []).extend(r["kl"])
    return {
        "n_prompts": len(records),
        "n_positions": int(kls.size),
        "kl_mean": float(kls.mean()),
        "kl_median": float(np.median(kls)),
        "kl_p90": float(np.percentile(kls, 90)),
        "top1_agreement_pct": 100.0 * sum(agrees) / len(agrees),
        "kl_mean_by_category": {name: statistics.fmean(values) for name, values in by_category.items()},
    }


def markdown_table(summary: dict) -> str:
    categories = summary["kl_mean_by_category"]
    header = "| prompts scored | positions | mean KL | median KL | p90 KL | top-1 agreement | " + " | ".join(
        f"mean KL {name}" for name in categories
    )
    cells = [
        str(summary["n_prompts"]),
        f"{summary['n_positions']:,}",
        f"{summary['kl_mean']:.4f}",
        f"{summary['kl_median']:.4f}",
        f"{summary['kl_p90']:.4f}",
        f"{summary['top1_agreement_pct']:.1f}%",
        *(f"{value:.4f}" for value in categories.values()),
    ]
    return f"{header} |\n|{'---|' * len(cells)}\n| {' | '.join(cells)} |\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reference", required=True, help="Registered name or GGUF path.")
    parser.add_argument("--candidate", required=True, help="Registered name or GGUF path.")
    parser.add_argument("--prompts", default="bundled", help="'bundled' or a JSONL / text file.")
    parser.add_argument("--per-category", type=int, default=None, help="First N prompts per category.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-ctx", type=int, default=2048, help="Capped at the trained context.")
    parser.add_argument("--out", default="bench-out/quant-kl")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    reference_path, candidate_path = resolve_model_path(args.reference), resolve_model_path(args.candidate)
    check_same_vocabulary(reference_path, candidate_path)
    prompts = select_prompts(args.prompts, args.per_category)
    n_ctx = min(context_size(reference_path, args.n_ctx), context_size(candidate_path, args.n_ctx))
    title = (
        f"KL(reference ‖ candidate) · reference {describe_file(reference_path)} · candidate "
        f"{describe_file(candidate_path)} · {len(prompts)} prompts · up to {args.max_tokens} tokens "
        f"at temperature 1 · seed {args.seed} · {cpu_model_name()}"
    )
    print(title)
    with (
        Engine.load(None, reference_path, n_ctx=n_ctx) as engine,
        LlamaModel(candidate_path, n_ctx=n_ctx) as candidate,
    ):
        records = run(engine, candidate, prompts, args)
    if not records:
        raise SystemExit("error: no prompt fitted the context; lower --max-tokens or raise --n-ctx")
    summary = summarize(records)
    table = markdown_table(summary)
    print(f"\n{title}\n\n{table}")
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    settings = {**vars(args), "reference_path": str(reference_path), "candidate_path": str(candidate_path)}
    result = {"title": title, "settings": settings, "summary": summary, "prompts": records}
    (folder / "quant_kl.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {folder / 'quant_kl.json'}")


if __name__ == "__main__":
    try:
        main()
    except CactusEdgeError as error:  # unknown model, missing file, context too small, …
        raise SystemExit(f"error: {error}") from None
