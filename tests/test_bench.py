"""Benchmark logic: variants, prompt loading, interleaving and the summary arithmetic."""

import json

import pytest
from click.testing import CliRunner

from cactus_edge.cli.bench import Variant, load_prompts, make_variants, markdown_table, summarize
from cactus_edge.cli.main import main


def test_variants_put_the_baseline_first_and_cross_the_lists():
    variants = make_variants(["none", "sps", "cactus"], [0.5, 1.0], [4, "auto"], ["model", "lookup"])
    assert variants[0] == Variant("none", n_draft=0)
    assert len(variants) == 1 + 2 * 2 * (1 + 2)
    assert {v.label for v in variants} >= {"sps k=4", "cactus δ=0.5 k=auto [lookup]"}


def test_bundled_prompts_cover_five_categories(tmp_path):
    prompts = load_prompts()
    assert len(prompts) == 30
    categories = {p["category"] for p in prompts}
    assert categories == {"code-writing", "code-editing", "explanation", "chat", "math"}
    editing = load_prompts(categories=["code-editing"])
    assert editing and all("```" in p["prompt"] for p in editing)
    text_file = tmp_path / "mine.txt"
    text_file.write_text("first prompt\n\nsecond prompt\n")
    assert [p["prompt"] for p in load_prompts(text_file)] == ["first prompt", "second prompt"]
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(categories=["poetry"])


