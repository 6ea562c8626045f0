#!/usr/bin/env python3
"""The acceptance–divergence frontier measured exactly, on the same contexts for every rule.

    .venv/bin/python scripts/frontier_exact.py --pair default --out bench-out/frontier-exact

`cactus-edge bench` compares rules on the texts each rule generates; those texts diverge after a
few tokens, so with a few prompts the acceptance lengths differ as much by text as by rule. Here
every rule is judged on the same positions: one reference reply per bundled prompt, sampled from
the target (plain decoding, the paper's settings, seed = prompt index), is run through both
models once (teacher forcing), and at every reply position, from the processed draft and target
rows, the script computes for each rule
- the exact probability that the draft's token is accepted (`acceptance.acceptance_rate`), and
- the exact KL(out ‖ target) of the token the rule emits there (`acceptance.output_kl`).
From the per-position rates it also gives the expected accepted drafts of a k-token block
started at each reference position (the rates of the next k positions multiplied along the
block). That ranks the rules on equal footing, but it is not the AL `bench` measures: a decoder
starts blocks only after a rejection or a bonus token, on its own text. 95% intervals
come from resampling whole prompts (bootstrap, 2,000 draws). Reference replies are cached in
the output folder, so a rerun with other rules reuses them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cactus_edge.acceptance import acceptance_rate, make_rule, output_kl
from cactus_edge.bench import load_prompts, per_category
from cactus_edge.config import GenerationConfig
from cactus_edge.engine import Engine
from cactus_edge.sampling import SamplingConfig, fit_logits_to_vocab, process_logits, widen_row
from cactus_edge.script_args import engine_from_args, script_parser

SAMPLING = SamplingConfig(temperature=0.6, top_k=20, top_p=0.95)


def reference_replies(engine: Engine, prompts: list[dict], max_tokens: int, cache: Path) -> list[dict]:
    """One reply per prompt sampled from the target: {prompt_tokens, reply_tokens}; cached, and
    reused only for the same prompt text, target file, token limit and sampling settings."""
    key = {"target": Path(str(engine.target.path)).name, "max_tokens": max_tokens, "sampling": repr(SAMPLING)}
    done = {}
    if cache.exists():
        for record in map(json.loads, cache.read_text().splitlines()):
            index = record["prompt"]
            same_prompt = index < len(prompts) and record.get("text") == prompts[index]["prompt"]
            if same_prompt and record.get("key") == key:
                done[index] = record
    for index, entry in enumerate(prompts):
        if index in done:
            continue
        prompt_tokens = engine.tokenize_chat([{"role": "user", "content": entry["prompt"]}])
        config = GenerationConfig(
            method="none", max_tokens=max_tokens, seed=index, temperature=SAMPLING.temperature,
            top_k=SAMPLING.top_k, top_p=SAMPLING.top_p,
        )  # fmt: skip
        reply = engine.generate(prompt_tokens, config)
        done[index] = {
            "prompt": index,
            "text": entry["prompt"],
            "key": key,
            "prompt_tokens": prompt_tokens,
            "reply_tokens": reply.tokens,
        }
        with open(cache, "a") as handle:
            handle.write(json.dumps(done[index]) + "\n")
        print(f"reference {index:>2}: {len(reply.tokens)} tokens", flush=True)
    return [done[index] for index in range(len(prompts))]


def processed_rows(engine: Engine, prompt_tokens: list[int], reply_tokens: list[int]):
    """Draft and target processed rows predicting each reply token: two lists of len(reply)."""
    tokens = prompt_tokens + reply_tokens
    rows = range(len(prompt_tokens) - 1, len(tokens) - 1)
    vocab_size = engine.target.vocab_size
    out = []
    for model in (engine.draft, engine.target):
        logits = fit_logits_to_vocab(model.teacher_forced(tokens, rows), vocab_size)
        processed = process_logits(logits, SAMPLING)
        out.append([widen_row(processed[i], vocab_size) for i in range(len(reply_tokens))])
    return out


def measure(rules: dict, draft_rows: list, target_rows: list) -> dict[str, np.ndarray]:
    """Per rule: (n_positions, 2) array of (acceptance rate, KL(out ‖ target)) per position."""
    return {
        label: np.array(
            [
                (acceptance_rate(rule, draft, target), output_kl(rule, draft, target))
                for draft, target in zip(draft_rows, target_rows, strict=True)
            ]
        )
        for label, rule in rules.items()
    }


def block_acceptance(rates: np.ndarray, k: int) -> np.ndarray:
    """Expected accepted drafts of a k-block started at each position where k positions remain:
    Σ_{i=1..k} Π_{j<i} rate[t + j]."""
    starts = len(rates) - k + 1
    if starts <= 0:
        return np.empty(0)
    survive = np.ones(starts)
    expected = np.zeros(starts)
    for offset in range(k):
        survive = survive * rates[offset : offset + starts]
        expected += survive
    return expected


def _pooled_means(rows: list[np.ndarray], blocks: list[np.ndarray], chosen) -> tuple[float, float, float]:
    """Mean rate, KL and block AL over the positions of the chosen prompts."""
    rates = np.concatenate([rows[i][:, 0] for i in chosen])
    kls = np.concatenate([rows[i][:, 1] for i in chosen])
    block = np.concatenate([blocks[i] for i in chosen])
    return float(rates.mean()), float(kls.mean()), float(block.mean())


def summarize(per_prompt: list[dict[str, np.ndarray]], k: int, rng: np.random.Generator) -> dict:
    """Per rule: mean rate, mean KL per position, expected block AL, each with a 95% interval
    from resampling prompts (the same resamples for every rule)."""
    n = len(per_prompt)
    resamples = [rng.integers(0, n, n) for _ in range(2000)]
    summary = {}
    for label in per_prompt[0]:
        rows = [p[label] for p in per_prompt]
        blocks = [block_acceptance(r[:, 0], k) for r in rows]
        point = _pooled_means(rows, blocks, range(n))
        draws = np.array([_pooled_means(rows, blocks, chosen) for chosen in resamples])
        low, high = np.percentile(draws, [2.5, 97.5], axis=0)
        summary[label] = {
            name: {"mean": point[i], "low": float(low[i]), "high": float(high[i])}
            for i, name in enumerate(("acceptance_rate", "kl_per_position", f"al_k{k}"))
        }
    return summary


def paired_differences(
    per_prompt: list[dict[str, np.ndarray]], summary: dict, rng: np.random.Generator
) -> list:
    """For each typical-acceptance threshold, the Cactus delta with the nearest mean KL, and the
    differences (Cactus − TAS) in acceptance rate and KL per position with 95% intervals from
    resampling prompts: both rules are judged on the same positions, so the pair is resampled
    together and the interval is that of the difference."""
    n = len(per_prompt)
    resamples = [rng.integers(0, n, n) for _ in range(2000)]
    cactus = [label for label in summary if label.startswith("cactus")]
    out = []
    for tas in (label for label in summary if label.startswith("tas")):
        kl = summary[tas]["kl_per_position"]["mean"]
        nearest = min(cactus, key=lambda label: abs(summary[label]["kl_per_position"]["mean"] - kl))
        diffs = [p[nearest] - p[tas] for p in per_prompt]  # same positions, rate and KL columns

        def pooled(chosen, diffs=diffs):
            return np.concatenate([diffs[i] for i in chosen]).mean(axis=0)

        point = pooled(range(n))
        low, high = np.percentile(np.array([pooled(chosen) for chosen in resamples]), [2.5, 97.5], axis=0)
        out.append((tas, nearest, point, low, high))
    return out


def paired_table(differences: list) -> str:
    lines = [
        "| TAS | Cactus (nearest KL) | acceptance rate, Cactus − TAS | KL per position, Cactus − TAS |",
        "|---|---|---|---|",
    ]
    for tas, cactus, point, low, high in differences:
        lines.append(
            f"| {tas} | {cactus} | {point[0]:+.3f} ({low[0]:+.3f} to {high[0]:+.3f}) | "
            f"{point[1]:+.4f} ({low[1]:+.4f} to {high[1]:+.4f}) |"
        )
    return "\n".join(lines) + "\n"


def run(engine: Engine, prompts: list[dict], rules: dict, max_tokens: int, folder: Path) -> list[dict]:
    """Per prompt: measure()'s per-position arrays on that prompt's reference reply."""
    per_prompt = []
    for reply in reference_replies(engine, prompts, max_tokens, folder / "references.jsonl"):
        draft_rows, target_rows = processed_rows(engine, reply["prompt_tokens"], reply["reply_tokens"])
        per_prompt.append(measure(rules, draft_rows, target_rows))
        print(f"measured prompt {reply['prompt']:>2}: {len(target_rows)} positions", flush=True)
    return per_prompt


def make_rules(deltas: list[float], thresholds: list[float]) -> dict:
    rules = {"sps": make_rule("sps", 1.0)}
    rules.update({f"cactus δ={d:g}": make_rule("cactus", d) for d in deltas})
    rules.update({f"tas τ={t:g}": make_rule("tas", 1.0, t) for t in thresholds})
    return rules


def table(summary: dict, k: int) -> str:
    def cell(entry, digits):
        return f"{entry['mean']:.{digits}f} ({entry['low']:.{digits}f}–{entry['high']:.{digits}f})"

    lines = [
        "| rule | acceptance rate per position | KL(out ‖ target) per position, nats | "
        f"expected AL, k = {k} |",
        "|---|---|---|---|",
    ]
    for label, entry in summary.items():
        lines.append(
            f"| {label} | {cell(entry['acceptance_rate'], 3)} | {cell(entry['kl_per_position'], 4)} | "
            f"{cell(entry[f'al_k{k}'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict, k: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4.2))
    for method, name in (("cactus", "Cactus (δ)"), ("tas", "typical acceptance (τ)")):
        points = sorted(
            (e["kl_per_position"]["mean"], e[f"al_k{k}"], label.split(" ", 1)[1])
            for label, e in summary.items()
            if label.startswith(method)
        )
        kls = [p[0] for p in points]
        axis.errorbar(
            kls,
            [p[1]["mean"] for p in points],
            yerr=[
                [p[1]["mean"] - p[1]["low"] for p in points],
                [p[1]["high"] - p[1]["mean"] for p in points],
            ],
            marker="o",
            capsize=3,
            label=name,
        )
        for kl, al, knob in points:
            axis.annotate(
                knob, (kl, al["mean"]), textcoords="offset points", xytext=(5, -11), fontsize="x-small"
            )
    sps = summary["sps"][f"al_k{k}"]["mean"]
    axis.axhline(sps, color="grey", linestyle=":", label="SpS (lossless)")
    axis.set(
        xlabel="KL(output ‖ target) per draft position (nats)",
        ylabel=f"expected accepted drafts per block, k = {k}",
    )
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = script_parser(__doc__, n_ctx=2048)
    parser.add_argument("--per-category", type=int, default=6, help="Prompts per category (6 = all 30).")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--deltas", default="0.1,0.25,0.5,1,2")
    parser.add_argument("--tas-thresholds", default="0.01,0.03,0.09,0.2,0.3")
    parser.add_argument("--out", default="bench-out/frontier-exact")
    args = parser.parse_args()
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    prompts = per_category(load_prompts(), args.per_category)
    rules = make_rules(
        [float(d) for d in args.deltas.split(",")], [float(t) for t in args.tas_thresholds.split(",")]
    )
    with engine_from_args(args) as engine:
        per_prompt = run(engine, prompts, rules, args.max_tokens, folder)
    summary = summarize(per_prompt, args.k, np.random.default_rng(0))
    np.savez_compressed(
        folder / "positions.npz",
        **{f"{label}|{index}": values for index, p in enumerate(per_prompt) for label, values in p.items()},
    )  # (rate, KL) per position, per rule and prompt: for any later analysis
    n_positions = sum(len(next(iter(p.values()))) for p in per_prompt)
    text = (
        f"{len(per_prompt)} prompts, {n_positions} reply positions; temperature {SAMPLING.temperature}, "
        f"top-k {SAMPLING.top_k}, top-p {SAMPLING.top_p}; 95% intervals over prompts\n\n"
        + table(summary, args.k)
        + "\nPaired differences (95% intervals resampling prompts, both rules together):\n\n"
        + paired_table(paired_differences(per_prompt, summary, np.random.default_rng(1)))
    )
    (folder / "frontier.md").write_text(text)
    (folder / "frontier.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.k, folder / "acceptance_vs_kl_exact.png")
    print(text)


if __name__ == "__main__":
    main()
