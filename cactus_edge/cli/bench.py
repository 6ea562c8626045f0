"""Benchmark logic: run method variants interleaved over a prompt set and summarise the numbers.

Interleaving (every variant on prompt 1, then every variant on prompt 2, …) with the same seed per
prompt keeps ratios to plain decoding honest on a noisy machine: a slow minute hits all variants.
"""

from __future__ import annotations

import json
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import DEFAULT_POSTERIOR_THRESHOLD, LOSSLESS_METHODS, GenerationConfig
from ..engine.stats import PROFILE_PARTS, GenerationStats, profile_table
from ..errors import InvalidSettingError
from ..rules.draft_length import CostModel

if TYPE_CHECKING:
    from ..engine.engine import Engine

FENCED_BLOCK = re.compile(r"```[^\n]*\n.*?\n```", re.DOTALL)


@dataclass(frozen=True)
class Variant:
    method: str
    delta: float = 1.0
    n_draft: int | str = "auto"
    drafter: str = "model"
    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD  # typical acceptance only
    kl_budget: float | None = None  # nats per response; lossy rules only, None or inf = no budget
    prediction: bool = False  # the prompt's first fenced code block as a predicted output

    @property
    def budget(self) -> float | None:
        """The KL budget as the engine takes it: None for no budget (inf included, JSON-safe)."""
        return None if self.kl_budget == float("inf") else self.kl_budget

    def config(self, seed: int, **settings) -> GenerationConfig:
        """The generation settings of this variant for one prompt."""
        return GenerationConfig(
            method=self.method,
            delta=self.delta,
            n_draft=self.n_draft,
            drafter=self.drafter,
            posterior_threshold=self.posterior_threshold,
            kl_budget=self.budget,
            seed=seed,
            **settings,
        )

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none"
        name = f"cactus δ={self.delta:g}" if self.method == "cactus" else self.method
        if self.method == "tas" and self.posterior_threshold != DEFAULT_POSTERIOR_THRESHOLD:
            name = f"tas τ={self.posterior_threshold:g}"
        drafter = "" if self.drafter == "model" else f" [{self.drafter}]"
        budget = "" if self.kl_budget is None else f" budget {self.kl_budget:g}"
        prediction = " +prediction" if self.prediction else ""
        return f"{name} k={self.n_draft}{drafter}{budget}{prediction}"


@dataclass(frozen=True)
class TimedRun:
    """One generation as a user waits for it: time to the first token and to the end (ms, wall
    clock from the call, prefill included), when each token arrived, the text and the statistics."""

    text: str
    ttft_ms: float
    total_ms: float
    stats: GenerationStats
    token_ms: tuple[float, ...] = ()  # wall clock from the call to each token's arrival

    def pace(self, n_tokens: int) -> tuple[float, float]:
        """(ms to the first token, ms to token ``n_tokens``) from the call: the same amount of
        work for two replies of different lengths, compared over their common length."""
        return self.token_ms[0], self.token_ms[n_tokens - 1]


def timed_generation(engine: Engine, prompt_tokens: Sequence[int], config: GenerationConfig) -> TimedRun:
    """Run one generation to its end, timing the first token and the whole."""
    start = time.perf_counter()
    arrivals, text = [], []
    for event in engine.stream(prompt_tokens, config):
        if event.token is not None:
            arrivals.append((time.perf_counter() - start) * 1000)
        text.append(event.text)
        if event.finish_reason is not None:
            stats = event.stats
    total_ms = (time.perf_counter() - start) * 1000
    ttft_ms = arrivals[0] if arrivals else total_ms
    return TimedRun("".join(text), ttft_ms, total_ms, stats, tuple(arrivals))


def make_variants(
    methods: Sequence[str],
    deltas: Sequence[float],
    n_drafts: Sequence[int | str],
    drafters: Sequence[str],
    tas_thresholds: Sequence[float] = (DEFAULT_POSTERIOR_THRESHOLD,),
    kl_budgets: Sequence[float | None] = (None,),
    prediction: bool = False,
) -> list[Variant]:
    """`none` once (the baseline), then every other method × draft length × drafter (× delta for
    cactus, × posterior threshold for tas, × KL budget for the lossy rules); with ``prediction``
    each of those twice, without and with the prompt's code as a predicted output."""
    variants = [Variant("none", n_draft=0)]
    for method in methods:
        if method == "none":
            continue
        for n_draft in n_drafts:
            for drafter in drafters:
                for delta in deltas if method == "cactus" else (1.0,):
                    for threshold in tas_thresholds if method == "tas" else (DEFAULT_POSTERIOR_THRESHOLD,):
                        for budget in kl_budgets if method not in LOSSLESS_METHODS else (None,):
                            variants.append(Variant(method, delta, n_draft, drafter, threshold, budget))
    if prediction:
        variants = [*variants, *(replace(v, prediction=True) for v in variants if v.method != "none")]
    return variants