def record(prompt, variant, tps, calls, tokens, accepted, kl=None, hist=None):
    return {
        "n_drafted": 4 * calls if variant != "none" else 0,
        "prompt": prompt,
        "category": "x",
        "variant": variant,
        "tokens_per_second": tps,
        "n_verifier_calls": calls,
        "n_tokens": tokens,
        "n_accepted": accepted,
        "draft_ms": 10.0 * calls,
        "verify_ms": 20.0 * calls,
        "overhead_ms": 1.0 * calls,
        "kl_mean": kl,
        "tried_by_position": [calls, calls // 2],
        "accepted_by_position": [calls // 2, calls // 4],
        "draft_length_histogram": hist or {4: calls},
    }


def test_summary_speedups_are_per_prompt_ratios_to_none():
    variants = [Variant("none", n_draft=0), Variant("sps", n_draft=4)]
    records = [
        record(0, "none", 10.0, 20, 20, 0, hist={0: 20}),
        record(1, "none", 20.0, 20, 20, 0, hist={0: 20}),
        record(0, "sps k=4", 15.0, 8, 24, 16),
        record(1, "sps k=4", 10.0, 8, 24, 16),
    ]
    summary = summarize(records, variants)
    sps = summary["sps k=4"]
    assert sps["speedup_min"] == pytest.approx(0.5) and sps["speedup_max"] == pytest.approx(1.5)
    assert sps["speedup_median"] == pytest.approx(1.0)
    assert sps["acceptance_length"] == pytest.approx(2.0)
    assert sps["tokens_per_verifier_call"] == pytest.approx(3.0)
    assert sps["acceptance_by_position"] == [pytest.approx(0.5), pytest.approx(0.5)]
    assert sps["draft_length_histogram"] == {4: 16}
    table = markdown_table(summary)
    assert "| sps k=4 | 2.00 | 3.00 | 12.50 | 1.00 (0.50–1.50) |" in table


def run_bench_command(tiny_args, out, *flags) -> dict:
    """`cactus-edge bench` on the tiny pair; its bench.json, and its stderr under "stderr"."""
    result = CliRunner().invoke(main, ["bench", *tiny_args, *flags, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return {**json.loads((out / "bench.json").read_text()), "stderr": result.stderr}


def test_the_plan_counts_every_reply_and_bounds_the_time():
    from cactus_edge.cli.bench import plan_line

    prompts = [{"prompt": "a", "category": "x"}, {"turns": ["b", "c", "d"], "category": "y"}]
    line = plan_line(prompts, ["v1", "v2", "v3"], max_tokens=200, ms_per_token=50.0)
    # (1 + 3) turns x 3 variants = 12 replies; 12 x 200 tokens x 50 ms = 120 s = 2 min.
    assert line.startswith("bench: 3 variants x 2 prompts = 12 replies of up to 200 tokens;")
    assert "50 ms a token here, up to 2 min" in line
    assert "under a minute" in plan_line(prompts[:1], ["v"], max_tokens=10, ms_per_token=5.0)


def test_bench_command_on_the_tiny_pair(tiny_args, tmp_path):
    out = tmp_path / "out"
    data = run_bench_command(
        tiny_args,
        out,
        *["--methods", "none,sps,cactus", "--deltas", "0.5", "--n-draft", "3"],
        *["--limit", "2", "--max-tokens", "12"],
    )
    labels = ["none", "sps k=3 [model+lookup]", "cactus δ=0.5 k=3 [model+lookup]"]  # the default drafter
    assert data["stderr"].startswith("bench: 3 variants x 2 prompts = 6 replies of up to 12 tokens;")
    assert [r["variant"] for r in data["runs"]] == labels * 2
    assert [r["prompt"] for r in data["runs"]] == [0, 0, 0, 1, 1, 1]  # interleaved
    assert set(data["summary"]) == set(labels)
    assert all(r["ttft_ms"] > 0 and r["wall_ms"] >= r["ttft_ms"] for r in data["runs"])
    assert "| none |" in (out / "bench.md").read_text()
    for plot in ("acceptance_vs_delta.png", "acceptance_by_position.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG")


def test_per_category_takes_the_first_of_each_round_robin():
    prompts = [{"category": c, "prompt": f"{c}{i}"} for c in ("a", "b", "c") for i in range(3)]
    from cactus_edge.cli.bench import per_category

    assert [p["prompt"] for p in per_category(prompts, 2)] == ["a0", "b0", "c0", "a1", "b1", "c1"]
    config = Variant("cactus", 0.5, "auto", "lookup").config(seed=3, max_tokens=9)
    assert (config.method, config.delta, config.n_draft, config.drafter, config.seed) == (
        "cactus",
        0.5,
        "auto",
        "lookup",
        3,
    )


def test_lookup_only_bench_loads_no_draft_model(tiny_args, tmp_path):
    data = run_bench_command(
        tiny_args,
        tmp_path,
        *["--methods", "none,sps", "--n-draft", "3", "--drafters", "lookup"],
        *["--limit", "1", "--max-tokens", "8"],
    )
    assert set(data["summary"]) == {"none", "sps k=3 [lookup]"}


def test_each_variant_keeps_its_own_auto_estimates():
    """An `auto` variant must not learn from the variant run before it on the same prompt: each
    variant sees its own costs and acceptance rates, the same ones on every prompt."""
    from cactus_edge.cli.bench import run_bench
    from cactus_edge.engine.events import GenerationResult, StreamEvent
    from cactus_edge.engine.stats import GenerationStats

    class RecordingEngine:
        draft = object()

        def __init__(self):
            self.costs, self.acceptance, self.seen = None, None, []

        def chat(self, messages, config):  # the warm-up
            self.seen.append((config.n_draft, id(self.costs), id(self.acceptance)))
            stats = GenerationStats(method=config.method, n_tokens=1, decode_ms=1.0)
            return GenerationResult("x", [1], "length", stats)

        def clear_caches(self):
            pass

        def use_estimates(self, costs, acceptance):
            self.costs, self.acceptance = costs, acceptance

        def tokenize_chat(self, messages):
            return [1, 2]

        def stream(self, prompt_tokens, config):
            self.seen.append((config.n_draft, id(self.costs), id(self.acceptance)))
            self.acceptance = {**(self.acceptance or {}), "learnt": config.n_draft}  # what a run learns
            stats = GenerationStats(method=config.method, n_tokens=1, decode_ms=1.0)
            yield StreamEvent("x", 1)
            yield StreamEvent("", None, finish_reason="length", stats=stats)

    engine = RecordingEngine()
    prompts = [{"prompt": "a", "category": "c"}, {"prompt": "b", "category": "c"}]
    variants = make_variants(["sps"], [], [4, "auto"], ["model"])
    run_bench(engine, prompts, variants, {"max_tokens": 4})
    runs = engine.seen[1:]  # after the warm-up
    by_variant = {}
    for n_draft, costs, _ in runs:
        by_variant.setdefault(n_draft, set()).add(costs)
    assert len(by_variant[4]) == 1 and len(by_variant["auto"]) == 1
    assert by_variant[4] != by_variant["auto"]


def test_typical_acceptance_thresholds_make_one_variant_each():
    variants = make_variants(["tas", "cactus"], [1.0], [8], ["model"], tas_thresholds=[0.05, 0.09, 0.3])
    labels = [v.label for v in variants]
    assert labels == ["none", "tas τ=0.05 k=8", "tas k=8", "tas τ=0.3 k=8", "cactus δ=1 k=8"]
    assert variants[3].config(seed=0).rule.posterior_threshold == 0.3


def test_the_frontier_plot_needs_two_points_of_a_lossy_rule(tmp_path):
    pytest.importorskip("matplotlib")
    from cactus_edge.cli.plots import plot_frontier

    def entry(method, al, kl, delta=1.0, threshold=0.09):
        return {
            "method": method,
            "drafter": "model",
            "n_draft": 8,
            "acceptance_length": al,
            "kl_per_token": kl,
            "delta": delta,
            "posterior_threshold": threshold,
        }

    one = {"sps": entry("sps", 3.0, 0.0), "c1": entry("cactus", 4.0, 0.05)}
    assert plot_frontier(one, tmp_path) is None
    two = {**one, "c2": entry("cactus", 4.5, 0.09, delta=2.0), "t1": entry("tas", 4.1, 0.1, threshold=0.05)}
    path = plot_frontier(two, tmp_path)
    assert path == tmp_path / "acceptance_vs_kl.png" and path.stat().st_size > 0


def test_kl_budgets_make_one_variant_each_for_lossy_rules_only():
    variants = make_variants(["sps", "cactus"], [1.0], [4], ["model"], kl_budgets=[0.0, 2.0, float("inf")])
    labels = [v.label for v in variants]
    assert labels == [
        "none",
        "sps k=4",
        "cactus δ=1 k=4 budget 0",
        "cactus δ=1 k=4 budget 2",
        "cactus δ=1 k=4 budget inf",
    ]
    assert variants[3].config(seed=0).kl_budget == 2.0
    assert type(variants[3].config(seed=0).rule).__name__ == "KLBudgetRule"
    assert variants[1].config(seed=0).kl_budget is None  # a lossless rule spends nothing
    unlimited = variants[4].config(seed=0)  # inf is no budget: the plain rule, JSON-safe None
    assert unlimited.kl_budget is None and type(unlimited.rule).__name__ == "Cactus"


def test_summary_reports_kl_per_response():
    variants = [Variant("none", n_draft=0), Variant("cactus", n_draft=4, kl_budget=1.0)]
    label = variants[1].label
    records = [record(0, "none", 10.0, 20, 20, 0, hist={0: 20})]
    records += [
        {**record(p, label, 12.0, 8, 24, 16, kl=0.1), "kl_total": total} for p, total in ((0, 0.4), (1, 0.8))
    ]
    summary = summarize(records, variants)[label]
    assert summary["kl_per_response"] == pytest.approx(0.6) and summary["kl_per_response_max"] == 0.8
    assert summary["kl_budget"] == 1.0
    assert f"| {label} |" in markdown_table({label: summary}) and "| 0.60 (0.80) |" in markdown_table(
        {label: summary}
    )


def test_bench_rejects_a_negative_kl_budget(tiny_args):
    result = CliRunner().invoke(main, ["bench", *tiny_args, "--kl-budgets", "1,-2"])
    assert result.exit_code == 2 and "--kl-budgets" in result.output and "-2" in result.output


def test_budgeted_variants_stay_off_the_frontier(tmp_path):
    pytest.importorskip("matplotlib")
    from cactus_edge.cli.plots import plot_frontier

    def entry(al, kl, budget):
        return {
            "method": "cactus",
            "drafter": "model",
            "n_draft": 8,
            "acceptance_length": al,
            "kl_per_token": kl,
            "delta": 1.0,
            "posterior_threshold": 0.09,
            "kl_budget": budget,
        }

    assert plot_frontier({"a": entry(4.0, 0.05, None), "b": entry(3.5, 0.01, 0.5)}, tmp_path) is None
    assert plot_frontier({"a": entry(4.0, 0.05, None), "b": entry(3.5, 0.01, None)}, tmp_path) is not None
    unlimited = Variant("cactus", n_draft=8, kl_budget=float("inf"))
    record_inf = {**record(0, unlimited.label, 9.0, 8, 24, 16, kl=0.1), "kl_total": 0.5}
    assert summarize([record_inf], [unlimited])[unlimited.label]["kl_budget"] is None  # on the frontier


def test_the_bundled_coding_conversations():
    from cactus_edge.cli.bench import load_conversations, load_structured, load_workload

    conversations = load_conversations()
    assert len(conversations) >= 8 and len({c["language"] for c in conversations}) >= 3
    assert sum(len(c["turns"]) > 1 for c in conversations) >= 6  # multi-turn
    assert any("explain" in turn.lower() for c in conversations for turn in c["turns"][:-1])
    for conversation in conversations:  # the last turn changes code already in the conversation
        last = conversation["turns"][-1].lower()
        assert any(word in last for word in ("change", "rewrite", "fix", "rename", "add")), last
        code_before = "```" in "".join(conversation["turns"][:-1]) or "```" in last
        assert code_before or any(w in conversation["turns"][0].lower() for w in ("write",))
    assert load_workload(categories=["conversation"]) == conversations
    assert {e["category"] for e in load_workload(categories=["math"])} == {"math"}
    assert len(load_workload()) == len(load_prompts()) + len(load_structured()) + len(conversations)


def test_a_conversation_reuses_its_cached_prefix_across_turns(tiny_pair):
    from cactus_edge.cli.bench import run_conversation
    from cactus_edge.engine.engine import Engine

    entry = {"category": "conversation", "turns": ["the code is", "and the water is"]}
    variant = Variant("sps", n_draft=3, drafter="model+lookup")
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512) as engine:
        engine.generate("the water is hot", variant.config(seed=0, max_tokens=4))  # stale caches
        first, second = run_conversation(engine, 5, entry, variant, {"max_tokens": 8, "temperature": 0.0})
        n_first_prompt = len(engine.tokenize_chat([{"role": "user", "content": "the code is"}]))
    assert (first["prompt"], second["prompt"], first["turn"], second["turn"]) == ("5.0", "5.1", 0, 1)
    assert first["n_prompt_decoded"] == n_first_prompt == first["n_prompt_tokens"]  # from empty caches
    # Turn two decodes only what follows the first turn's prompt and reply.
    assert second["n_prompt_decoded"] < second["n_prompt_tokens"] - n_first_prompt
    assert 0 < first["ttft_ms"] <= first["wall_ms"]


def test_bench_says_when_auto_started_from_costs_kept_by_an_earlier_run(tiny_args, tmp_path, monkeypatch):
    from cactus_edge.engine import calibration
    from cactus_edge.engine.cost_cache import COST_CACHE_ENV

    monkeypatch.setenv(COST_CACHE_ENV, str(tmp_path / "costs"))
    # The tiny models decode in ~0.1 ms, too noisy for the kept table's drift check (tested apart).
    monkeypatch.setattr(calibration, "still_holds", lambda kept, fresh: True)
    flags = [*["--methods", "none,cactus", "--deltas", "1", "--n-draft", "auto"], *["--limit", "1"]]
    flags += ["--max-tokens", "6"]
    runs = {}
    for name in ("first", "second"):
        data = run_bench_command(tiny_args, tmp_path / name, *flags)
        runs[name] = {r["variant"]: r["costs_kept"] for r in data["runs"]}
    auto = "cactus δ=1 k=auto [model+lookup]"
    assert runs["first"] == {"none": [], auto: []}
    assert runs["second"] == {"none": [], auto: ["draft", "target"]}
    assert "the cost cache kept" not in (tmp_path / "first" / "bench.md").read_text()
    assert f"not in its own first reply) for: {auto};" in (tmp_path / "second" / "bench.md").read_text()


# --- the structured category: prompts whose replies a JSON schema constrains ----------------------

# A right answer to each bundled structured prompt, keys in schema order (llguidance writes an
# object's properties in the order its schema lists them), optional fields both used and left out.
EXAMPLE_ANSWERS = {
    "invoice": {
        "invoice_number": "INV-2041",
        "issue_date": "2026-03-14",
        "seller": {"name": "Northwind Supplies Ltd", "email": "billing@northwind.example"},
        "buyer": {"name": "Bluebird Cafe"},
        "currency": "EUR",
        "line_items": [
            {"description": "house-blend coffee beans", "quantity": 3, "unit_price": 18.5},
            {"description": "paper filters", "quantity": 2, "unit_price": 4.25},
            {"description": "milk frother", "quantity": 1, "unit_price": 39.99},
        ],
        "tax_rate_percent": 7,
        "paid": True,
        "notes": "paid in full by card",
    },
    "person": {
        "name": "Priya Raman",
        "role": "backend engineer",
        "seniority": "senior",
        "years_of_experience": 9,
        "company": "Lumen Analytics",
        "email": "priya.raman@lumen.example",
        "languages": ["Go", "Python", "Rust"],
        "remote": True,
        "location": {"city": "Lisbon", "country": "Portugal"},
    },
    "bug-report": {
        "title": "CSV export crashes on cells containing a newline",
        "component": "exporter",
        "severity": "high",
        "regression": True,
        "users_affected": 40,
        "affected_version": "2.4.0",
        "last_working_version": "2.3.1",
        "steps_to_reproduce": ["Create a project", "Add a note with two lines", "Click Export > CSV"],
        "expected": "A CSV file with the note quoted",
        "actual": "UnicodeEncodeError, nothing written",
        "environment": {"os": "Windows 11", "python_version": "3.12"},
        "workaround": "Remove the newlines before exporting",
    },
    "compose-services": {
        "project": "webapp",
        "production": False,
        "services": [
            {
                "name": "api",
                "build": "./api",
                "ports": [{"host": 8000, "container": 8000}],
                "environment": [
                    {"name": "DATABASE_URL", "value": "postgresql://app:app@db:5432/app"},
                    {"name": "REDIS_URL", "value": "redis://cache:6379/0"},
                ],
                "depends_on": ["db", "cache"],
                "restart": "unless-stopped",
            },
            {
                "name": "db",
                "image": "postgres:16",
                "ports": [],
                "environment": [{"name": "POSTGRES_PASSWORD", "value": "app"}],
                "depends_on": [],
                "restart": "always",
                "healthcheck": {"command": "pg_isready -U app", "interval_seconds": 10, "retries": 5},
            },
            {
                "name": "cache",
                "image": "redis:7",
                "ports": [],
                "environment": [],
                "depends_on": [],
                "restart": "always",
            },
        ],
    },
    "package-manifest": {
        "name": "csvtidy",
        "version": "0.3.1",
        "description": "Clean CSV files from the command line",
        "license": "MIT",
        "requires_python": ">=3.10",
        "dependencies": [
            {"name": "click", "specifier": ">=8", "optional": False},
            {"name": "chardet", "specifier": "", "optional": True},
        ],
        "scripts": [{"name": "csvtidy", "entry_point": "csvtidy.cli:main"}],
        "lint": {"line_length": 100, "strict": True},
        "private": False,
    },
    "test-fixtures": {
        "fixtures": [
            {
                "id": 1,
                "username": "free_ok",
                "email": "free@example.com",
                "age": 30,
                "plan": "free",
                "email_verified": True,
                "expected": "accepted",
            },
            {
                "id": 2,
                "username": "pro_ok",
                "email": "pro@example.com",
                "age": 41,
                "plan": "pro",
                "email_verified": True,
                "expected": "accepted",
            },
            {
                "id": 3,
                "username": "no_at",
                "email": "no-at.example.com",
                "age": 25,
                "plan": "free",
                "email_verified": False,
                "expected": "rejected",
                "reason": "the email has no @",
            },
            {
                "id": 4,
                "username": "too_young",
                "email": "kid@example.com",
                "age": 12,
                "plan": "free",
                "email_verified": False,
                "expected": "rejected",
                "reason": "younger than 13",
            },
        ]
    },
    "search-code": {
        "query": "yaml",
        "language": "python",
        "paths": {"include": ["src/"], "exclude": ["tests/"]},
        "case_sensitive": False,
        "max_results": 20,
    },
    "create-issue": {
        "repo": "acme/billing",
        "title": "Monthly invoice PDF takes over 30 s to render for 500+ line items",
        "body": "The monthly invoice PDF takes over 30 seconds to render with more than 500 line items.",
        "labels": ["performance", "bug"],
        "priority": "p1",
        "assignees": ["mkowalski", "tchen"],
        "links": [{"kind": "related", "url": "https://github.com/acme/billing/issues/812"}],
        "milestone": 14,
    },
    "schedule-meeting": {
        "title": "Design review",
        "start": "2026-05-12T15:00",
        "duration_minutes": 45,
        "attendees": [
            {"name": "Dana", "email": "dana@corp.example", "optional": False},
            {"name": "Lee", "email": "lee@corp.example", "optional": True},
        ],
        "location": {"kind": "room", "detail": "Atlas"},
        "reminders_minutes": [10],
    },
}


def schema_features(schema: dict, nested: bool = False) -> set[str]:
    """What a schema uses, over all its sub-schemas: nested objects, arrays, enums, numbers,
    booleans and optional properties."""
    found = set()
    if "enum" in schema:
        found.add("enum")
    kind = schema.get("type")
    if kind == "object":
        found |= {"nested object"} if nested else set()
        if set(schema["properties"]) - set(schema.get("required", [])):
            found.add("optional")
        for sub in schema["properties"].values():
            found |= schema_features(sub, nested=True)
    elif kind == "array":
        found |= {"array"} | schema_features(schema["items"], nested=True)
    elif kind in ("number", "integer", "boolean"):
        found.add("boolean" if kind == "boolean" else "number")
    return found


def grammar_accepts(schema: dict, text: str) -> bool:
    """Whether the engine's grammar for ``schema`` accepts ``text`` whole, walked byte by byte
    through llguidance's byte tokenizer (no model needed)."""
    import llguidance

    from cactus_edge.constraints.grammar import grammar_source, parse_json_schema

    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, grammar_source(parse_json_schema(schema), None, None))
    return matcher.consume_tokens(tokenizer.tokenize_bytes(text.encode())) and matcher.is_accepting()


def test_the_bundled_structured_prompts_have_compiling_schemas_of_every_kind():
    from cactus_edge.cli.bench import STRUCTURED_KINDS, load_structured, load_workload
    from cactus_edge.constraints.grammar import grammar_source, parse_json_schema

    structured = load_structured()
    assert len(structured) >= 8 and len({e["id"] for e in structured}) == len(structured)
    assert {e["category"] for e in structured} == {"structured"}
    assert sorted({e["kind"] for e in structured}) == sorted(STRUCTURED_KINDS)
    assert all(sum(e["kind"] == kind for e in structured) >= 2 for kind in STRUCTURED_KINDS)
    every_feature = {"nested object", "array", "enum", "number", "boolean", "optional"}
    for entry in structured:
        assert grammar_source(parse_json_schema(entry["json_schema"]), None, None)  # compiles
        assert schema_features(entry["json_schema"]) == every_feature, entry["id"]
        assert "JSON object" in entry["prompt"] and "no prose" in entry["prompt"]  # asks for JSON only
    assert load_workload(categories=["structured"]) == structured
    # Every other category is as it was: no schema anywhere.
    assert not any("json_schema" in e for e in load_workload() if e["category"] != "structured")


def test_every_structured_prompt_has_an_answer_its_schema_accepts():
    from cactus_edge.cli.bench import load_structured

    structured = {e["id"]: e["json_schema"] for e in load_structured()}
    assert set(EXAMPLE_ANSWERS) == set(structured)
    for name, answer in EXAMPLE_ANSWERS.items():
        schema = structured[name]
        assert grammar_accepts(schema, json.dumps(answer)), name
        # The schema constrains: a required field left out, or a field it does not know, is refused.
        first_required = schema["required"][0]
        assert not grammar_accepts(
            schema, json.dumps({k: v for k, v in answer.items() if k != first_required})
        )
        assert not grammar_accepts(schema, json.dumps({**answer, "unknown_field": 1})), name


def test_a_jsonl_prompt_keeps_its_schema_and_each_entry_gets_its_own(tmp_path):
    from cactus_edge.cli.bench import entry_settings

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"prompt": "p", "json_schema": schema}) + "\n" + json.dumps({"prompt": "q"}) + "\n"
    )
    constrained, free = load_prompts(path)
    assert constrained["json_schema"] == schema and "json_schema" not in free
    settings = {"max_tokens": 9}
    assert entry_settings(constrained, settings) == {"max_tokens": 9, "json_schema": schema}
    assert entry_settings(free, settings) is settings


