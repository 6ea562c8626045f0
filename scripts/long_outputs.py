"""Long outputs: do lossy acceptance rules make responses loop?

    .venv/bin/python scripts/long_outputs.py --pair default --out bench-out/long

1,024-token replies (chat template, the paper's sampling settings, a fixed draft length so the
lossy rules really decide drafts) to the bundled explanation and step-by-step math prompts, for
SpS (the target's own distribution), typical acceptance, Cactus δ = 1, and Cactus δ = 1 with a KL
budget per response. For each method: the share of degenerate responses (the final quarter holds
a span of ≥ 8 tokens repeated ≥ 3 times in a row, cactus_edge.quality), the share that hit the
token limit, the distinct-4-gram ratio, AL and KL per token. Results go to a resumable JSONL
(one line per prompt × method) and a Markdown table next to it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from cactus_edge.bench import load_prompts
from cactus_edge.config import GenerationConfig
from cactus_edge.engine import Engine
from cactus_edge.quality import distinct_ngram_ratio, is_degenerate
from cactus_edge.script_args import engine_from_args, script_parser

CATEGORIES = ("explanation", "math")


def variants(n_draft: int, budget: float) -> dict[str, dict]:
    return {
        "sps": {"method": "sps"},
        "tas": {"method": "tas"},
        "cactus δ=1": {"method": "cactus", "delta": 1.0},
        f"cactus δ=1, budget {budget:g}": {"method": "cactus", "delta": 1.0, "kl_budget": budget},
    }  # insertion order is the table's order


def run(engine: Engine, prompts: list[dict], settings: dict[str, dict], args, out: Path) -> None:
    done = set()
    if out.exists():
        done = {(r["prompt"], r["variant"]) for r in map(json.loads, out.read_text().splitlines()) if r}
    for index, entry in enumerate(prompts):
        for label, changes in settings.items():
            if (index, label) in done:
                continue
            config = GenerationConfig(
                **changes, n_draft=args.n_draft, max_tokens=args.max_tokens, seed=index, drafter="model"
            )
            engine.clear_caches()  # resumable: a reply must not depend on what ran before it
            result = engine.chat([{"role": "user", "content": entry["prompt"]}], config)
            record = {
                "prompt": index,
                "variant": label,
                "n_tokens": len(result.tokens),
                "finish_reason": result.finish_reason,
                "degenerate": is_degenerate(result.tokens),
                "distinct_4": distinct_ngram_ratio(result.tokens, 4),
                "acceptance_length": result.stats.acceptance_length,
                "kl_total": result.stats.kl_total,
                "text": result.text,
            }
            with open(out, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            print(
                f"prompt {index:>2} {label:<26} {record['n_tokens']:>5} tokens, "
                f"degenerate: {record['degenerate']}"
            )


def report(out: Path, labels: list[str]) -> str:
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    lines = [
        "| method | responses | degenerate | hit the limit | distinct-4 (mean) | tokens (mean) | AL "
        "| KL per token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        rows = [r for r in records if r["variant"] == label]
        if not rows:
            continue
        tokens = sum(r["n_tokens"] for r in rows)
        lines.append(
            f"| {label} | {len(rows)} | {sum(r['degenerate'] for r in rows)} | "
            f"{sum(r['finish_reason'] == 'length' for r in rows)} | "
            f"{statistics.mean(r['distinct_4'] for r in rows if r['distinct_4'] is not None):.3f} | "
            f"{tokens / len(rows):.0f} | {statistics.mean(r['acceptance_length'] for r in rows):.2f} | "
            f"{sum(r['kl_total'] for r in rows) / max(tokens, 1):.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = script_parser(__doc__, n_ctx=2048)
    parser.add_argument("--n-draft", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--kl-budget", type=float, default=4.0)
    parser.add_argument("--limit", type=int, default=None, help="First N prompts only.")
    parser.add_argument("--out", default="bench-out/long")
    args = parser.parse_args()
    prompts = load_prompts(None, CATEGORIES)[: args.limit]
    settings = variants(args.n_draft, args.kl_budget)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "long_outputs.jsonl"
    with engine_from_args(args, n_ctx=max(args.n_ctx, args.max_tokens + 512)) as engine:
        run(engine, prompts, settings, args, out)
    table = report(out, list(settings))
    (folder / "long_outputs.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
