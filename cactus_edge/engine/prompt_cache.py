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
from dataclasses import dataclass
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


@dataclass(eq=False)
class CacheEntry:
    """Saved states of the models that held text (``{"target": …, "draft": …}``)."""

    states: dict[str, SavedState]
    kept_at: Path | None = None  # its file in the cache folder, once written there

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
    restore_ms: float = 0.0
    save_ms: float = 0.0


class PromptCache:
    """Saved caches, least recently used first, within ``max_bytes`` (0: keep none)."""

    def __init__(self, max_bytes: int, min_tokens: int = MIN_ENTRY_TOKENS) -> None:
        if max_bytes < 0:
            raise ValueError("the prompt cache's bound must be 0 (off) or more bytes")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.folder: CacheFolder | None = None  # where evicted entries go, when there is one
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._lock = threading.Lock()  # readers (metrics) may ask from other threads
        self.counters = CacheCounters()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 or self.folder is not None

    @property
    def n_bytes(self) -> int:
        with self._lock:
            return sum(entry.n_bytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        """The entries, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def best(self, role: str, wanted: Sequence[int]) -> tuple[CacheEntry | None, int]:
        """The entry whose ``role`` text shares the longest prefix with ``wanted``, and its length."""
        best, best_n = None, 0
        for entry in self.entries():
            state = entry.states.get(role)
            n = common_prefix(state.tokens, wanted) if state else 0
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def add(self, entry: CacheEntry) -> None:
        """Keep ``entry`` as the most recently used; drop the entries it covers, then the least
        recently used until the bound holds, into the cache folder when there is one. An entry
        larger than the bound goes straight to the folder (or nowhere)."""
        if entry.n_bytes > self.max_bytes:
            self._spill([entry])
            return
        evicted = []
        with self._lock:
            for key in [key for key, kept in self._entries.items() if entry.covers(kept)]:
                del self._entries[key]
            self._entries[id(entry)] = entry
            total = sum(kept.n_bytes for kept in self._entries.values())
            while total > self.max_bytes:
                evicted.append(self._entries.popitem(last=False)[1])
                total -= evicted[-1].n_bytes
                self.counters.evictions += 1
        self._spill(evicted)

    def _spill(self, entries: list[CacheEntry]) -> None:
        for entry in entries:
            self.keep(entry)

    def keep(self, entry: CacheEntry) -> None:
        """Write ``entry`` to the cache folder (once); nothing without a folder."""
        if self.folder is None or entry.kept_at is not None:
            return
        entry.kept_at = self.folder.write(entry.states)
        self.counters.disk_writes += entry.kept_at is not None

    def best_kept(self, wanted: Sequence[int]) -> tuple[KeptFile | None, int]:
        """The file in the cache folder whose target text shares the longest prefix with
        ``wanted``, and its length."""
        best, best_n = None, 0
        for kept in list(self.folder.kept.values()) if self.folder is not None else ():
            text = kept.tokens.get("target")
            n = common_prefix(text, wanted) if text else 0
            if n > best_n:
                best, best_n = kept, n
        return best, best_n

    def touch(self, entry: CacheEntry) -> None:
        with self._lock:
            if id(entry) in self._entries:
                self._entries.move_to_end(id(entry))

    def discard(self, entry: CacheEntry) -> None:
        with self._lock:
            self._entries.pop(id(entry), None)

    def snapshot(self) -> dict:
        """Size and counters, for stats and /metrics."""
        counters = self.counters
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
            "disk_bytes": self.folder.n_bytes if self.folder is not None else 0,
            "disk_entries": len(self.folder.kept) if self.folder is not None else 0,
            "disk_writes": counters.disk_writes,
        }


def prepare_caches(models: dict[str, Model], cache: PromptCache | None, wanted: Sequence[int]) -> Preparation:
    """Leave each model's cache holding the longest prefix of ``wanted`` that the live cache or a
    saved entry (in memory, or in the cache folder) has, decoding nothing. The live cache is saved
    first when the prompt would discard at least ``cache.min_tokens`` tokens of it and no entry
    holds them yet. A restore that llama.cpp refuses drops the entry and leaves that model's cache
    empty: the prompt is then prefilled, never failed."""
    preparation = Preparation()
    live = {role: common_prefix(model.tokens, wanted) for role, model in models.items()}
    usable = cache is not None and cache.enabled and all(m.supports_saved_states for m in models.values())
    entry, source = _best_entry(cache, wanted, live["target"] + MIN_RESTORE_GAIN) if usable else (None, None)
    if usable:
        _save_live(models, cache, live, preparation)
        if source == "disk":
            cache.add(entry)  # in memory from now on, as the most recently used
    for role, model in models.items():
        state = entry.states.get(role) if entry is not None else None
        n_state = common_prefix(state.tokens, wanted) if state else 0
        if state is not None and n_state >= live[role] + MIN_RESTORE_GAIN:
            if _restore(model, state, n_state, preparation):
                preparation.source = source
                continue
            cache.discard(entry)
        model.truncate(min(live[role], model.n_past))
    if usable:
        _count(cache.counters, preparation)
    if preparation.source is None and models["target"].n_past:
        preparation.source = "live"
    return preparation


def _best_entry(cache: PromptCache, wanted: Sequence[int], at_least: int) -> tuple:
    """(the entry to restore or None, where it was: "memory" or "disk"): the one sharing the longest
    prefix with ``wanted``, if that is at least ``at_least`` tokens; a kept file only when it beats
    every entry in memory (reading it costs more)."""
    entry, n_entry = cache.best("target", wanted)
    kept, n_kept = cache.best_kept(wanted)
    if kept is not None and n_kept > n_entry and n_kept >= at_least:
        states = cache.folder.load(kept)
        if states is not None:
            return CacheEntry(states, kept_at=kept.path), "disk"
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


def keep_live(models: dict[str, Model], cache: PromptCache) -> bool:
    """Write the live caches to the cache folder now (an entry that holds them is written
    instead); False without a folder, with too little to keep, or when the disk refused."""
    if cache.folder is None or models["target"].n_past < cache.min_tokens:
        return False
    if not all(model.supports_saved_states for model in models.values()):
        return False
    texts = {role: tuple(model.tokens) for role, model in models.items() if model.n_past}
    entry = next((kept for kept in cache.entries() if _holds(kept, texts)), None)
    if entry is None:
        try:
            entry = CacheEntry({role: models[role].save_state() for role in texts})
        except BackendError as error:
            log.warning("prompt cache: the live cache was not saved: %s", error)
            return False
        cache.add(entry)
    cache.keep(entry)
    return entry.kept_at is not None


def _save_live(models: dict[str, Model], cache: PromptCache, live: dict[str, int], preparation) -> None:
    """Save the live caches as one entry when the new prompt discards at least
    ``cache.min_tokens`` of the target's, unless an entry already holds those texts."""
    if models["target"].n_past - live["target"] < cache.min_tokens:
        return
    texts = {role: tuple(model.tokens) for role, model in models.items() if model.n_past}
    if any(_holds(kept, texts) for kept in cache.entries()):
        return
    start = time.perf_counter()
    try:
        entry = CacheEntry({role: models[role].save_state() for role in texts})
    except BackendError as error:
        log.warning("prompt cache: the live cache was not saved: %s", error)
        return
    cache.add(entry)
    cache.counters.saves += 1
    elapsed = (time.perf_counter() - start) * 1000
    cache.counters.save_ms += elapsed
    preparation.save_ms += elapsed


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