def test_the_forced_share_counts_constrained_replies_only():
    from cactus_edge.cli.bench import forced_tokens_table

    variants = [Variant("none", n_draft=0), Variant("sps", n_draft=4)]
    records = [
        {**record(0, "none", 10.0, 20, 20, 0, hist={0: 20}), "constrained": True, "n_forced": 0},
        {**record(0, "sps k=4", 15.0, 8, 24, 16), "constrained": True, "n_forced": 6},
        {**record(1, "none", 10.0, 20, 20, 0, hist={0: 20}), "constrained": False, "n_forced": 0},
        {**record(1, "sps k=4", 15.0, 8, 30, 16), "constrained": False, "n_forced": 0},
    ]
    summary = summarize(records, variants)
    sps = summary["sps k=4"]
    assert (sps["n_constrained_replies"], sps["n_constrained_tokens"], sps["n_forced"]) == (1, 24, 6)
    assert sps["forced_share"] == pytest.approx(0.25) and summary["none"]["forced_share"] == 0.0
    assert "| sps k=4 | 1 | 24 | 6 | 25.0% |" in forced_tokens_table(summary)
    unconstrained = summarize([r for r in records if not r["constrained"]], variants)
    assert unconstrained["sps k=4"]["forced_share"] is None and forced_tokens_table(unconstrained) == ""


