"""The prompt cache on disk: conversations kept across restarts (the terminal chat's saved ones,
and a server's evicted ones with ``--cache-dir``).

One file per entry, ``<key>.kvc``: a magic, the length of a JSON header, the header, then each
model's llama.cpp state. The header says what the states are valid for (each model file's
identity, llama.cpp's version, n_ctx, the KV types), each state's tokens, size and sha256. A file
is written beside its final name and renamed into place; one that does not match the loaded
models, is cut short or fails its checksum is deleted with a one-line warning, never restored.
The folder is bounded in bytes, least recently used out first. Disk trouble (full, unwritable) is
a warning and a skipped save, never a failed request.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheFolderError
from ..files import temporary_next_to
from ..llama.model import Model, SavedState

log = logging.getLogger("cactus_edge.prompt_cache")

MAGIC = b"CEKV"
FORMAT = 1
SUFFIX = ".kvc"
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class KeptFile:
    """One entry on disk, as its header describes it (the states stay on disk until restored)."""

    path: Path
    tokens: dict[str, tuple[int, ...]]  # per model role
    n_bytes: int


class CacheFolder:
    """Entries kept in ``folder`` for these ``models``, at most ``max_bytes`` of files."""

    def __init__(self, folder: Path, models: dict[str, Model], max_bytes: int) -> None:
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.validity = {
            "format": FORMAT,
            "models": {role: model.state_identity() for role, model in models.items()},
        }
        if any(identity is None for identity in self.validity["models"].values()):
            raise CacheFolderError("the prompt cache on disk needs models whose files can be identified")
        check_cache_folder(self.folder)
        self.kept: dict[Path, KeptFile] = {}
        self.scan()

    # --- reading -----------------------------------------------------------------------------

    def scan(self) -> None:
        """Index every valid file's header; delete, with a warning, those that are not valid."""
        self.kept.clear()
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            kept = self._read_header(path)
            if kept is not None:
                self.kept[path] = kept

    def _read_header(self, path: Path) -> KeptFile | None:
        try:
            with path.open("rb") as handle:
                header = _header(handle)
            size = path.stat().st_size
        except (OSError, ValueError) as error:
            return self._drop(path, f"unreadable ({error})")
        if header.get("validity") != self.validity:
            return self._drop(path, "written for other models, another llama.cpp or other settings")
        states = header.get("states", {})
        expected = sum(state["bytes"] for state in states.values()) + header["header_bytes"]
        if size != expected:
            return self._drop(path, f"cut short ({size} of {expected} bytes)")
        tokens = {role: tuple(state["tokens"]) for role, state in states.items()}
        return KeptFile(path, tokens, size)

    def load(self, kept: KeptFile) -> dict[str, SavedState] | None:
        """The states of ``kept``, checked against their sha256; None (and the file deleted) when
        the file changed or broke since it was indexed."""
        try:
            with kept.path.open("rb") as handle:
                header = _header(handle)
                states = {}
                for role, state in header["states"].items():
                    data = bytearray(handle.read(state["bytes"]))
                    if len(data) != state["bytes"] or hashlib.sha256(data).hexdigest() != state["sha256"]:
                        raise ValueError(f"the {role}'s state fails its checksum")
                    states[role] = SavedState(tuple(state["tokens"]), data)
        except (OSError, ValueError, KeyError) as error:
            self.kept.pop(kept.path, None)
            self._drop(kept.path, f"unreadable ({error})")
            return None
        _touch(kept.path)
        return states

    # --- writing -----------------------------------------------------------------------------

    def write(self, states: dict[str, SavedState]) -> Path | None:
        """Keep ``states`` in a file (atomically), then hold the bound; None, with a warning, when
        the disk refused (full, unwritable)."""
        header = {
            "validity": self.validity,
            "states": {
                role: {
                    "tokens": list(state.tokens),
                    "bytes": state.n_bytes,
                    "sha256": hashlib.sha256(state.data).hexdigest(),
                }
                for role, state in states.items()
            },
        }
        path = self.folder / f"{_key(header)}{SUFFIX}"
        try:
            with temporary_next_to(path) as temporary:
                with temporary.open("wb") as handle:
                    handle.write(_encoded_header(header))
                    for state in states.values():
                        handle.write(state.data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temporary, path)
        except OSError as error:
            log.warning("prompt cache: could not keep a conversation in %s: %s", self.folder, error)
            return None
        tokens = {role: state.tokens for role, state in states.items()}
        self.kept[path] = KeptFile(path, tokens, path.stat().st_size)
        self._hold_bound()
        return path if path in self.kept else None

    def _hold_bound(self) -> None:
        files = sorted(self.kept.values(), key=lambda kept: _used(kept.path))
        total = sum(kept.n_bytes for kept in files)
        for kept in files:
            if total <= self.max_bytes:
                break
            self.kept.pop(kept.path, None)
            kept.path.unlink(missing_ok=True)
            total -= kept.n_bytes

    @property
    def n_bytes(self) -> int:
        return sum(kept.n_bytes for kept in self.kept.values())

    def _drop(self, path: Path, why: str) -> None:
        log.warning("prompt cache: %s is %s; deleted", path.name, why)
        path.unlink(missing_ok=True)
        return None


def _header(handle) -> dict:
    """The JSON header of an open cache file (its ``header_bytes``: magic, length and header)."""
    if handle.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a cache file")
    (length,) = _LENGTH.unpack(handle.read(_LENGTH.size) or b"\0\0\0\0")
    text = handle.read(length)
    if len(text) != length:
        raise ValueError("its header is cut short")
    header = json.loads(text)
    if not isinstance(header, dict):
        raise ValueError("its header is not an object")
    header["header_bytes"] = len(MAGIC) + _LENGTH.size + length
    return header


def _encoded_header(header: dict) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(text)) + text


def _key(header: dict) -> str:
    """The file's name: the hash of what it holds, so the same conversation replaces its file."""
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:32]


def _used(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _touch(path: Path) -> None:
    """Mark a file as just used (its mtime orders the bound's evictions)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def check_cache_folder(folder: Path) -> None:
    """Refuse a folder that cannot be created or written, at start, with a one-line message."""
    probe = folder / f".write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or error
        raise CacheFolderError(f"cannot write the prompt cache folder {folder}: {reason}") from None
