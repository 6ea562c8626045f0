"""Row processing inside the engine on the caches a CPU forward pass leaves (the first call) and on
warm ones (the same call again, as on a host whose model runs on a GPU): ms per step at k = 4, the
first 3 structured prompts, with and without their schemas."""

import collections
import time

from common import k4_replies

import cactus_edge.drafters as drafters
import cactus_edge.engine as engine_module
from cactus_edge import Engine

seconds: dict[str, float] = collections.defaultdict(float)


def timed_twice(module, name: str) -> None:
    function = getattr(module, name)

    def twice(*args, **kwargs):
        start = time.perf_counter()
        function(*args, **kwargs)
        middle = time.perf_counter()
        result = function(*args, **kwargs)
        seconds[name + " cold"] += middle - start
        seconds[name + " warm"] += time.perf_counter() - middle
        return result

    setattr(module, name, twice)


timed_twice(drafters, "process_decoded")  # draft rows
timed_twice(engine_module, "merge_rows")  # target rows
engine = Engine.from_pair("default", n_ctx=4096)
for constrained in (True, False):
    seconds.clear()
    n_steps = 0
    for stats in k4_replies(engine, constrained):
        n_steps += stats.n_verifier_calls
    per_step = {part: round(value * 1000 / n_steps, 3) for part, value in seconds.items()}
    print("constrained" if constrained else "unconstrained", per_step)
