"""Files the library writes, and where: the one atomic-write discipline (a temporary file beside
the final one, renamed into place, so nothing half-written ever carries the final name) and the
one place per kind of user file (platformdirs)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

APP_NAME = "cactus-edge"


def user_data_folder(kind: str) -> Path:
    """The user's data folder for ``kind`` ("models", "conversations"): kept, backed up."""
    from platformdirs import user_data_dir

    return Path(user_data_dir(APP_NAME)) / kind


def user_cache_folder(kind: str) -> Path:
    """The user's cache folder for ``kind`` ("wheels", "humaneval", "costs"): safe to delete."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir(APP_NAME)) / kind


@contextlib.contextmanager
def temporary_next_to(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final`` (same file system, so the final rename is atomic); removed
    unless the caller renamed it into place. Its name matches models/.gitignore's ``*.part*``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = final.with_name(f"{final.name}.partial-{os.getpid()}")
    try:
        yield temporary
    finally:
        temporary.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: a reader sees the old file or the new one, never half."""
    with temporary_next_to(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