def predicted_output(text: str) -> str | None:
    """The first fenced code block of a prompt, fences included: what an editor sends as the
    predicted output when it asks for a change to that code (None without one)."""
    found = FENCED_BLOCK.search(text)
    return found.group(0) if found else None


def load_prompts(path: str | Path | None = None, categories: Sequence[str] = ()) -> list[dict]:
    """Prompts as dicts with `prompt` and `category`: the bundled set, or a JSONL/plain-text file
    (one prompt per line for plain text). A JSONL entry's `json_schema`, if any, is kept: its
    replies are constrained to it."""
    if path is None:
        text = (resources.files("cactus_edge") / "data" / "prompts.jsonl").read_text()
        suffix = ".jsonl"
    else:
        text, suffix = Path(path).read_text(), Path(path).suffix
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line) if suffix == ".jsonl" else {"prompt": line, "category": "user"}
            prompts.append({"category": entry.get("category", "user"), "prompt": entry["prompt"]})
            if "json_schema" in entry:
                prompts[-1]["json_schema"] = entry["json_schema"]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            message = f"{path}, line {number}: not a JSON object with a 'prompt' ({error})"
            raise InvalidSettingError(message, param="prompts") from error
    if categories:
        prompts = [p for p in prompts if p["category"] in categories]
    if not prompts:
        raise InvalidSettingError("no prompts to run (check --prompts and --category)", param="prompts")
    return prompts


CONVERSATION_CATEGORY = "conversation"
STRUCTURED_CATEGORY = "structured"
# The kinds of structured prompt: fields taken from a given text, a configuration or data object
# written from a description, and a tool call's arguments from a request and a signature.
STRUCTURED_KINDS = ("extraction", "generation", "tool-call")


