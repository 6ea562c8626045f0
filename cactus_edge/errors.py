"""Typed exceptions of the library. The CLI turns each into a one-line message and an exit code."""

from __future__ import annotations


class CactusEdgeError(Exception):
    """Base class of every error cactus-edge raises on purpose."""

    exit_code = 1


class InvalidSettingError(CactusEdgeError, ValueError):
    """A generation setting out of range or of the wrong type; the message names the parameter."""

    exit_code = 2

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidTextError(InvalidSettingError):
    """Text that is not valid Unicode (a lone surrogate): it cannot be encoded for the tokenizer."""


class UnsupportedParameterError(InvalidSettingError):
    """An OpenAI request parameter that would change the meaning of the request if it were
    ignored (``n > 1``, ``logprobs``, ``tools``, …); ``param`` names it."""


class MissingDependencyError(CactusEdgeError):
    """An optional extra that this command needs is not installed; the message says which."""

    exit_code = 2


class IncompatibleDependencyError(CactusEdgeError):
    """An installed dependency lacks an internal name cactus-edge relies on (a version outside the
    tested range); the message names the package, what is missing and the tested version."""

    exit_code = 2


class ModelNotFoundError(CactusEdgeError):
    """A model path that does not exist."""

    exit_code = 2


class UnknownModelError(CactusEdgeError):
    """A name that is neither a registered model or pair nor an existing file."""

    exit_code = 2


class ModelNotFetchedError(CactusEdgeError):
    """A registered model whose file has not been fetched yet."""

    exit_code = 2


class LocalRegistryError(CactusEdgeError):
    """The models directory's local registry (models made by `models quantize`) cannot be read, or
    names a model or pair that the packaged registry already has."""

    exit_code = 2


class NameTakenError(CactusEdgeError):
    """A name, or file, chosen for a new local model or pair that something else already uses."""

    exit_code = 2


class InvalidModelFileError(CactusEdgeError):
    """A file that is not a GGUF model, or a truncated or corrupt one."""

    exit_code = 3


class IncompatiblePairError(CactusEdgeError):
    """Draft and target do not share a tokenizer, so draft tokens mean nothing to the target."""

    exit_code = 3


class UnsupportedModelError(CactusEdgeError):
    """A model llama.cpp can load but speculative decoding cannot drive (e.g. recurrent memory)."""

    exit_code = 3


class ContextLengthError(CactusEdgeError):
    """A prompt or a requested context that does not fit the model's context window."""

    exit_code = 4


class CacheFolderError(CactusEdgeError):
    """A prompt cache folder that cannot be created or written (said at start, never mid-request)."""

    exit_code = 2


class FetchError(CactusEdgeError):
    """Downloading or assembling a model failed; nothing was left under the final name."""

    exit_code = 5


class IntegrityError(FetchError):
    """An assembled or stored model does not match its registered size or sha256."""


class PinMismatchError(IntegrityError):
    """A pinned model's file no longer holds the bytes its pin records (changed or corrupted since
    its fetch): ``path`` is the file, ``expected`` and ``actual`` the pinned and the found ``field``
    ("size" or "sha256")."""

    def __init__(self, message: str, path: str, field: str, expected: str | int, actual: str | int) -> None:
        super().__init__(message)
        self.path, self.field, self.expected, self.actual = path, field, expected, actual


class BackendError(CactusEdgeError):
    """llama.cpp refused an operation (load, decode, cache truncation)."""

    exit_code = 6


class NonFiniteLogitsError(BackendError):
    """llama.cpp returned NaN or infinite logits (a broken model file or backend); the message
    names the model and the row. ``row`` is the output row (found while processing logits, which
    is where a NaN is seen anyway; the engine then names the model and cache position)."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message)
        self.row = row


class EngineBusy(CactusEdgeError):
    """The engine is generating for another caller and did not become free within the timeout,
    or this thread already holds an open stream of the same engine."""

    exit_code = 7


class EngineClosedError(CactusEdgeError):
    """The engine was closed; its models are freed."""

    exit_code = 6


class GrammarStateError(CactusEdgeError):
    """A grammar could not follow the reply (it refused a token, failed a mask, or could not roll
    back): a bug or a grammar past llguidance's limits, never silently unconstrained output."""


class RPCUnavailableError(CactusEdgeError):
    """This llama-cpp-python was built without ggml's RPC backend (`--rpc`, `cactus-edge worker`)."""

    exit_code = 2


class WorkerLostError(BackendError):
    """An RPC worker that holds part of the target is absent, died, stopped answering, or speaks
    another protocol version. ``endpoint`` names it ("host:port"; None when it could not be told
    which). The model process was stopped and the caches emptied; the next request reconnects."""

    exit_code = 8

    def __init__(self, message: str, endpoint: str | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
