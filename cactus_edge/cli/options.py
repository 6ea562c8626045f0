"""The flags commands share (models, sampling, speculation, constraints, the server's), each
parsed and checked by click, and the one place library errors become exit codes."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from ..catalog.registry import DEFAULT_PAIR
from ..engine import config as defaults
from ..errors import CactusEdgeError

INTERNAL_ERROR_EXIT = 1


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


HINT_MARKER = ".faster-pair-hint-shown"  # in the models folder, once the hint has been shown


@dataclass(frozen=True)
class ModelChoice:
    """Which models to load and how: the flags of `model_options`, checked when parsed."""

    pair: str | None
    draft: str | None
    target: str | None
    n_ctx: int
    threads: int | None
    n_gpu_layers: int | str
    verbose: bool
    rpc: str | None = None
    tensor_split: tuple[float, ...] = ()
    rpc_timeout: float | None = None
    cache_ram: int = defaults.DEFAULT_CACHE_MIB
    cache_dir: str | None = None
    cache_disk: int = defaults.DEFAULT_CACHE_DISK_MIB

    def __post_init__(self) -> None:
        if self.pair and (self.draft or self.target):
            raise click.UsageError("use --pair, or --draft/--target, not both")
        if self.tensor_split and not self.rpc:
            raise click.UsageError("--tensor-split places layers across --rpc workers; give --rpc too")

    def describe(self, engine) -> str:
        """Which models run, and where a faster pair is one command away (generate, chat, serve)."""
        return f"{engine.description}{self.faster_pair_hint()}"

    def faster_pair_hint(self) -> str:
        """Where a faster pair is one command away: the default pair on a CPU (its Q4_K_M files
        verify batches slower than a Q4_0 copy; the quality cost is measured in docs). Said once
        per models folder, which keeps a marker file once it has."""
        if self.target or self.draft or (self.pair or DEFAULT_PAIR) != DEFAULT_PAIR or self._on_gpu():
            return ""
        from ..catalog.registry import default_models_dir

        marker = default_models_dir() / HINT_MARKER
        if marker.exists():
            return ""
        with contextlib.suppress(OSError):  # an unwritable folder: the hint comes every time
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        command = "cactus-edge models quantize default --type q4_0"
        return f" (on a CPU, `{command}` makes a faster pair: --pair default-q4_0)"

    def _on_gpu(self) -> bool:
        """Whether the layers go to a GPU (auto asks the llama.cpp build)."""
        if self.n_gpu_layers == "auto":
            from ..llama.devices import gpu_offload_supported

            return gpu_offload_supported()
        return self.n_gpu_layers != 0

    def load(self, method: str = defaults.DEFAULT_METHOD, drafter: str = defaults.DEFAULT_DRAFTER):
        """The Engine for this choice; no draft model when `method`/`drafter` never use one."""
        from ..engine.engine import Engine

        draft, target = self.chosen_models
        if not defaults.needs_draft_model(method, drafter):
            draft = None  # plain decoding and prompt lookup never use the draft model
        elif not draft:
            raise click.UsageError(f"--drafter {drafter} needs a draft model: give --draft FILE or --pair")
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
            cache_ram_mib=self.cache_ram,
            cache_dir=self.cache_dir,
            cache_disk_mib=self.cache_disk,
        )

    @functools.cached_property
    def chosen_models(self) -> tuple[str | os.PathLike | None, str]:
        """(draft, target) to load: a registered pair's, or the ones given, with `--draft auto`
        resolved to the smallest local model that shares the target's tokenizer (said once)."""
        from ..catalog.registry import resolve_pair

        draft, target = resolve_pair(self.pair, self.draft, self.target)
        if draft != "auto":
            return draft, target
        from ..catalog.drafts import find_draft

        search = find_draft(target)
        click.echo(f"[models] {search.outcome(Path(target).name)}", err=True)
        return search.draft, target

    def has_draft(self) -> bool:
        """Whether this choice loads a draft model (a target alone does not)."""
        return self.chosen_models[0] is not None

    def fit(self, config):
        """``config`` as this choice can run it: with a target alone, the default drafter drafts by
        prompt lookup, which needs no draft model (said once on stderr); `--drafter model` is
        refused."""
        if not config.uses_model or self.has_draft():
            return config
        if config.drafter == "model":
            raise click.UsageError("--drafter model needs a draft model: give --draft FILE or --pair")
        click.echo("[models] no draft model: drafting by prompt lookup (add one with --draft FILE)", err=True)
        return config.with_changes(drafter="lookup")

    def served_name(self) -> str:
        """The id /v1/models lists: the target file's name without .gguf, or the registry's name."""
        name = Path(self.chosen_models[1]).name
        return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


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
        click.option(
            "--draft",
            default=None,
            help="Draft GGUF path or registered name; auto: the smallest local model that shares the "
            "target's tokenizer (none: prompt lookup).",
        ),
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
            type=GpuLayers(),
            default="auto",
            show_default=True,
            help="Layers on the GPU: auto (all of them when llama.cpp was built with a GPU backend, else "
            "none), a number, -1 (all) or 0 (the CPU).",
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
        click.option(
            "--cache-ram",
            metavar="MIB",
            type=click.IntRange(min=0),
            default=defaults.DEFAULT_CACHE_MIB,
            show_default=True,
            help="MiB of memory for the prompt cache, which keeps earlier conversations' caches so that "
            "returning to one prefills only what is new (0: off).",
        ),
        click.option(
            "--cache-dir",
            metavar="DIR",
            type=click.Path(file_okay=False),
            default=None,
            help="Keep the prompt cache's evicted conversations in this folder too (kept across restarts).",
        ),
        click.option(
            "--cache-disk",
            metavar="MIB",
            type=click.IntRange(min=1),
            default=defaults.DEFAULT_CACHE_DISK_MIB,
            show_default=True,
            help="With --cache-dir: MiB of files the folder may hold.",
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
        cache_ram,
        cache_dir,
        cache_disk,
        **kwargs,
    ):
        model = ModelChoice(
            pair, draft, target, n_ctx, threads, n_gpu_layers, verbose, rpc, tensor_split, rpc_timeout,
            cache_ram, cache_dir, cache_disk,
        )
        return command(*args, model=model, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


class GpuLayers(click.ParamType):
    name = "INTEGER|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or (isinstance(value, int) and value >= -1):
            return value
        try:
            layers = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither an integer nor 'auto'", param, ctx)
        if layers < -1:
            self.fail(f"{layers} is below -1 (-1: every layer, 0: the CPU)", param, ctx)
        return layers


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
    defaults, from cactus_edge.engine.config)."""
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
    from ..engine.config import GenerationConfig

    names = set(GenerationConfig.field_names())
    return GenerationConfig(**{k: v for k, v in flags.items() if k in names})


CONSTRAINT_OPTIONS = {"json_schema": "--json-schema", "grammar": "--grammar", "regex": "--regex"}


def _checked_constraint(param, name: str, text: str) -> str:
    """``text`` if llguidance compiles it as constraint ``name`` (no tokenizer needed), else a
    BadParameter naming the option with the library's message."""
    from ..constraints.grammar import grammar_source

    try:
        grammar_source(**{"json_schema": None, "lark": None, "regex": None, name: text})
    except CactusEdgeError as error:
        raise click.BadParameter(str(error), param=param) from None
    return text