def test_a_structured_bench_constrains_every_variant_and_reports_forced_tokens(
    tiny_args, tmp_path, monkeypatch
):
    from cactus_edge.cli.bench import load_structured
    from cactus_edge.constraints.grammar import parse_json_schema
    from cactus_edge.engine.engine import Engine

    calls = []  # ("check" or "stream", config), in order
    real_stream, real_check = Engine.stream, Engine.check_request

    def stream(self, prompt, config, *args, **kwargs):
        calls.append(("stream", config))
        return real_stream(self, prompt, config, *args, **kwargs)

    def check_request(self, prompt, config):
        calls.append(("check", config))
        return real_check(self, prompt, config)

    monkeypatch.setattr(Engine, "stream", stream)
    monkeypatch.setattr(Engine, "check_request", check_request)
    out = tmp_path / "out"
    flags = ["--category", "structured", "--limit", "1", "--methods", "none,sps", "--n-draft", "3"]
    data = run_bench_command(tiny_args, out, *flags, "--max-tokens", "24")
    runs = [config for kind, config in calls if kind == "stream" and config.max_tokens == 24]  # no warm-up
    schema = parse_json_schema(load_structured()[0]["json_schema"])
    assert [config.method for config in runs] == ["none", "sps"]
    assert all(config.json_schema == schema for config in runs)
    # The schema is compiled before anything is timed, not in the first variant's first token.
    assert next(kind for kind, config in calls if config.json_schema is not None) == "check"
    assert all(r["constrained"] and r["category"] == "structured" for r in data["runs"])
    sps = data["summary"]["sps k=3 [model+lookup]"]
    assert sps["n_constrained_replies"] == 1 and 0 < sps["n_forced"] <= sps["n_constrained_tokens"]
    assert sps["forced_share"] == pytest.approx(sps["n_forced"] / sps["n_constrained_tokens"])
    table = (out / "bench.md").read_text()
    assert "| method | constrained replies | tokens | forced tokens | forced share |" in table
    assert "| sps k=3 [model+lookup] | 1 | " in table


