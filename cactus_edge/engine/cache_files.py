"""The prompt cache on disk: conversations kept across restarts (the terminal chat's saved ones,
and a server's evicted ones with ``--cache-dir``).

Each setup (the model files as loaded, llama.cpp's version, n_ctx, the KV types) keeps its files in
a subfolder of its own, named by a hash of that setup and holding it in ``setup.json``, so engines
of other setups may share the folder. One file per entry, ``<key>.kvc``: a magic, the length of a
JSON header, the header (the setup again, each state's tokens, size and a sha256 over its tokens
and data), then each model's llama.cpp state. A file is written beside its final name and renamed
into place; one that does not match, is cut short or fails its checksum is deleted with a one-line
warning, never restored; a subfolder whose model files are gone or changed, or that another
llama.cpp wrote, is deleted at start. Each subfolder is bounded in bytes, least recently used out
first. Disk trouble (full, unwritable, a file deleted meanwhile) is a warning and a skipped save or
restore, never a failed request.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheFolderError
from ..files import temporary_next_to, write_text_atomically
from ..llama.model import Model, SavedState, state_buffer
from ..llama.vocabulary import file_identity

log = logging.getLogger("cactus_edge.prompt_cache")

MAGIC = b"CEKV"
FORMAT = 2
SUFFIX = ".kvc"
SETUP_FILE = "setup.json"
_LENGTH = struct.Struct("<I")
# What a damaged file can raise while its header is read: all of them mean "not valid".
_DAMAGE = (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error)


@dataclass(frozen=True)
class KeptFile:
    """One entry on disk, as its header describes it (the states stay on disk until restored)."""

    path: Path
    tokens: dict[str, tuple[int, ...]]  # per model role
    n_bytes: int


class CacheFolder:
    """Entries of these ``models`` kept under ``root``, at most ``max_bytes`` of files."""

    def __init__(self, root: Path, models: dict[str, Model], max_bytes: int) -> None:
        if not all(model.supports_saved_states for model in models.values()):
            raise CacheFolderError("--cache-dir needs models that save their caches here (not --rpc workers)")
        self.setup = {
            "format": FORMAT,
            "models": {role: model.state_identity() for role, model in models.items()},
        }
        if any(identity is None for identity in self.setup["models"].values()):
            raise CacheFolderError("--cache-dir needs model files that can be identified (size and time)")
        self.root, self.max_bytes = Path(root), max_bytes
        self.folder = self.root / _digest(self.setup)[:16]
        check_cache_folder(self.folder)
        write_text_atomically(self.folder / SETUP_FILE, json.dumps(self.setup, indent=1))
        self._lock = threading.Lock()  # /metrics reads sizes from another thread
        self.kept: dict[Path, KeptFile] = {}
        version = next(iter(self.setup["models"].values()))["llama_cpp"]
        _remove_stale_setups(self.root, keep=self.folder, llama_cpp_version=version)
        self.scan()

    # --- reading -----------------------------------------------------------------------------

    def scan(self) -> None:
        """Index every valid file's header; delete, with a warning, files that are not valid and
        temporary files a crash left behind."""
        for leftover in self.folder.glob(f"*{SUFFIX}.partial-*"):
            with contextlib.suppress(OSError):
                leftover.unlink()
        found = [self._read_header(path) for path in sorted(self.folder.glob(f"*{SUFFIX}"))]
        with self._lock:
            self.kept = {kept.path: kept for kept in found if kept is not None}

    def _read_header(self, path: Path) -> KeptFile | None:
        try:
            with path.open("rb") as handle:
                header = _header(handle)
            size = path.stat().st_size
            if header["setup"] != self.setup:
                return self._drop(path, "written for other models, another llama.cpp or other settings")
            states = header["states"]
            expected = sum(int(state["bytes"]) for state in states.values()) + header["header_bytes"]
            if size != expected:
                return self._drop(path, f"cut short ({size} of {expected} bytes)")
            tokens = {role: tuple(int(t) for t in state["tokens"]) for role, state in states.items()}
        except _DAMAGE as error:
            return self._drop(path, f"unreadable ({error})")
        return KeptFile(path, tokens, size)

    def load(self, kept: KeptFile) -> dict[str, SavedState] | None:
        """The states of ``kept``, each checked against its sha256 (tokens and data); None, and
        the file deleted, when it changed or broke since it was indexed."""
        try:
            with kept.path.open("rb") as handle:
                header = _header(handle)
                states = {}
                for role, state in header["states"].items():
                    tokens = tuple(int(t) for t in state["tokens"])
                    data = _read_state(handle, int(state["bytes"]))
                    if data is None or _checksum(tokens, data) != state["sha256"]:
                        raise ValueError(f"the {role}'s state fails its checksum")
                    states[role] = SavedState(tokens, data)
        except _DAMAGE as error:
            self.forget(kept.path, f"unreadable ({error})")
            return None
        with contextlib.suppress(OSError):
            os.utime(kept.path)  # just used: the bound evicts by modification time
        return states

    def holds(self, path: Path | None) -> bool:
        with self._lock:
            return path in self.kept

    def files(self) -> list[KeptFile]:
        with self._lock:
            return list(self.kept.values())

    # --- writing -----------------------------------------------------------------------------

    def write(self, states: dict[str, SavedState]) -> Path | None:
        """Keep ``states`` in a file (atomically), then hold the bound; None, with a warning, when
        the disk refused (full, unwritable) or the file alone is larger than the bound."""
        size = sum(state.n_bytes for state in states.values())
        if size > self.max_bytes:
            log.warning("prompt cache: a conversation of %d bytes exceeds --cache-disk; not kept", size)
            return None
        header = {
            "setup": self.setup,
            "states": {role: _state_header(state) for role, state in states.items()},
        }
        path = self.folder / f"{_digest(header)[:32]}{SUFFIX}"
        try:
            _write_file(path, _encoded_header(header), states)
            kept = KeptFile(path, {role: state.tokens for role, state in states.items()}, path.stat().st_size)
        except OSError as error:
            log.warning("prompt cache: could not keep a conversation in %s: %s", self.folder, error)
            return None
        with self._lock:
            self.kept[path] = kept
        self._hold_bound()
        return path if self.holds(path) else None

    def forget(self, path: Path, why: str) -> None:
        """Delete a kept file that cannot be restored (say why)."""
        with self._lock:
            self.kept.pop(path, None)
        self._drop(path, why)

    def _hold_bound(self) -> None:
        with self._lock:
            files = sorted(self.kept.values(), key=lambda kept: _modified(kept.path))
            total = sum(kept.n_bytes for kept in files)
            evicted = []
            for kept in files:
                if total <= self.max_bytes:
                    break
                del self.kept[kept.path]
                evicted.append(kept.path)
                total -= kept.n_bytes
        for path in evicted:
            with contextlib.suppress(OSError):
                path.unlink()

    @property
    def n_bytes(self) -> int:
        with self._lock:
            return sum(kept.n_bytes for kept in self.kept.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self.kept)

    def _drop(self, path: Path, why: str) -> None:
        log.warning("prompt cache: %s is %s; deleted", path.name, why)
        with contextlib.suppress(OSError):
            path.unlink()


def _read_state(handle, size: int):
    """The next ``size`` bytes of ``handle`` in a state buffer; None when the file ends first."""
    data = state_buffer(size) if size else bytearray()
    return data if handle.readinto(data) == size else None


def _state_header(state: SavedState) -> dict:
    checksum = _checksum(state.tokens, state.data)
    return {"tokens": list(state.tokens), "bytes": state.n_bytes, "sha256": checksum}


def _write_file(path: Path, header: bytes, states: dict[str, SavedState]) -> None:
    with temporary_next_to(path) as temporary:
        with temporary.open("wb") as handle:
            handle.write(header)
            for state in states.values():
                handle.write(state.data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)


def _remove_stale_setups(root: Path, keep: Path, llama_cpp_version: str) -> None:
    """Delete the subfolders of setups that can never come back: a model file gone or changed, or
    written by another llama.cpp (setups that differ only in n_ctx or KV types stay)."""
    for setup_file in root.glob(f"*/{SETUP_FILE}"):
        folder = setup_file.parent
        if folder == keep:
            continue
        try:
            setup = json.loads(setup_file.read_text())
            identities = list(setup["models"].values())
            stale = any(identity["llama_cpp"] != llama_cpp_version for identity in identities) or any(
                file_identity(Path(identity["file"])) != _file_part(identity) for identity in identities
            )
        except (*_DAMAGE, json.JSONDecodeError):
            stale = True
        if stale:
            log.warning("prompt cache: %s holds caches of changed or missing model files; deleted", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _file_part(identity: dict) -> dict:
    return {key: identity[key] for key in ("file", "size", "mtime_ns")}


def _header(handle) -> dict:
    """The JSON header of an open cache file (its ``header_bytes``: magic, length and header)."""
    if handle.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a cache file")
    length_bytes = handle.read(_LENGTH.size)
    if len(length_bytes) != _LENGTH.size:
        raise ValueError("cut short")
    (length,) = _LENGTH.unpack(length_bytes)
    text = handle.read(length)
    if len(text) != length:
        raise ValueError("its header is cut short")
    header = json.loads(text)
    if not isinstance(header, dict) or not isinstance(header.get("states"), dict):
        raise ValueError("its header is not a cache file's")
    header["header_bytes"] = len(MAGIC) + _LENGTH.size + length
    return header


def _encoded_header(header: dict) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(text)) + text


def _checksum(tokens: tuple[int, ...], data) -> str:
    """sha256 over a state's tokens and its data: a file whose tokens were changed fails too."""
    digest = hashlib.sha256(json.dumps(list(tokens)).encode())
    digest.update(data)
    return digest.hexdigest()


def _digest(value: dict) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _modified(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


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
