"""Where a model runs: ``n_gpu_layers="auto"`` resolved against the llama.cpp build (every layer
on the GPU when it has a GPU backend, none otherwise), and the device named for people."""

from __future__ import annotations

import contextlib

import llama_cpp

from ..checks import is_int
from ..errors import CactusEdgeError, InvalidSettingError

AUTO = "auto"
ALL_LAYERS = -1  # llama.cpp: offload every layer


def gpu_offload_supported() -> bool:
    """Whether this machine has a GPU llama.cpp can offload to (Metal, CUDA, Vulkan…). llama.cpp's
    own answer also says yes for a build with the RPC backend alone, so then a local GPU device
    must be found in ggml's registry too."""
    if not llama_cpp.llama_supports_gpu_offload():
        return False
    if not llama_cpp.llama_supports_rpc():
        return True
    return bool(_local_gpu_names())


def _local_gpu_names() -> list[str]:
    """The local GPUs' names and descriptions ([] when ggml's registry cannot be read)."""
    with contextlib.suppress(CactusEdgeError, OSError, AttributeError):
        from .rpc import describe_device, local_gpus

        return [describe_device(device) for device in local_gpus()]
    return []


def resolve_gpu_layers(requested: int | str) -> int:
    """``"auto"``: every layer on the GPU when the build can offload, else 0 (the CPU). An integer
    is kept as given (-1: all, 0: the CPU)."""
    if requested == AUTO:
        return ALL_LAYERS if gpu_offload_supported() else 0
    if not is_int(requested) or requested < ALL_LAYERS:
        raise InvalidSettingError(
            f"n_gpu_layers must be 'auto' or an integer >= -1, got {requested!r}", param="n_gpu_layers"
        )
    return requested


def device_label(n_gpu_layers: int) -> str:
    """"CPU", or the GPU the offloaded layers run on ("GPU Metal (Apple M2 Max)"); "GPU" alone
    when ggml's device registry cannot be read."""
    if n_gpu_layers == 0 or not gpu_offload_supported():
        return "CPU"
    names = _local_gpu_names()
    where = f"GPU {', '.join(names)}" if names else "GPU"
    return where if n_gpu_layers < 0 else f"{where}, {n_gpu_layers} layers"
