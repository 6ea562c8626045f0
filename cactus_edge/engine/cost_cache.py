"""`auto`'s measured batch costs, kept between processes.

Calibration times every verify size 1–9 (and the draft's 1–5) once per engine, a cost paid by the
first reply of every one-shot `generate` and every new chat. The result depends on the machine,
the model file, the thread count and llama.cpp, so it is stored per those, as one small JSON file
in the user cache folder, and reused for up to MAX_AGE_DAYS. It is only a starting point: real
steps keep refining every size in memory. ``$CACTUS_EDGE_COST_CACHE`` names another folder, or
``off`` to measure every time. No llama.cpp here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from ..files import user_cache_folder, write_text_atomically

COST_CACHE_ENV = "CACTUS_EDGE_COST_CACHE"
MAX_AGE_DAYS = 30
MAX_KEPT_CONTEXT = 512  # tokens before a measurement that may be kept
# A kept table is used while a fresh one-token decode costs within this factor of its entry:
# ordinary drift on a shared machine stays inside it, a table taken under load does not.
MAX_DRIFT = 1.5
FORMAT = 1

logger = logging.getLogger("cactus_edge.costs")


def cache_folder() -> Path | None:
    """Where cost files live; None when caching is off."""
    chosen = os.environ.get(COST_CACHE_ENV, "")
    if chosen.lower() == "off":
        return None
    return Path(chosen) if chosen else user_cache_folder("costs")


def cost_file(identity: dict) -> Path | None:
    """The file for one measurement setting (``identity``: JSON-able facts that change costs)."""
    folder = cache_folder()
    if folder is None:
        return None
    digest = hashlib.sha256(json.dumps({"format": FORMAT, **identity}, sort_keys=True).encode()).hexdigest()
    return folder / f"{digest[:32]}.json"


def load_costs(identity: dict, sizes) -> dict[int, float] | None:
    """{batch size: ms} measured earlier for ``identity``, holding every one of ``sizes``; None
    when there is none, it is older than MAX_AGE_DAYS, or it cannot be read (then re-measured)."""
    path = cost_file(identity)
    if path is None:
        return None
    try:
        if _expired(path):
            return None
        stored = json.loads(path.read_text(encoding="utf-8"))
        costs = {int(size): float(ms) for size, ms in stored["ms_by_size"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not set(sizes) <= set(costs) or not all(0.0 < ms < float("inf") for ms in costs.values()):
        return None
    return costs


def still_holds(kept: dict[int, float], fresh: dict[int, float]) -> bool:
    """Whether a fresh measurement of size 1 agrees with the kept table within MAX_DRIFT."""
    if 1 not in fresh or 1 not in kept:
        return False
    return 1 / MAX_DRIFT <= fresh[1] / kept[1] <= MAX_DRIFT


def save_costs(identity: dict, costs: dict[int, float]) -> None:
    """Keep ``costs`` for the next process; a cache that cannot be written is skipped, not fatal."""
    path = cost_file(identity)
    if path is None:
        return
    record = {"identity": identity, "ms_by_size": {str(size): ms for size, ms in sorted(costs.items())}}
    try:
        write_text_atomically(path, json.dumps(record, indent=1))
        _remove_expired(path.parent)
    except OSError as error:
        logger.debug("could not keep the batch costs in %s: %s", path, error)


def _expired(path: Path) -> bool:
    """Whether the table in ``path`` is past MAX_AGE_DAYS (OSError if it is gone)."""
    return time.time() - path.stat().st_mtime > MAX_AGE_DAYS * 86400


def _remove_expired(folder: Path) -> None:
    """Tables past MAX_AGE_DAYS are never read again (a replaced model file, an old llama.cpp)."""
    for path in folder.glob("*.json"):
        with contextlib.suppress(OSError):  # another process may be pruning too
            if _expired(path):
                path.unlink()
