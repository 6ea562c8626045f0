"""The prompt cache: saved KV caches of earlier conversations, so that returning to one prefills
only what is new.

An entry holds each model's saved state (:class:`SavedState`: the exact tokens and llama.cpp's
serialized cells). Before a generation, :func:`prepare_caches` compares the live cache and every
entry with the new prompt token for token and restores whichever holds the longest common prefix
(cut to that prefix), after saving the live cache if the new prompt would discard a long stretch
of it. The cache is bounded in bytes; the least recently used entries go first. No llama.cpp here:
models save and restore themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BackendError
from ..llama.model import Model, SavedState
from .cache_files import CacheFolder, KeptFile

log = logging.getLogger("cactus_edge.prompt_cache")

# A live cache shorter than this is not worth an entry: prefilling it again costs little.
MIN_ENTRY_TOKENS = 256
# Restore only when it saves at least this many tokens of prefill over the live cache: a restore
# copies the whole entry, which costs about as much as prefilling a few tokens.
MIN_RESTORE_GAIN = 32

Models = dict[str, Model]  # by role: "target", "draft"


@dataclass(eq=False)
class CacheEntry:
    """Saved states of the models that held text (``{"target": …, "draft": …}``)."""

    states: dict[str, SavedState]
    kept_at: Path | None = None  # its file in the cache folder, once written there
    key: str | None = None  # the client's prompt_cache_key when it was saved: breaks ties only

    @property
    def n_bytes(self) -> int:
        return sum(state.n_bytes for state in self.states.values())

    def covers(self, other: CacheEntry) -> bool:
        """Whatever ``other`` can restore, this entry can too: each of other's texts is a prefix
        of this entry's text for the same model."""
        return _holds(self, {role: state.tokens for role, state in other.states.items()})


@dataclass
class CacheCounters:
    """What the prompt cache did, for stats and /metrics."""

    hits: int = 0  # generations that restored an entry (from memory or disk)
    disk_hits: int = 0  # of those, restored from the cache folder
    misses: int = 0  # generations that found no entry better than the live cache
    saves: int = 0
    evictions: int = 0
    disk_writes: int = 0
    restore_ms: float = 0.0  # total time spent restoring
    save_ms: float = 0.0  # total time spent saving


@dataclass
class Preparation:
    """What :func:`prepare_caches` did before one generation."""

    source: str | None = None  # "memory" or "disk" (restored), "live" (reused the live cache), or None
    restore_ms: float = 0.0  # reading a file and llama.cpp's restores
    save_ms: float = 0.0
    restored: set[str] = field(default_factory=set)  # the roles restored from an entry


