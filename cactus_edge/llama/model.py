"""The only module that talks to llama.cpp: a thin typed layer over llama-cpp-python's low-level API.

One :class:`LlamaModel` is one GGUF model with one context and one sequence. It tracks the tokens in
its KV cache, decodes new tokens at the end of that sequence, returns logits only for the rows asked
for (never n_ctx × n_vocab), and truncates the cache back to a prefix.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from ..errors import (
    BackendError,
    ContextLengthError,
    NonFiniteLogitsError,
    UnsupportedModelError,
)
from ..machine import cpu_model_name, usable_cpus
from ..rules.sampling import first_non_finite_row
from . import DEFAULT_N_CTX
from .devices import device_label
from .gguf import GGUFInfo, read_gguf
from .library import ensure_backend
from .vocabulary import Vocabulary, file_identity


def _decode_and_wait(ctx, batch) -> int:
    """llama_decode, then wait for the backends to finish it: on an asynchronous backend (RPC,
    CUDA, Metal) llama_decode may return before the compute ends (the wait otherwise happens when
    the logits are read), and last_decode_ms is what `auto` learns batch costs from. On the CPU
    backend the wait returns at once."""
    status = llama_cpp.llama_decode(ctx, batch)
    if status == 0:
        llama_cpp.llama_synchronize(ctx)
    return status


class _ComputeThread:
    """The one thread per process that calls llama_decode (any future llama_encode belongs here
    too: whatever runs llama.cpp's compute graph).

    llama.cpp's CPU backend, built with OpenMP (as llama-cpp-python builds it on Linux), keeps a
    team of worker threads per calling thread. Once two threads have decoded (the main thread's
    warm-up, then a server's engine thread or a TUI worker), the teams compete for the cores and
    every later decode runs at about half speed on 2 cores. Routing every decode through one thread
    keeps one team, whichever thread generates; the hand-off is negligible next to a decode.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def call(self, function: Callable, *args):
        """function(*args) on the compute thread; its result, or its exception. Anything raised
        in the caller while it waits (Ctrl-C, a signal handler's exception) is raised only once the
        call has returned, since a native call cannot be stopped and the caller must not touch the
        context while it runs; a call that had not started yet is withdrawn instead."""
        if threading.current_thread() is self._thread or sys.is_finalizing():
            return function(*args)  # no thread to hand to while the interpreter shuts down
        future: Future = Future()
        try:
            self._started_queue().put((future, function, args))
            return future.result()
        except BaseException as raised:
            if not future.cancel():  # running or done: let the native call end first
                _wait_through_interrupts(future)
            failure = None if future.cancelled() else future.exception()
            if failure is raised:
                raise  # the call's own exception
            raise raised from failure  # an interrupt while it ran (and whatever the call raised)

    def _started_queue(self) -> queue.SimpleQueue:
        """The job queue, its thread started on first use (or again in a forked child)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._serve, args=(self._jobs,), name="cactus-edge-llama", daemon=True
                )
                self._thread.start()
            return self._jobs

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            future, function, args = jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # withdrawn by its caller before it started
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # handed to the caller, who re-raises it
                future.set_exception(exc)


def _wait_through_interrupts(future: Future) -> None:
    """Wait for ``future`` to finish; a further Ctrl-C meanwhile is dropped (the first one is
    raised once the native call has returned)."""
    while True:
        try:
            wait_for([future])
            return
        except BaseException:
            continue


_COMPUTE = _ComputeThread()
if hasattr(os, "register_at_fork"):
    # A fork while another thread held the lock would leave the child's copy locked forever.
    os.register_at_fork(after_in_child=_COMPUTE._reset)


def physical_cores() -> int:
    """Physical (not hyper-threaded) cores: llama.cpp decodes fastest with one thread per core."""
    logical = usable_cpus()
    try:
        if platform.system() == "Darwin":
            for key in ("hw.perflevel0.physicalcpu", "hw.physicalcpu"):
                out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True)
                if out.returncode == 0 and out.stdout.strip().isdigit():
                    return max(1, int(out.stdout))
        with open("/proc/cpuinfo") as handle:
            cores, physical = set(), "0"
            for line in handle:
                if line.startswith("physical id"):
                    physical = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    cores.add((physical, line.split(":")[1].strip()))
        if cores:
            return max(1, min(len(cores), logical))
    except OSError:
        pass
    return logical


class Model:
    """What the engine needs of any model: its file, its vocabulary (:class:`Vocabulary`, composed,
    never inherited) and the mirror of its KV cache, ``tokens``, position by position.
    :class:`LlamaModel` runs here; ``remote.RemoteLlamaModel`` runs on RPC workers. A subclass
    provides decode, truncate, cache_range, sync_cache, reset, close, closed, and n_ctx, n_batch,
    n_threads, n_gpu_layers.

    ``foreign_tokens`` (optional) maps ids past this vocabulary to the id decoded in their place,
    for a draft whose vocabulary is smaller than its target's; the mirror keeps the original id.
    """

    def __init__(self, path: Path, info: GGUFInfo, vocabulary: Vocabulary) -> None:
        self.path, self.info, self.vocabulary = path, info, vocabulary
        self.file_identity = file_identity(path)  # as loaded: a replacement is another file
        self.vocab_size = vocabulary.vocab_size
        self.tokens: list[int] = []
        self.foreign_tokens: dict[int, int] | None = None
        self.last_decode_ms = 0.0  # time inside llama_decode during the last decode() call

    def cost_identity(self) -> dict | None:
        """What this model's batch costs depend on: the file as it was loaded, the threads, GPU
        layers and batch size, llama.cpp's build (version and compiled-in CPU features) and the
        CPU (model name, usable cores). Measured costs are kept per identity (cost_cache); None
        when the file could not be identified."""
        if self.file_identity is None:
            return None
        return {
            **self.file_identity,
            "n_threads": self.n_threads,
            "n_gpu_layers": self.n_gpu_layers,
            "n_batch": self.n_batch,
            "llama_cpp": llama_cpp.__version__,
            "build": llama_cpp.llama_print_system_info().decode(errors="replace"),
            "cpu": cpu_model_name(),
            "usable_cpus": usable_cpus(),
        }

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: llama_cpp may be gone
            self.close()

    # --- the vocabulary ------------------------------------------------------------------------

    @property
    def bos_token(self) -> int:
        return self.vocabulary.bos_token

    @property
    def add_bos(self) -> bool:
        return self.vocabulary.add_bos

    @property
    def eos_token(self) -> int:
        return self.vocabulary.eos_token

    @property
    def eot_token(self) -> int:
        return self.vocabulary.eot_token

    @property
    def chat_template(self) -> str | None:
        return self.vocabulary.chat_template

    @property
    def n_ctx_train(self) -> int:
        return self.vocabulary.n_ctx_train

    def is_end_of_generation(self, token: int) -> bool:
        return self.vocabulary.is_end_of_generation(token)

    def end_of_generation_tokens(self) -> frozenset[int]:
        return self.vocabulary.end_of_generation_tokens()

    def grammar_tokenizer(self):
        return self.vocabulary.grammar_tokenizer()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.vocabulary.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        return self.vocabulary.token_bytes(token, special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return self.vocabulary.detokenize(tokens, special=special)

    # --- the cache mirror ----------------------------------------------------------------------

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def non_finite_error(self, row: int, position: int) -> NonFiniteLogitsError:
        """The error for non-finite logits in output ``row`` at cache ``position``."""
        return NonFiniteLogitsError(
            f"llama.cpp returned non-finite logits (NaN or inf) from {self.path.name} for output "
            f"row {row} (cache position {position}); the model file or the backend is broken",
            row=row,
        )

    # --- saved states (the prompt cache) -------------------------------------------------------

    supports_saved_states = False  # a model in another process (RPC) keeps its cache there

    def state_identity(self) -> dict | None:
        return None

    def save_state(self) -> SavedState:
        """A copy of the cache's tokens and llama.cpp's state of them, for :meth:`restore_state`."""
        raise BackendError(f"{type(self).__name__} cannot save its cache")

    def restore_state(self, saved: SavedState, n_tokens: int | None = None) -> None:
        """Make the cache hold ``saved``'s first ``n_tokens`` tokens (all by default)."""
        raise BackendError(f"{type(self).__name__} cannot restore a saved cache")

    def teacher_forced(self, tokens: Sequence[int], output_rows: Sequence[int]) -> np.ndarray:
        """Logits (len(output_rows), V) of a fixed text: ``tokens`` decoded from an empty cache
        (in n_batch chunks), which is left empty again. For scoring, not for generating."""
        self.reset()
        try:
            return self.decode(tokens, output_rows=output_rows)
        finally:
            self.reset()


class LlamaModel(Model):
    """One GGUF model, one llama.cpp context, one sequence (id 0), on this machine.

    Every decode appends to ``tokens`` and :meth:`truncate` cuts it back. Tokenization and
    detokenization share no buffer with decoding, so other threads may call them while a decode
    runs. Calls after :meth:`close` raise :class:`BackendError`, never crash.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int = DEFAULT_N_CTX,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        n_batch: int = 512,
        info: GGUFInfo | None = None,
        placement: DevicePlacement | None = None,
    ) -> None:
        path = Path(path)
        info = info or read_gguf(path)  # typed errors for missing / non-GGUF / truncated
        n_ctx = _checked_context(path, info, n_ctx)
        self._model = self._ctx = self._batch = None
        self.vocabulary = None
        self._model = _load_weights(path, n_gpu_layers, placement)
        super().__init__(path, info, Vocabulary(path, self._model, owns=False))
        self.n_gpu_layers = n_gpu_layers
        self.device = device_label(n_gpu_layers)  # where the layers run, for people
        if llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model):
            self.close()
            raise UnsupportedModelError(
                f"{path.name} has recurrent memory, which cannot be rolled back to a token "
                "prefix; speculative decoding needs a transformer (KV-cache) model"
            )
        self.n_threads = n_threads or physical_cores()
        self._create_context(n_ctx, n_batch)

    def _create_context(self, n_ctx: int, n_batch: int) -> None:
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        # llama.cpp caps its batch at the requested n_ctx but may round the context itself up
        # (128 → 256): a batch sized for the rounded context would hit its native assert.
        n_batch = max(1, min(n_batch, n_ctx))
        ctx_params.n_batch = n_batch
        ctx_params.n_ubatch = n_batch
        ctx_params.n_threads = self.n_threads
        ctx_params.n_threads_batch = self.n_threads
        ctx_params.no_perf = True
        self.kv_types = (int(ctx_params.type_k), int(ctx_params.type_v))  # ggml types of the KV cache
        self._ctx = llama_cpp.llama_init_from_model(self._model, ctx_params)
        if not self._ctx:
            self.close()
            raise BackendError(f"llama.cpp could not create a context of {n_ctx} tokens for {self.path}")
        self._memory_handle = llama_cpp.llama_get_memory(self._ctx)
        # What llama.cpp allocated, not what was asked: every length check uses these.
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
        self.n_batch = min(n_batch, llama_cpp.llama_n_batch(self._ctx), llama_cpp.llama_n_ubatch(self._ctx))
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._batch_arrays = _BatchArrays(self._batch, self.n_batch)

    # --- lifecycle -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._ctx:
            raise BackendError(f"{self.path.name} is closed")

    @property
    def _memory(self):
        self._check_open()
        return self._memory_handle

    @property
    def closed(self) -> bool:
        return not self._ctx

    def close(self) -> None:
        if self.vocabulary is not None:
            self.vocabulary.close()  # first: its grammar tokenizer points into the model freed below
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    # --- decoding ------------------------------------------------------------------------------

    def decode(
        self, tokens: Sequence[int], output_rows: Sequence[int] = (-1,), *, copy: bool = True
    ) -> np.ndarray:
        """Append ``tokens`` to the sequence and return logits for the requested rows.

        output_rows: indices into ``tokens`` (negative counts from the end) whose logits are
            wanted, in the order wanted; only those rows are computed.
        copy: False returns, when the rows are consecutive in the last batch, a read-only view of
            llama.cpp's own output buffer (no copy, no finiteness check): it is valid only until
            this model's next decode, and the caller must check finiteness
            (``sampling.process_logits`` does, at no extra cost).
        Returns float32 logits, shape (len(output_rows), V).
        """
        self._check_open()
        n_new = len(tokens)
        if n_new == 0:
            raise ValueError("decode needs at least one token")
        if self.n_past + n_new > self.n_ctx:
            raise ContextLengthError(
                f"context full: {self.n_past} + {n_new} tokens exceed n_ctx {self.n_ctx}"
            )
        wanted = [row % n_new for row in output_rows]
        self.last_decode_ms = 0.0
        last_start = (n_new - 1) // self.n_batch * self.n_batch
        consecutive = wanted == list(range(wanted[0], wanted[0] + len(wanted))) if wanted else False
        if not copy and consecutive and wanted[0] >= last_start:
            return self._decode_to_view(tokens, [row - last_start for row in wanted], last_start)
        logits = np.empty((len(wanted), self.vocab_size), dtype=np.float32)
        for start in range(0, n_new, self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            chunk_rows = {row - start: i for i, row in enumerate(wanted) if start <= row < start + len(chunk)}
            self._decode_chunk(chunk, chunk_rows)
            for batch_index, out_index in chunk_rows.items():
                logits[out_index] = self._rows_at(self._row_pointer(batch_index), 1)[0]
        self._check_finite(logits, [self.n_past - n_new + row for row in wanted])
        return logits

    def _decode_to_view(self, tokens: Sequence[int], last_rows: list[int], last_start: int) -> np.ndarray:
        for start in range(0, last_start, self.n_batch):
            self._decode_chunk(tokens[start : start + self.n_batch], ())
        self._decode_chunk(tokens[last_start:], last_rows)
        view = self._output_view(last_rows[0], len(last_rows))
        if view is not None:
            return view
        return np.concatenate([self._rows_at(self._row_pointer(row), 1) for row in last_rows])

    def _row_pointer(self, batch_index: int) -> int:
        pointer = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not pointer:
            raise BackendError(f"llama.cpp returned no logits for batch row {batch_index}")
        return ctypes.cast(pointer, ctypes.c_void_p).value

    def _output_view(self, first: int, n_rows: int) -> np.ndarray | None:
        """Rows first..first+n_rows-1 of the last batch as one view, if llama.cpp stores them
        back to back (it does for one sequence; checked, never assumed)."""
        address = self._row_pointer(first)
        row_bytes = self.vocab_size * 4
        if n_rows > 1 and self._row_pointer(first + n_rows - 1) != address + (n_rows - 1) * row_bytes:
            return None
        view = self._rows_at(address, n_rows)
        view.flags.writeable = False
        return view

    def _rows_at(self, address: int, n_rows: int) -> np.ndarray:
        """A view (n_rows, V) of float32 logits at ``address`` in llama.cpp's output buffer."""
        buffer = (ctypes.c_float * (n_rows * self.vocab_size)).from_address(address)
        return np.frombuffer(buffer, dtype=np.float32).reshape(n_rows, self.vocab_size)

    def _check_finite(self, logits: np.ndarray, positions: list[int]) -> None:
        """A NaN anywhere makes the row's max NaN, +inf makes it inf; a row of -inf is dead too."""
        if not logits.size:
            return
        row = first_non_finite_row(logits.max(axis=1))
        if row is not None:
            raise self.non_finite_error(row, positions[row])

    def _decode_chunk(self, chunk: Sequence[int], output_rows) -> None:
        """One llama_decode of ``chunk`` at the end of the sequence; ``output_rows`` holds the
        chunk indices that need logits. The batch arrays are filled by numpy, not per token."""
        position = self.n_past
        fed = self._fed_ids(chunk)
        self._batch_arrays.fill(fed, position, output_rows)
        self._batch.n_tokens = len(fed)
        start = time.perf_counter()
        try:
            status = _COMPUTE.call(_decode_and_wait, self._ctx, self._batch)
        except BaseException:
            # Interrupted (the decode has ended: call waits for it) or failed: the mirror was not
            # extended, so drop whatever the decode added. If even that fails, the next
            # generation's sync_cache repairs it; the interrupt is what the caller must see.
            with contextlib.suppress(BackendError):
                self._remove_from(position)
            raise
        self.last_decode_ms += (time.perf_counter() - start) * 1000
        if status != 0:
            # On failure llama.cpp may keep some processed ubatches: cut back to what we know.
            self._remove_from(position)
            if status == 1:
                raise ContextLengthError("no room left in the KV cache for this batch")
            raise BackendError(f"llama_decode failed with status {status}")
        self.tokens.extend(int(t) for t in chunk)

    def _fed_ids(self, chunk: Sequence[int]) -> np.ndarray:
        """The ids llama.cpp decodes for ``chunk`` (foreign ids mapped), int32 (n,)."""
        ids = np.asarray(chunk, dtype=np.int64)
        if ids.size and ids.min() >= 0 and ids.max() < self.vocab_size:
            return ids.astype(np.int32)
        return np.array([self._fed_id(int(t)) for t in ids], dtype=np.int32)

    def _fed_id(self, token: int) -> int:
        if 0 <= token < self.vocab_size:
            return token
        if self.foreign_tokens is not None and self.vocab_size <= token:
            return self.foreign_tokens[token]
        raise ValueError(f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})")

    def truncate(self, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` tokens of the cache (rollback after rejection)."""
        if not 0 <= n_tokens <= self.n_past:
            raise ValueError(f"cannot truncate to {n_tokens}: the cache holds {self.n_past} tokens")
        if n_tokens < self.n_past:
            self._remove_from(n_tokens)
            del self.tokens[n_tokens:]

    def _remove_from(self, position: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(self._memory, 0, position, -1):
            raise BackendError(
                f"llama.cpp could not remove cached positions {position}.. of {self.path.name}"
            )

    def cache_range(self) -> tuple[int, int]:
        """llama.cpp's own view of the cache: (lowest, highest) position held, (-1, -1) if empty."""
        self._check_open()
        return (
            int(llama_cpp.llama_memory_seq_pos_min(self._memory, 0)),
            int(llama_cpp.llama_memory_seq_pos_max(self._memory, 0)),
        )

    def sync_cache(self) -> None:
        """Make llama.cpp hold exactly the mirrored tokens: drop any position past them (an
        interrupt between a decode and the mirror update leaves such positions), and shorten the
        mirror if llama.cpp holds fewer."""
        self._remove_from(self.n_past)
        low, high = self.cache_range()
        if high + 1 < self.n_past or (self.n_past and low != 0):
            self.reset()

    def reset(self) -> None:
        self._check_open()
        llama_cpp.llama_memory_clear(self._memory, True)
        self.tokens.clear()

    # --- saved states --------------------------------------------------------------------------

    supports_saved_states = True

    def state_identity(self) -> dict | None:
        """What a saved state of this model is valid for: the file as loaded, llama.cpp's version,
        the context size and the KV cache's types (None when the file could not be identified)."""
        if self.file_identity is None:
            return None
        return {
            **self.file_identity,
            "llama_cpp": llama_cpp.__version__,
            "n_ctx": self.n_ctx,
            "kv_types": list(self.kv_types),
        }

    def save_state(self) -> SavedState:
        """llama.cpp's serialized state of sequence 0 (its KV cells), with the tokens they hold."""
        self._check_open()
        size = llama_cpp.llama_state_seq_get_size(self._ctx, 0)
        if not size:
            raise BackendError(f"llama.cpp could not save the cache of {self.path.name}")
        data = state_buffer(size)
        written = llama_cpp.llama_state_seq_get_data(self._ctx, _c_bytes(data), size, 0)
        if written != size:
            raise BackendError(f"llama.cpp could not save the cache of {self.path.name}")
        return SavedState(tuple(self.tokens), data)

    def restore_state(self, saved: SavedState, n_tokens: int | None = None) -> None:
        """Replace the cache by ``saved``, cut to its first ``n_tokens`` tokens; then check, as
        :meth:`sync_cache` does, that llama.cpp holds exactly those positions. On any failure the
        cache is left empty (consistent) and BackendError is raised."""
        self._check_open()
        n_tokens = len(saved.tokens) if n_tokens is None else n_tokens
        if not 0 < n_tokens <= len(saved.tokens):
            raise ValueError(f"cannot restore {n_tokens} of {len(saved.tokens)} saved tokens")
        self.tokens.clear()  # whatever happens next, the mirror never claims the old text
        size = len(saved.data)
        if llama_cpp.llama_state_seq_set_data(self._ctx, _c_bytes(saved.data), size, 0) != size:
            self.reset()
            raise BackendError(f"llama.cpp refused a saved cache for {self.path.name}")
        self.tokens.extend(saved.tokens)
        try:
            self.truncate(n_tokens)
            if self.cache_range() != (0, n_tokens - 1):
                raise BackendError(
                    f"a restored cache of {self.path.name} holds positions {self.cache_range()}, "
                    f"not 0..{n_tokens - 1}"
                )
        except BaseException:
            self.reset()
            raise


@dataclass(frozen=True, eq=False)
class SavedState:
    """One model's cache as llama.cpp serializes it: ``tokens`` (positions 0..n-1) and ``data``,
    valid only for a context of the same model file, llama.cpp build and KV types."""

    tokens: tuple[int, ...]
    data: bytearray | mmap.mmap

    @property
    def n_bytes(self) -> int:
        return len(self.data)


def state_buffer(size: int) -> mmap.mmap:
    """A writable buffer of ``size`` bytes for a saved state, mapped on its own: freed, it goes back
    to the system at once (tens of MB from the allocator's heap would stay in the process)."""
    return mmap.mmap(-1, size)


def _c_bytes(data: bytearray | mmap.mmap):
    """A ctypes view (no copy) of ``data`` for llama.cpp's uint8_t* parameters."""
    return (ctypes.c_uint8 * len(data)).from_buffer(data)


def _checked_context(path: Path, info: GGUFInfo, n_ctx: int) -> int:
    """The context to ask for: the trained length for 0; refused past it (a model degrades
    silently beyond its trained window)."""
    trained = info.context_length
    if n_ctx <= 0:
        n_ctx = trained or DEFAULT_N_CTX
    if trained and n_ctx > trained:
        raise ContextLengthError(
            f"n_ctx {n_ctx} exceeds {path.name}'s trained context of {trained} tokens; "
            f"use --n-ctx {trained} or less"
        )
    return n_ctx


def _load_weights(path: Path, n_gpu_layers: int, placement: DevicePlacement | None):
    """A ``llama_model*`` with its weights, ``n_gpu_layers`` offloaded, placed as ``placement`` says."""
    ensure_backend()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = n_gpu_layers
    keep_alive = placement.apply(model_params) if placement else ()
    handle = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    del keep_alive  # llama.cpp copies devices and split while loading
    if not handle:
        raise BackendError(f"llama.cpp could not load {path} (run with --verbose for details)")
    return handle


@dataclass(frozen=True)
class DevicePlacement:
    """Where a model's layers go, past llama.cpp's defaults: ``devices`` (ggml device pointers;
    llama.cpp splits the offloaded layers across them), ``tensor_split`` (each device's share, as
    ``--tensor-split``; empty: in proportion to their free memory) and ``on_progress`` (called
    with 0..1 while loading; returning False aborts the load)."""

    devices: tuple[int, ...] = ()
    tensor_split: tuple[float, ...] = ()
    on_progress: Callable[[float], bool] | None = None

    def apply(self, model_params) -> tuple:
        """Set these on ``model_params``; returns the ctypes objects that must outlive the load."""
        alive: list = []
        if self.devices:
            devices = (ctypes.c_void_p * (len(self.devices) + 1))(*self.devices, None)
            model_params.devices = ctypes.cast(devices, ctypes.c_void_p)
            alive.append(devices)
        if self.tensor_split:
            split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*self.tensor_split)
            model_params.tensor_split = split
            alive.append(split)
        if self.on_progress is not None:
            report = self.on_progress
            callback = llama_cpp.llama_progress_callback(lambda fraction, _data: bool(report(fraction)))
            model_params.progress_callback = callback
            alive.append(callback)
        return tuple(alive)


class _BatchArrays:
    """numpy views over a llama_batch's arrays: filling a block of k + 1 tokens is a few slice
    assignments instead of 5 ctypes writes per token. One sequence (id 0), set once."""

    def __init__(self, batch, capacity: int) -> None:
        self.batch = batch
        self.token = np.ctypeslib.as_array(batch.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(batch.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(batch.logits, shape=(capacity,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(capacity,))[:] = 1
        for i in range(capacity):
            batch.seq_id[i][0] = 0

    def fill(self, ids: np.ndarray, position: int, output_rows) -> None:
        n_tokens = len(ids)
        self.token[:n_tokens] = ids
        self.pos[:n_tokens] = np.arange(position, position + n_tokens)
        self.logits[:n_tokens] = 0
        self.logits[list(output_rows)] = 1


class Detokenizer:
    """Token ids → text, one token at a time, never emitting half a UTF-8 character: bytes of an
    unfinished character wait for the next token (byte-fallback and BPE vocabularies split them)."""

    def __init__(self, model: LlamaModel, *, special: bool = False) -> None:
        import codecs

        self._model = model
        self._special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._decoder.decode(self._model.token_bytes(token, special=self._special))

    def flush(self) -> str:
        """Whatever is pending (an unfinished character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


# --- quantization ----------------------------------------------------------------------------------


def quantize_gguf(
    src: str | os.PathLike, dst: str | os.PathLike, ftype_name: str, n_threads: int | None = None
) -> None:
    """Write ``src`` re-quantized to ``ftype_name`` ("q4_0", "q4_k_m", "f16", …: the lowercase tail
    of llama.cpp's LLAMA_FTYPE_MOSTLY_* names) into ``dst`` with llama.cpp's own quantizer, so the
    file holds exactly the tensor types llama.cpp chooses for that type (norms stay F32; a tensor
    whose rows do not fit the type's blocks falls back to a type that fits). Re-quantizing an
    already quantized source is allowed: the caller asked for it. ``src`` is only read. ``dst`` is
    written in place: making that atomic is the caller's job."""
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name.upper()}", None)
    if ftype is None:
        raise BackendError(f"this llama.cpp has no quantization type {ftype_name!r}")
    ensure_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = n_threads or physical_cores()
    status = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if status != 0:
        raise BackendError(
            f"llama.cpp could not quantize {Path(src).name} to {ftype_name.upper()} (status {status}; "
            "run with --verbose for its log)"
        )
