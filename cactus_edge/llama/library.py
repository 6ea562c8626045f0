"""llama.cpp's process-wide state: the backend initialised once, its log routed (silent unless
verbose), and libggml as llama-cpp-python loaded it."""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import llama_cpp

from ..dependencies import incompatible

logger = logging.getLogger("cactus_edge.llama")

_LEVELS = {1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.DEBUG}
_verbose = False
_last_level = logging.DEBUG
_init_lock = threading.Lock()
_initialised = False


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp prints a lot while loading; keep it silent unless verbose (level 5 = continuation).
    global _last_level
    log_level = _LEVELS.get(level, _last_level)
    _last_level = log_level
    if _verbose:
        os.write(2, text)
    elif log_level >= logging.ERROR:
        logger.debug(text.decode("utf-8", errors="replace").rstrip())


def set_verbose(verbose: bool) -> None:
    """Let llama.cpp's own log through to stderr (``--verbose``) or keep it silent."""
    global _verbose
    _verbose = verbose


def ensure_backend() -> None:
    """Initialise llama.cpp's backends and route its log, once per process."""
    global _initialised
    with _init_lock:
        if not _initialised:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True


def ggml_library():
    """libggml as llama-cpp-python loaded it (for ggml's backend registry: backend_rpc), from
    llama-cpp-python's internal ``llama_cpp._ggml`` (checked: IncompatibleDependencyError)."""
    try:
        from llama_cpp._ggml import libggml
    except ImportError as error:
        raise incompatible("llama-cpp-python", "has no llama_cpp._ggml.libggml", "--rpc") from error

    ensure_backend()
    return libggml