class PromptCache:
    """Saved caches, least recently used first, within ``max_bytes`` (0: keep none in memory),
    and evicted ones in ``folder`` when there is one."""

    def __init__(
        self, max_bytes: int, folder: CacheFolder | None = None, min_tokens: int = MIN_ENTRY_TOKENS
    ) -> None:
        if max_bytes < 0:
            raise ValueError("the prompt cache's bound must be 0 (off) or more bytes")
        self.max_bytes, self.folder, self.min_tokens = max_bytes, folder, min_tokens
        self._entries: OrderedDict[CacheEntry, None] = OrderedDict()  # keys by identity, oldest first
        self._lock = threading.Lock()  # readers (metrics) may ask from other threads
        self.counters = CacheCounters()
        self.live_key: str | None = None  # the key of the request the live caches hold

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 or self.folder is not None

    @property
    def n_bytes(self) -> int:
        with self._lock:
            return sum(entry.n_bytes for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        """The entries, least recently used first."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        """Forget the entries in memory (files in the folder stay: they are the user's)."""
        with self._lock:
            self._entries.clear()

    def best(self, role: str, wanted: Sequence[int], key: str | None = None) -> tuple[CacheEntry | None, int]:
        """The entry whose ``role`` text shares the longest prefix with ``wanted``, and its length.
        Among entries sharing as much, one saved under ``key`` wins, then the most recently used:
        the key groups a client's entries but never makes differing tokens count."""
        best, best_rank = None, (0, False)
        for entry in self.entries():  # least recently used first: a later equal rank wins
            state = entry.states.get(role)
            n = common_prefix(state.tokens, wanted) if state else 0
            rank = (n, key is not None and entry.key == key)
            if n > 0 and rank >= best_rank:
                best, best_rank = entry, rank
        return best, best_rank[0]

    def add(self, entry: CacheEntry) -> bool:
        """Keep ``entry`` as the most recently used; drop the entries it covers, then the least
        recently used until the bound holds, into the folder when there is one. An entry larger
        than the bound goes straight to the folder. Whether it is kept anywhere."""
        if entry.n_bytes > self.max_bytes:
            return self.keep(entry)
        evicted = []
        with self._lock:
            for kept in [kept for kept in self._entries if entry.covers(kept)]:
                del self._entries[kept]
            self._entries[entry] = None
            total = sum(kept.n_bytes for kept in self._entries)
            while total > self.max_bytes:
                evicted.append(self._entries.popitem(last=False)[0])
                total -= evicted[-1].n_bytes
                self.counters.evictions += 1
        for old in evicted:
            self.keep(old)
        return True

    def keep(self, entry: CacheEntry) -> bool:
        """Have ``entry`` in the folder (written unless its file is still there); False without a
        folder or when the disk refused."""
        if self.folder is None:
            return False
        if not self.folder.holds(entry.kept_at):
            entry.kept_at = self.folder.write(entry.states)
            self.counters.disk_writes += entry.kept_at is not None
        return entry.kept_at is not None

    def best_kept(self, wanted: Sequence[int]) -> tuple[KeptFile | None, int]:
        """The file in the folder whose target text shares the longest prefix with ``wanted``,
        and its length."""
        best, best_n = None, 0
        for kept in self.folder.files() if self.folder is not None else ():
            text = kept.tokens.get("target")
            n = common_prefix(text, wanted) if text else 0
            if n > best_n:
                best, best_n = kept, n
        return best, best_n

    def touch(self, entry: CacheEntry) -> None:
        with self._lock:
            if entry in self._entries:
                self._entries.move_to_end(entry)

    def discard(self, entry: CacheEntry, why: str) -> None:
        """Forget an entry llama.cpp refused, and delete its file."""
        with self._lock:
            self._entries.pop(entry, None)
        if self.folder is not None and entry.kept_at is not None:
            self.folder.forget(entry.kept_at, why)

    def snapshot(self) -> dict:
        """Size and counters, for stats and /metrics."""
        counters, folder = self.counters, self.folder
        return {
            "max_bytes": self.max_bytes,
            "bytes": self.n_bytes,
            "entries": len(self),
            "hits": counters.hits,
            "disk_hits": counters.disk_hits,
            "misses": counters.misses,
            "saves": counters.saves,
            "evictions": counters.evictions,
            "restore_ms": counters.restore_ms,
            "save_ms": counters.save_ms,
            "disk_bytes": folder.n_bytes if folder is not None else 0,
            "disk_max_bytes": folder.max_bytes if folder is not None else 0,
            "disk_entries": len(folder) if folder is not None else 0,
            "disk_writes": counters.disk_writes,
        }


def prepare_caches(
    models: Models, cache: PromptCache | None, wanted: Sequence[int], key: str | None = None
) -> Preparation:
    """Leave each model's cache holding the longest prefix of ``wanted`` that the live cache or a
    saved entry (in memory, or in the folder) has, decoding nothing. The live cache is saved first
    when the prompt would discard at least ``cache.min_tokens`` tokens of it and no entry holds
    them yet. ``key`` (the client's prompt_cache_key) prefers that client's entries among equals.
    A restore that llama.cpp refuses drops the entry and leaves the caches to prefill: the request
    never fails for the cache's sake."""
    preparation = Preparation()
    live = {role: common_prefix(model.tokens, wanted) for role, model in models.items()}
    usable = cache is not None and cache.enabled and all(m.supports_saved_states for m in models.values())
    entry, source = None, None
    if usable:
        start = time.perf_counter()
        entry, source = _best_entry(cache, wanted, live["target"] + MIN_RESTORE_GAIN, key)
        preparation.restore_ms += (time.perf_counter() - start) * 1000  # reading a file is restoring
        _save_live(models, cache, live, preparation)
        if source == "disk":
            cache.add(entry)  # in memory from now on, as the most recently used
    restored = entry is not None and _restore_all(models, entry, wanted, live, preparation)
    if entry is not None and not restored:
        cache.discard(entry, "refused by llama.cpp")
    for role, model in models.items():
        if not (restored and role in preparation.restored):
            model.truncate(min(live[role], model.n_past))
    preparation.source = source if restored else ("live" if models["target"].n_past else None)
    if usable:
        _count(cache.counters, preparation)
        cache.live_key = key
    return preparation


def _restore_all(
    models: Models, entry: CacheEntry, wanted: Sequence[int], live: dict[str, int], preparation: Preparation
) -> bool:
    """Restore each model from ``entry`` where that gains on its live cache, the target first;
    False (nothing more restored) when llama.cpp refuses one."""
    for role in sorted(models, key=lambda role: role != "target"):
        state = entry.states.get(role)
        n_state = common_prefix(state.tokens, wanted) if state else 0
        if state is None or n_state < live[role] + MIN_RESTORE_GAIN:
            if role == "target":
                return False
            continue
        if not _restore(models[role], state, n_state, preparation):
            return False
        preparation.restored.add(role)
    return True


def _best_entry(
    cache: PromptCache, wanted: Sequence[int], at_least: int, key: str | None
) -> tuple[CacheEntry | None, str | None]:
    """The entry to restore, and where it was ("memory" or "disk"): the one sharing the longest
    prefix with ``wanted``, if that is at least ``at_least`` tokens; a kept file only when it beats
    every entry in memory (reading it costs more)."""
    entry, n_entry = cache.best("target", wanted, key)
    kept, n_kept = cache.best_kept(wanted)
    if kept is not None and n_kept > n_entry and n_kept >= at_least:
        states = cache.folder.load(kept)
        if states is not None:
            return CacheEntry(states, kept_at=kept.path, key=key), "disk"
    if entry is not None and n_entry >= at_least:
        cache.touch(entry)  # the most recently used, so that saving the live cache keeps it
        return entry, "memory"
    return None, None


def _count(counters: CacheCounters, preparation: Preparation) -> None:
    if preparation.source in ("memory", "disk"):
        counters.hits += 1
        counters.disk_hits += preparation.source == "disk"
        counters.restore_ms += preparation.restore_ms
    else:
        counters.misses += 1


def keep_live(models: Models, cache: PromptCache) -> bool:
    """Have the live caches in the folder now (an entry that holds them is written instead);
    False without a folder, with too little to keep, or when the disk refused (a warning says)."""
    if cache.folder is None or models["target"].n_past < cache.min_tokens:
        return False
    entry = _live_entry(models, cache, None)
    return entry is not None and cache.keep(entry)


def _save_live(models: Models, cache: PromptCache, live: dict[str, int], preparation: Preparation) -> None:
    """Save the live caches as one entry when the new prompt discards at least
    ``cache.min_tokens`` of the target's, unless an entry already holds those texts."""
    if models["target"].n_past - live["target"] >= cache.min_tokens:
        _live_entry(models, cache, preparation)


def _live_entry(models: Models, cache: PromptCache, preparation: Preparation | None) -> CacheEntry | None:
    """The entry that holds the live caches: one already kept, else a new one saved now (None when
    the models cannot save, or it was too large to keep)."""
    texts = {role: tuple(model.tokens) for role, model in models.items() if model.n_past}
    held = next((kept for kept in cache.entries() if _holds(kept, texts)), None)
    if held is not None or not all(model.supports_saved_states for model in models.values()):
        return held
    start = time.perf_counter()
    try:
        entry = CacheEntry({role: models[role].save_state() for role in texts}, key=cache.live_key)
    except BackendError as error:
        log.warning("prompt cache: the live cache was not saved: %s", error)
        return None
    kept = cache.add(entry)
    elapsed = (time.perf_counter() - start) * 1000
    cache.counters.save_ms += elapsed
    cache.counters.saves += kept
    if preparation is not None:
        preparation.save_ms += elapsed
    return entry if kept else None


def _holds(entry: CacheEntry, texts: dict[str, tuple[int, ...]]) -> bool:
    states = entry.states
    return all(role in states and _is_prefix(text, states[role].tokens) for role, text in texts.items())


def _restore(model: Model, state: SavedState, n_tokens: int, preparation: Preparation) -> bool:
    start = time.perf_counter()
    try:
        model.restore_state(state, n_tokens)
    except BackendError as error:
        log.warning("prompt cache: a saved cache was not restored and is dropped: %s", error)
        return False
    preparation.restore_ms += (time.perf_counter() - start) * 1000
    return True


def _is_prefix(short: Sequence[int], long: Sequence[int]) -> bool:
    return len(short) <= len(long) and tuple(long[: len(short)]) == tuple(short)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


__all__ = [
    "CacheEntry",
    "CacheCounters",
    "Preparation",
    "PromptCache",
    "common_prefix",
    "keep_live",
    "prepare_caches",
]
