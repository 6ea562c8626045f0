"""A model's vocabulary over a llama.cpp model handle: tokenizing, detokenizing, the special and
end-of-generation tokens, the chat template, and llguidance's tokenizer built on it. Shared by a
local model and a model whose weights live elsewhere (a vocabulary-only load)."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import llama_cpp

from ..errors import BackendError, InvalidTextError
from .library import ensure_backend


def encode_text(text: str, param: str = "prompt") -> bytes:
    """UTF-8 bytes of ``text``; a lone surrogate (not Unicode, so not encodable) is a setting error
    naming ``param``, never an internal one."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidTextError(
            f"{param} is not valid Unicode: a lone surrogate {text[error.start]!r} at character "
            f"{error.start}",
            param=param,
        ) from None


def file_identity(path: Path) -> dict | None:
    """The file as it is now (resolved path, size, mtime): a replacement is another file."""
    try:
        stat = path.stat()
        return {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    except OSError:
        return None


class Vocabulary:
    """The vocabulary of the llama.cpp model ``handle`` (a ``llama_model*``). ``owns``: free the
    handle on :meth:`close` (a vocabulary-only load); otherwise its model frees it after closing
    this. Calls after close raise :class:`BackendError`, never crash."""

    def __init__(self, path: Path, handle, *, owns: bool) -> None:
        self.path, self._model, self._owns = path, handle, owns
        self._vocab_handle = llama_cpp.llama_model_get_vocab(handle)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(self._vocab_handle)
        self._grammar_tokenizer = None
        self._grammar_lock = threading.Lock()
        self._end_tokens: frozenset[int] | None = None

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        """``path``'s vocabulary and metadata alone: no weights, no context."""
        ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        handle = llama_cpp.llama_model_load_from_file(os.fsencode(path), params)
        if not handle:
            raise BackendError(f"llama.cpp could not read the vocabulary of {path}")
        return cls(path, handle, owns=True)

    def close(self) -> None:
        self._grammar_tokenizer = None  # it points into the vocabulary
        handle, self._model = self._model, None
        if handle and self._owns:
            llama_cpp.llama_model_free(handle)

    @property
    def closed(self) -> bool:
        return not self._model

    def _check_open(self) -> None:
        if not self._model:
            raise BackendError(f"{self.path.name} is closed")

    @property
    def _vocab(self):
        """The vocabulary pointer, refused once closed (it points into the freed model)."""
        self._check_open()
        return self._vocab_handle

    @property
    def bos_token(self) -> int:
        return llama_cpp.llama_vocab_bos(self._vocab)

    @property
    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

    @property
    def eos_token(self) -> int:
        return llama_cpp.llama_vocab_eos(self._vocab)

    @property
    def eot_token(self) -> int:
        return llama_cpp.llama_vocab_eot(self._vocab)

    def is_end_of_generation(self, token: int) -> bool:
        """EOS, EOT and every other end-of-generation token the GGUF declares."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @property
    def chat_template(self) -> str | None:
        self._check_open()
        template = llama_cpp.llama_model_chat_template(self._model, None)
        return template.decode("utf-8") if template else None

    @property
    def n_ctx_train(self) -> int:
        self._check_open()
        return llama_cpp.llama_model_n_ctx_train(self._model)

    def end_of_generation_tokens(self) -> frozenset[int]:
        """Every id llama.cpp counts as end of generation (EOS, EOT, <|im_end|>, …); computed once."""
        if self._end_tokens is None:
            vocab = self._vocab
            self._end_tokens = frozenset(
                t for t in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, t)
            )
        return self._end_tokens

    def grammar_tokenizer(self):
        """llguidance's tokenizer over this vocabulary, built on first use (about a second for
        150k tokens) and kept as long as the model: it calls llama.cpp's tokenizer on this
        vocabulary, so it must not outlive it. Every end-of-generation id is its end of text."""
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab

                eog = sorted(self.end_of_generation_tokens()) or [self.eos_token]
                self._grammar_tokenizer = lltokenizer_from_vocab(self._vocab, eos_token=eog)
            return self._grammar_tokenizer

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text → token ids. ``add_special`` adds BOS when the GGUF asks for it; ``parse_special``
        turns control-token text (e.g. ``<|im_start|>``) into its token."""
        self._check_open()
        data = encode_text(text)
        capacity = len(data) + 8
        buffer = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(
            self._vocab, data, len(data), buffer, capacity, add_special, parse_special
        )
        if count < 0:  # buffer too small: llama.cpp says how many it needs
            capacity = -count
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(
                self._vocab, data, len(data), buffer, capacity, add_special, parse_special
            )
        if count < 0:
            raise BackendError(f"tokenization failed for a text of {len(data)} bytes")
        return list(buffer[:count])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character). The buffer is local to
        the call: ctypes releases the GIL, so a shared one would race between threads."""
        self._check_open()
        buffer = ctypes.create_string_buffer(64)
        length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        if length < 0:
            buffer = ctypes.create_string_buffer(-length)
            length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, special)
        return buffer.raw[:length]

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special=special) for t in tokens).decode(
            "utf-8", errors="replace"
        )