def test_a_structured_bench_of_plain_decoding_alone_loads_no_draft_and_runs(tiny_args, tmp_path):
    """`--methods none` loads no draft model; compiling the schemas up front must not ask for one
    (the default drafter would)."""
    flags = ["--category", "structured", "--limit", "1", "--methods", "none", "--max-tokens", "8"]
    data = run_bench_command(tiny_args, tmp_path, *flags)
    assert set(data["summary"]) == {"none"} and data["runs"][0]["constrained"]


def _timed(token_ms, stats=None):
    from cactus_edge.cli.bench import TimedRun

    return TimedRun("", token_ms[0], token_ms[-1] + 5.0, stats, tuple(token_ms))


def test_compare_measures_equal_work_not_the_shorter_reply():
    """Plain writes 200 tokens at 100 ms each, ours 100 at 80 ms each, the same first token: the
    ratio of totals would say 2.5x; over the 100 tokens both wrote, ours is 1.25x faster."""
    from cactus_edge.cli.bench import equal_work

    plain = _timed([1000.0 + 100.0 * i for i in range(200)])
    ours = _timed([1000.0 + 80.0 * i for i in range(100)])
    compared = equal_work(plain, ours)
    assert compared.n_tokens == 100
    assert compared.speed == pytest.approx(100 / 80)
    assert compared.first_token == pytest.approx(1.0)
    assert compared.end_to_end == pytest.approx((1000 + 9900) / (1000 + 7920))
    line = compared.line(200, 100)
    assert "over the first 100 tokens of each reply (plain wrote 200, these settings 100)" in line
    with pytest.raises(ValueError):
        equal_work(plain, _timed([1000.0]))


