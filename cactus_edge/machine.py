"""Facts about the machine that benchmarks print and cached measurements are keyed by."""

from __future__ import annotations

import os
import platform


def cpu_model_name() -> str:
    """The CPU's model name ("AMD EPYC", "Apple M2"...), for benchmark headers and the
    kept batch costs' key."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask, e.g. under taskset or a container)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return usable or 1