def _json_schema_option(ctx, param, value: str | None) -> str | None:
    """--json-schema: an inline JSON object (a value starting with '{') or the path of a JSON
    file; the schema as compact JSON text, compiled here so every problem names the option."""
    from ..constraints.grammar import parse_json_schema

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


def constraint_options(command):
    """--json-schema, --grammar and --regex, each compiled when parsed (see :func:`one_constraint`)."""
    return _apply(
        command,
        [
            click.option(
                "--json-schema",
                metavar="FILE|JSON",
                callback=_json_schema_option,
                help="Constrain the reply to this JSON schema: a JSON file, or an inline object ('{...}').",
            ),
            click.option(
                "--grammar",
                type=click.Path(exists=True, dir_okay=False),
                callback=_grammar_option,
                help="Constrain the reply to this Lark grammar file (llguidance's syntax).",
            ),
            click.option(
                "--regex",
                metavar="PATTERN",
                callback=_regex_option,
                help="Constrain the whole reply to match PATTERN.",
            ),
        ],
    )


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "max_tokens")


def sampling_settings(flags: dict) -> dict:
    """The sampling flags (and max_tokens) of bench and eval, as the settings dict they record."""
    return {name: flags[name] for name in SAMPLING_FIELDS}


def one_constraint(flags: dict) -> None:
    """At most one of --json-schema, --grammar and --regex (a UsageError naming the ones given)."""
    given = [option for name, option in CONSTRAINT_OPTIONS.items() if flags.get(name) is not None]
    if len(given) > 1:
        raise click.UsageError(
            f"give at most one of --json-schema, --grammar and --regex, not {' and '.join(given)}"
        )


def comma_list(kind):
    """A click callback: "a,b" → [kind(a), kind(b)], a bad item a BadParameter."""

    def parse(ctx, param, value):
        try:
            return [kind(item) for item in value.split(",") if item]
        except ValueError as error:
            raise click.BadParameter(str(error)) from error

    return parse


def kl_budget_item(item: str) -> float:
    budget = float(item)
    if not budget >= 0:
        raise ValueError(f"a KL budget must be >= 0 nats, got {item!r}")
    return budget


def draft_length_item(item: str):
    return item if item == "auto" else int(item)


def server_options(command):
    """serve's own flags, one per ServerSettings field that has one: name, type, default and
    help all come from the field (cactus_edge/server/settings.py), none is written here."""
    from ..server.settings import setting_flags

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