def test_switching_workload_returns_to_each_conversation_from_the_prompt_cache(
    tiny_pair, tmp_path, monkeypatch
):
    """bench --workload switching on the tiny pair: from the second round on, every request
    restores its conversation from memory and is compared with its own cold first token."""
    from cactus_edge.cli import switching
    from cactus_edge.engine import prompt_cache
    from tests.test_cli import pair_args

    words = ["the", "water", "is", "hot", "and", "cold", "code", "python", "word", "people", "were"]
    blocks = [" ".join(words[i:] + words[:i]) * 3 for i in range(len(words))]
    monkeypatch.setattr(switching, "code_blocks", lambda: blocks)
    monkeypatch.setattr(switching, "MIN_OPENING_CHARS", 300)
    monkeypatch.setattr(prompt_cache.PromptCache.__init__, "__defaults__", (None, 16))  # min_tokens
    args = ["bench", *pair_args(tiny_pair), "--n-ctx", "512", "--workload", "switching", "--rounds", "2"]
    args += ["--max-tokens", "4", "--temperature", "0", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "switching.json").read_text())["requests"]
    assert [(r["round"], r["conversation"]) for r in data] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    first_round = {r["conversation"]: r for r in data if r["round"] == 0}
    for request in data:
        assert request["cold_ttft_ms"] > 0
        if request["round"]:  # at least the previous question came back
            assert request["source"] == "memory"
            assert request["cached_tokens"] >= first_round[request["conversation"]]["prompt_tokens"]
    table = (tmp_path / "switching.md").read_text()
    assert "| 2 | 3 |" in table and "· cactus," in table  # the default method, which --methods names
    assert all(r["cache_mib"] >= 0 and r["rss_mb"] > 0 for r in data)