def load_conversations(categories: Sequence[str] = ()) -> list[dict]:
    """The bundled multi-turn coding conversations ({category, id, language, turns}), unless
    ``categories`` is given without "conversation"."""
    if categories and CONVERSATION_CATEGORY not in categories:
        return []
    text = (resources.files("cactus_edge") / "data" / "conversations.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_structured(categories: Sequence[str] = ()) -> list[dict]:
    """The bundled structured prompts ({category, kind, id, prompt, json_schema}: the reply is
    constrained to the schema), unless ``categories`` is given without "structured"."""
    if categories and STRUCTURED_CATEGORY not in categories:
        return []
    text = (resources.files("cactus_edge") / "data" / "structured.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_workload(path: str | Path | None = None, categories: Sequence[str] = ()) -> list[dict]:
    """What `bench` runs: the prompts (bundled or from ``path``) and, with the bundled set, the
    structured prompts and the coding conversations, filtered by category."""
    bundled_only = [] if path is not None else load_structured(categories) + load_conversations(categories)
    singles = [c for c in categories if c not in (CONVERSATION_CATEGORY, STRUCTURED_CATEGORY)]
    if bundled_only and categories and not singles:
        return bundled_only
    return load_prompts(path, singles) + bundled_only


def per_category(prompts: list[dict], n: int) -> list[dict]:
    """The first n prompts of each category, round-robin (category 1's first, category 2's first,
    …, then the seconds), so a short run still covers every kind of text."""
    categories: dict[str, list[dict]] = {}
    for entry in prompts:
        categories.setdefault(entry["category"], []).append(entry)
    return [group[i] for i in range(n) for group in categories.values() if i < len(group)]


def run_bench(
    engine: Engine,
    prompts: list[dict],
    variants: list[Variant],
    settings: dict,
    *,
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict]:
    """One record per (prompt, turn, variant): the generation's statistics, which prompt, turn and
    variant, and what a user waits for (first token and whole reply, prefill included).

    A prompt is a conversation of one turn or more (``turns``; a plain ``prompt`` is one turn). Each
    (prompt, variant) starts from empty caches and its turns reuse the cached prefix, as a chat
    does: the reply generated for turn i is in the prompt of turn i+1. Each variant keeps its own
    `auto` estimates (costs and acceptance) across the prompts, fresh at the start, as one user
    running one setting would: otherwise an `auto` variant would learn from the variant run just
    before it on the same prompt. The warm-up's estimates are dropped.
    """
    # Warm both models if both are loaded (a lookup-only bench loads no draft model).
    warm = GenerationConfig(
        **{**settings, "max_tokens": 8}, method="sps" if engine.draft else "none", n_draft=2
    )
    engine.chat([{"role": "user", "content": "Hello"}], warm)  # load pages, build graphs
    compiled_ms = compile_constraints(engine, prompts, settings)
    if compiled_ms:
        progress(
            f"grammars: tokenizer index {engine.grammars.tokenizer_ms or 0:.0f} ms; "
            f"{len(compiled_ms)} compiled, median {statistics.median(compiled_ms):.1f} ms, "
            f"max {max(compiled_ms):.1f} ms"
        )
    records = []
    learnt: dict[str, tuple[CostModel, dict]] = {}
    for index, entry in enumerate(prompts):
        for variant in variants:
            engine.use_estimates(*learnt.setdefault(variant.label, (CostModel(), {})))
            for record in run_conversation(engine, index, entry, variant, settings):
                records.append(record)
                progress(
                    f"prompt {record['prompt']!s:>4} {variant.label:<28} "
                    f"{record['tokens_per_second']:6.2f} tok/s  AL {record['acceptance_length']:.2f}  "
                    f"first token {record['ttft_ms']:5.0f} ms"
                )
    return records


def entry_settings(entry: dict, settings: dict) -> dict:
    """The generation settings of a workload entry: ``settings``, constrained to the entry's
    `json_schema` if it has one (for every variant, plain decoding included)."""
    return {**settings, "json_schema": entry["json_schema"]} if "json_schema" in entry else settings


def compile_constraints(engine: Engine, prompts: list[dict], settings: dict) -> list[float]:
    """Compile every entry's schema against the vocabulary before anything is timed (the engine
    caches them): otherwise the first variant to run a schema, plain decoding, would pay for it
    (and for building the grammar tokenizer) in its first-token time. Returns the compile times
    (ms) of the schemas compiled here."""
    constrained = [entry for entry in prompts if "json_schema" in entry]
    if not constrained:
        return []
    cached_before = set(engine.grammars.compile_ms)
    for entry in constrained:
        prompt = engine.tokenize_chat([{"role": "user", "content": turns_of(entry)[0]}])
        # Plain decoding's config: a grammar compiles alike for every method, and a bench of
        # `--methods none` loads no draft model for the default drafter to need.
        engine.check_request(prompt, GenerationConfig(**entry_settings(entry, settings), method="none"))
    return [ms for source, ms in engine.grammars.compile_ms.items() if source not in cached_before]


def plan_line(prompts: Sequence[dict], variants: Sequence, max_tokens: int, ms_per_token: float) -> str:
    """What a bench run is about to do and how long that takes at most at plain decoding's speed
    (``ms_per_token``, measured on this machine), said before it starts."""
    n_replies = sum(len(turns_of(entry)) for entry in prompts) * len(variants)
    minutes = n_replies * max_tokens * ms_per_token / 60_000
    took = f"{minutes:.0f} min" if minutes >= 1 else "under a minute"
    return (
        f"bench: {len(variants)} variants x {len(prompts)} prompts = {n_replies} replies of up to "
        f"{max_tokens} tokens; at plain decoding's {ms_per_token:.0f} ms a token here, up to {took} "
        f"(--limit or --per-category run fewer prompts, --methods fewer variants)"
    )


def turns_of(entry: dict) -> list[str]:
    """The user turns of a workload entry: its ``turns``, or its one ``prompt``."""
    return list(entry["turns"]) if "turns" in entry else [entry["prompt"]]


def converse(engine: Engine, turns: Sequence[str], config_of_turn: Callable[[int], GenerationConfig]):
    """Yield a TimedRun per user turn, each prompted with the conversation so far (the replies
    generated here), so the cached prefix is reused as in a chat."""
    messages: list[dict] = []
    for turn, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        run = timed_generation(engine, engine.tokenize_chat(messages), config_of_turn(turn))
        messages.append({"role": "assistant", "content": run.text})
        yield run


def run_conversation(engine: Engine, index: int, entry: dict, variant: Variant, settings: dict):
    """Yield one record per user turn of ``entry`` under ``variant``, from empty caches; turn t of
    prompt i has seed i + 1000·t (a one-turn prompt keeps seed i)."""
    engine.clear_caches()
    turns = turns_of(entry)
    settings = entry_settings(entry, settings)

    def config_of_turn(turn: int) -> GenerationConfig:
        predicted = predicted_output(turns[turn]) if variant.prediction else None
        return variant.config(seed=index + 1000 * turn, **settings, prediction=predicted)

    runs = converse(engine, turns, config_of_turn)
    for turn, run in enumerate(runs):
        stats = run.stats.summary()
        yield {
            "prompt": index if len(turns) == 1 else f"{index}.{turn}",
            "conversation": index,
            "turn": turn,
            "category": entry["category"],
            "constrained": "json_schema" in settings,
            "variant": variant.label,
            **stats,
            "ttft_ms": run.ttft_ms,
            "wall_ms": run.total_ms,
            "e2e_tokens_per_second": stats["n_tokens"] / (run.total_ms / 1000) if run.total_ms > 0 else 0.0,
            "costs_kept": sorted(engine.costs.kept),  # `auto` started from an earlier run's costs
            "prediction_tokens": list(run.stats.prediction_tokens),  # (accepted, rejected)
        }


def summarize(records: list[dict], variants: list[Variant]) -> dict[str, dict]:
    """Per variant: AL, tokens per verifier call, tok/s, speedup vs `none` on the same prompt
    (median, min, max), per-step milliseconds, KL, acceptance by position, chosen draft lengths."""
    baseline = {r["prompt"]: r["tokens_per_second"] for r in records if r["variant"] == "none"}
    plain = {r["prompt"]: r for r in records if r["variant"] == "none"}
    summary = {}
    for variant in variants:
        runs = [r for r in records if r["variant"] == variant.label]
        if not runs:
            continue
        calls = sum(r["n_verifier_calls"] for r in runs) or 1
        speedups = [r["tokens_per_second"] / baseline[r["prompt"]] for r in runs if baseline.get(r["prompt"])]
        kls = [r["kl_mean"] for r in runs if r["kl_mean"] is not None]
        tried = _sum_lists([r["tried_by_position"] for r in runs])
        accepted = _sum_lists([r["accepted_by_position"] for r in runs])
        histogram: dict[int, int] = {}
        for r in runs:
            for k, count in r["draft_length_histogram"].items():
                histogram[int(k)] = histogram.get(int(k), 0) + count
        summary[variant.label] = {
            "method": variant.method,
            "delta": variant.delta,
            "n_draft": variant.n_draft,
            "drafter": variant.drafter,
            "acceptance_length": sum(r["n_accepted"] for r in runs) / calls,
            "tokens_per_verifier_call": sum(r["n_tokens"] for r in runs) / calls,
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
            "speedup_median": statistics.median(speedups) if speedups else None,
            "speedup_min": min(speedups) if speedups else None,
            "speedup_max": max(speedups) if speedups else None,
            "draft_ms_per_step": sum(r["draft_ms"] for r in runs) / calls,
            "verify_ms_per_step": sum(r["verify_ms"] for r in runs) / calls,
            "overhead_ms_per_step": sum(r["overhead_ms"] for r in runs) / calls,
            "profile_ms": _sum_profiles([r.get("profile_ms", {}) for r in runs]),
            "n_verifier_calls": calls,
            "n_decode_steps": sum(max(r["n_verifier_calls"] - 1, 0) for r in runs),  # what profile_ms covers
            "kl_mean": statistics.mean(kls) if kls else None,
            # The response-level KL spread over every emitted token (plain and bonus tokens add 0).
            "kl_per_token": sum(r.get("kl_total") or 0.0 for r in runs)
            / max(sum(r["n_tokens"] for r in runs), 1),
            "kl_per_response": sum(r.get("kl_total") or 0.0 for r in runs) / len(runs),
            "kl_per_response_max": max(r.get("kl_total") or 0.0 for r in runs),
            "posterior_threshold": variant.posterior_threshold,
            "kl_budget": variant.budget,
            "acceptance_by_position": [a / t if t else None for a, t in zip(accepted, tried, strict=True)],
            "draft_length_histogram": dict(sorted(histogram.items())),
            "mean_draft_length": sum(r["n_drafted"] for r in runs) / calls,
            **_waiting_ratios(runs, plain),
            **_forced_share(runs),
            "prediction": variant.prediction,
            "prediction_accepted": sum(r.get("prediction_tokens", (0, 0))[0] for r in runs),
            "prediction_rejected": sum(r.get("prediction_tokens", (0, 0))[1] for r in runs),
        }
    return summary


def _forced_share(runs: list[dict]) -> dict:
    """Over the replies constrained by a schema: how many, their tokens, the tokens the grammar
    forced (proposed without a draft model, accepted) and their share (None: no such reply)."""
    constrained = [r for r in runs if r.get("constrained")]
    n_tokens = sum(r["n_tokens"] for r in constrained)
    n_forced = sum(r.get("n_forced", 0) for r in constrained)
    return {
        "n_constrained_replies": len(constrained),
        "n_constrained_tokens": n_tokens,
        "n_forced": n_forced,
        "forced_share": n_forced / n_tokens if n_tokens else None,
    }


def _waiting_ratios(runs: list[dict], plain: dict) -> dict:
    """What a user waits for, against plain decoding of the same prompt and turn: the median of
    the per-reply ratios of end-to-end tokens/s (prefill included) and of first-token times, and
    the aggregate end-to-end speedup (all tokens / all wall time, over plain's)."""
    paired = [(r, plain[r["prompt"]]) for r in runs if "wall_ms" in r and r["prompt"] in plain]
    if not paired:
        return {"e2e_speedup_median": None, "e2e_speedup_aggregate": None, "ttft_ratio_median": None}
    e2e = [r["e2e_tokens_per_second"] / base["e2e_tokens_per_second"] for r, base in paired]
    ttft = [r["ttft_ms"] / base["ttft_ms"] for r, base in paired if base["ttft_ms"] > 0]

    def rate(rows):
        return sum(r["n_tokens"] for r in rows) / max(sum(r["wall_ms"] for r in rows), 1e-9)

    return {
        "e2e_speedup_median": statistics.median(e2e),
        "e2e_speedup_aggregate": rate([r for r, _ in paired]) / max(rate([b for _, b in paired]), 1e-12),
        "ttft_ratio_median": statistics.median(ttft) if ttft else None,
    }


# In memory-bound decoding (GPUs, Apple Silicon) a forward pass costs about the time to read the
# weights, so verifying a few tokens costs about one token; 1.1 leaves room for the attention and
# logits work that does grow with the batch.
MEMORY_BOUND_VERIFY_RATIO = 1.1


def project_memory_bound(summary: dict[str, dict], draft_cost_ratio: float) -> None:
    """Add the speedup each variant's measured acceptance would give where verification is
    memory-bound:  tokens per verifier call / (mean drafted tokens per step × c + v),
    c = draft/target cost of one token (≈ the ratio of their weight bytes), v = verify/decode cost."""
    for entry in summary.values():
        drafted = entry["mean_draft_length"] if entry["drafter"] != "lookup" else 0.0
        entry["projected_speedup_memory_bound"] = entry["tokens_per_verifier_call"] / (
            drafted * draft_cost_ratio + (MEMORY_BOUND_VERIFY_RATIO if entry["method"] != "none" else 1.0)
        )


def _sum_profiles(profiles: list[dict[str, float]]) -> dict[str, float]:
    return {part: sum(profile.get(part, 0.0) for profile in profiles) for part in PROFILE_PARTS}


def _sum_lists(lists: list[list[int]]) -> list[int]:
    width = max((len(values) for values in lists), default=0)
    return [sum(values[i] for values in lists if i < len(values)) for i in range(width)]


def markdown_table(summary: dict[str, dict]) -> str:
    header = (
        "| method | AL (accepted drafts / verifier call) | tokens / verifier call | tok/s (median) | "
        "speedup vs none: median (min–max) | draft / verify / overhead ms per step | mean KL | "
        "KL per response: mean (max) | draft lengths | projected speedup, memory-bound | "
        "end to end vs none: median (aggregate) | first token vs none |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for label, s in summary.items():
        speedup = (
            f"{s['speedup_median']:.2f} ({s['speedup_min']:.2f}–{s['speedup_max']:.2f})"
            if s["speedup_median"] is not None
            else "–"
        )
        kl = f"{s['kl_mean']:.4f}" if s["kl_mean"] is not None else "–"
        per_response = (
            f"{s['kl_per_response']:.2f} ({s['kl_per_response_max']:.2f})"
            if s["kl_mean"] is not None
            else "–"
        )
        lengths = ", ".join(f"{k}: {n}" for k, n in s["draft_length_histogram"].items())
        projected = s.get("projected_speedup_memory_bound")
        projected = f"{projected:.2f}" if projected is not None else "–"
        lines.append(
            f"| {label} | {s['acceptance_length']:.2f} | {s['tokens_per_verifier_call']:.2f} | "
            f"{s['tokens_per_second']:.2f} | {speedup} | {s['draft_ms_per_step']:.0f} / "
            f"{s['verify_ms_per_step']:.0f} / {s['overhead_ms_per_step']:.1f} | {kl} | {per_response} | "
            f"{lengths} | {projected} | {_waiting_cells(s)} |"
        )
    return header + "\n".join(lines) + "\n"


def prediction_table(summary: dict[str, dict]) -> str:
    """Draft tokens proposed from the predicted outputs, accepted and rejected, per variant that
    had them, as markdown; empty when none did."""
    rows = [(label, s) for label, s in summary.items() if s.get("prediction")]
    if not rows:
        return ""
    lines = [
        "\nPredicted outputs (the prompt's code block): draft tokens proposed from the prediction\n",
        "| method | accepted | rejected | acceptance |",
        "|---|---|---|---|",
    ]
    for label, s in rows:
        proposed = s["prediction_accepted"] + s["prediction_rejected"]
        share = f"{s['prediction_accepted'] / proposed:.0%}" if proposed else "–"
        lines.append(f"| {label} | {s['prediction_accepted']} | {s['prediction_rejected']} | {share} |")
    return "\n".join(lines) + "\n"


def forced_tokens_table(summary: dict[str, dict]) -> str:
    """The share of forced tokens per variant over the replies constrained by a schema (the
    structured category), as markdown; empty when no reply was constrained."""
    rows = [(label, s) for label, s in summary.items() if s.get("n_constrained_replies")]
    if not rows:
        return ""
    lines = [
        "\nReplies constrained by a JSON schema: tokens the grammar forced (proposed without a draft "
        "model and accepted; plain decoding drafts nothing, so it counts none)\n",
        "| method | constrained replies | tokens | forced tokens | forced share |",
        "|---|---|---|---|---|",
    ]
    for label, s in rows:
        lines.append(
            f"| {label} | {s['n_constrained_replies']} | {s['n_constrained_tokens']} | {s['n_forced']} | "
            f"{100 * s['forced_share']:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def _waiting_cells(entry: dict) -> str:
    """The two end-to-end cells of a markdown row ("–" where nothing was timed)."""
    if entry.get("e2e_speedup_median") is None:
        return "– | –"
    ttft = entry["ttft_ratio_median"]
    ttft = f"{ttft:.2f}" if ttft is not None else "–"
    return f"{entry['e2e_speedup_median']:.2f} ({entry['e2e_speedup_aggregate']:.2f}) | {ttft}"


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
        1024**2 if sys.platform == "darwin" else 1024
    )


def select_prompts(
    path, categories: Sequence[str], n_per_category: int | None, limit: int | None
) -> list[dict]:
    """The bench's prompts: a file's or the bundled set, by category, round-robin, the first N."""
    prompts = load_workload(path, categories)
    if n_per_category:
        prompts = per_category(prompts, n_per_category)
    return prompts[:limit]


def weight_ratio(engine: Engine) -> float:
    """Draft/target weight bytes: what a draft token costs on memory-bound hardware (0: no draft)."""
    if engine.draft is None:
        return 0.0
    return engine.draft.path.stat().st_size / engine.target.path.stat().st_size


def report(
    summary: dict[str, dict],
    records: list[dict],
    costs: dict,
    title: str,
    draft_cost_ratio: float,
    profile: bool,
) -> str:
    """bench.md: the title, a row per variant, forced tokens, the costs measured here and the
    memory-bound projection; with ``profile`` where each variant's step time went."""
    curve = ", ".join(f"{n}: {ms:.0f}" for n, ms in costs["verify_ms"].items())
    draft_ms = f"{costs['draft_ms']:.0f} ms" if costs["draft_ms"] is not None else "no draft model"
    footer = (
        f"\nMeasured here: verify ms by batch size {{{curve}}}; one draft token {draft_ms}.\n"
        f"Projection (memory-bound hardware): tokens per verifier call / (mean drafted tokens per step x "
        f"c + v), c = {draft_cost_ratio:.2f} (draft/target weight bytes), v = {MEMORY_BOUND_VERIFY_RATIO}.\n"
    )
    kept = sorted({r["variant"] for r in records if r.get("costs_kept")})
    if kept:
        footer += (
            f"`auto` started from batch costs the cost cache kept (measured by an earlier engine, not "
            f"in its own first reply) for: {', '.join(kept)}; CACTUS_EDGE_COST_CACHE=off measures them.\n"
        )
    table = (
        title + markdown_table(summary) + forced_tokens_table(summary) + prediction_table(summary) + footer
    )
    if profile:
        table += "".join(
            "\n" + profile_table(s["profile_ms"], s["n_decode_steps"], f"{label}: ") + "\n"
            for label, s in summary.items()
        )
    return table


def write_results(
    folder: Path, table: str, summary: dict, settings: dict, costs: dict, records: list[dict], progress
) -> None:
    """bench.md, the plots (with the `plots` extra) and bench.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.md").write_text(table)
    try:
        from .plots import plot_bench

        for path in plot_bench(summary, folder):
            progress(f"wrote {path}")
    except ImportError:
        progress("no plots: pip install 'cactus-edge[plots]'")
    data = {"settings": settings, "summary": summary, "costs": costs, "runs": records}
    (folder / "bench.json").write_text(json.dumps(data, indent=2))


@dataclass(frozen=True)
class EqualWork:
    """Two replies to one prompt compared over the tokens both wrote: the first ``n_tokens`` of
    each, so that a shorter reply is not counted as faster for writing less."""

    n_tokens: int
    speed: float  # tokens/s after the first token, ours ÷ plain
    first_token: float  # time to the first token, ours ÷ plain
    end_to_end: float  # how many times faster ours reached token n_tokens, call included

    def line(self, plain_tokens: int, our_tokens: int) -> str:
        return (
            f"these settings vs plain over the first {self.n_tokens} tokens of each reply "
            f"(plain wrote {plain_tokens}, these settings {our_tokens}): {self.speed:.2f}x tokens/s, "
            f"first token {self.first_token:.2f}x, end to end {self.end_to_end:.2f}x faster"
        )


def equal_work(plain: TimedRun, ours: TimedRun) -> EqualWork:
    """Compare two runs over their common length (see :class:`EqualWork`)."""
    n_tokens = min(len(plain.token_ms), len(ours.token_ms))
    if n_tokens < 2:
        raise ValueError("a comparison needs two tokens from each reply")
    (plain_first, plain_last), (our_first, our_last) = plain.pace(n_tokens), ours.pace(n_tokens)
    return EqualWork(
        n_tokens=n_tokens,
        speed=(plain_last - plain_first) / max(our_last - our_first, 1e-9),
        first_token=our_first / max(plain_first, 1e-9),
        end_to_end=plain_last / max(our_last, 1e-9),
    )


NOISE = 0.05  # ratios within this of 1 are inside the spread between runs on our machines


def comparison_verdict(speed: float, stats: GenerationStats, costs: CostModel) -> str:
    """What `generate --compare` measured, in words: whether speculation paid on this machine,
    and why, from the reply's share of drafted tokens and this machine's measured batch costs."""
    drafted = stats.n_accepted / max(stats.n_tokens, 1)
    share = f"{drafted:.0%} of the reply came from accepted drafts"
    if speed >= 1 + NOISE:
        return f"speculation paid here: {share}."
    costs_said = ""
    if costs.verify:
        one = costs.verify_ms(1)
        costs_said = f" Here a batch of 2 tokens costs {costs.verify_ms(2) / one:.2f}x one"
        if costs.draft:
            costs_said += f" and a draft token {costs.draft(1) / one:.2f}x one"
        costs_said += ", so a draft must be accepted nearly every time to pay."
    off = (
        " The draft model cannot pay on this machine, so the defaults drafted by lookup alone."
        if stats.draft_model_off
        else ""
    )
    return (
        f"speculation did not pay here ({speed:.2f}x; within {NOISE:.0%} of 1 is the spread between runs): "
        f"{share}.{costs_said}{off} Where verifying a few tokens costs about one (a GPU), the same "
        "acceptance pays more."
    )
