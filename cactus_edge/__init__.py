"""cactus-edge: speculative decoding on llama.cpp with the Cactus acceptance rule.

The engine's names are imported lazily, so the numpy-only modules (sampling, acceptance) load
without llama.cpp.
"""

from importlib import import_module

from .errors import CactusEdgeError
from .rules.acceptance import Cactus, ExactMatch, SpeculativeSampling, TypicalAcceptance, Verdict
from .rules.sampling import SamplingConfig, SparseProbs, process_logits

_LAZY = {
    "Engine": ".engine.engine",
    "GenerationConfig": ".engine.config",
    "GenerationResult": ".engine.events",
    "GenerationStats": ".engine.stats",
    "StreamEvent": ".engine.events",
}

__all__ = [
    "Cactus",
    "CactusEdgeError",
    "ExactMatch",
    "SamplingConfig",
    "SparseProbs",
    "SpeculativeSampling",
    "TypicalAcceptance",
    "Verdict",
    "process_logits",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
