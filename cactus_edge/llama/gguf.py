"""Reading GGUF metadata without loading weights: model facts for `models inspect`, early detection
of non-GGUF and truncated files, and the draft/target tokenizer compatibility check.

A small streaming parser of our own: gguf.GGUFReader materialises every array element as a numpy
view, which is slow on a large vocabulary; this reads the same header without doing so.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ..errors import IncompatiblePairError, InvalidModelFileError, ModelNotFoundError

# llama.cpp's own speculative-decoding check: tolerate this much vocabulary padding and ignore the
# first few (control) ids, which fine-tunes often rename.
VOCAB_SIZE_TOLERANCE = 128
FIRST_COMPARED_TOKEN_ID = 5

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_SKIPPED_ARRAYS = {"tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}


@dataclass
class GGUFInfo:
    """What a GGUF header says. ``tokens`` is only filled when asked for."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensor_types: Counter = field(default_factory=Counter)
    n_params: int = 0
    tokens: list[str] | None = None
    n_tokens: int = 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", "unknown"))

    @property
    def name(self) -> str:
        return str(self.get("general.name", self.path.stem))

    @property
    def context_length(self) -> int | None:
        return self.get(f"{self.architecture}.context_length")

    @property
    def vocab_size(self) -> int:
        return self.n_tokens

    @property
    def chat_template(self) -> str | None:
        return self.get("tokenizer.chat_template")

    @property
    def tokenizer_model(self) -> str | None:
        return self.get("tokenizer.ggml.model")

    @property
    def quantization(self) -> str:
        file_type = self.get("general.file_type")
        if file_type is not None:
            try:
                return LlamaFileType(file_type).name.removeprefix("MOSTLY_")
            except ValueError:
                pass
        if not self.tensor_types:
            return "unknown"
        return self.tensor_types.most_common(1)[0][0]


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.offset, self.path = buffer, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buffer):
            raise InvalidModelFileError(f"{self.path}: truncated GGUF header (ends inside the metadata)")
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise InvalidModelFileError(f"{self.path}: truncated GGUF header (ends inside a string)")
        text = bytes(self.buffer[self.offset : end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_string(self) -> None:
        length = self.take("<Q")  # read before adding: take() moves the offset itself
        self.offset += length

    def value(self, kind: int, keep: bool = True) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string() if keep else self.skip_string()
        if kind == _ARRAY:
            item_kind, count = self.take("<I"), self.take("<Q")
            if item_kind in _SCALARS and not keep:
                self.offset += struct.calcsize(_SCALARS[item_kind]) * count
                return count
            items = [self.value(item_kind, keep) for _ in range(count)]
            return items if keep else count
        raise InvalidModelFileError(f"{self.path}: unknown GGUF value type {kind}")


def read_gguf(path: str | os.PathLike, *, tokens: bool = False) -> GGUFInfo:
    """Parse a GGUF header. Raises ModelNotFoundError or InvalidModelFileError (not GGUF,
    truncated header, tensor data past the end of the file)."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise InvalidModelFileError(f"{path}: not a GGUF file (bad magic bytes)")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return _parse(_Cursor(view, path), path, size, tokens)
            finally:
                view.release()


def _parse(cursor: _Cursor, path: Path, file_size: int, want_tokens: bool) -> GGUFInfo:
    cursor.offset = 4
    version = cursor.take("<I")
    if version < 2:
        raise InvalidModelFileError(f"{path}: GGUF version {version} is too old (need 2 or later)")
    tensor_count, kv_count = cursor.take("<Q"), cursor.take("<Q")
    metadata: dict[str, Any] = {}
    token_list: list[str] | None = None
    n_tokens = 0
    for _ in range(kv_count):
        key = cursor.string()
        kind = cursor.take("<I")
        if key == "tokenizer.ggml.tokens":
            value = cursor.value(kind, keep=want_tokens)
            token_list = value if want_tokens else None
            n_tokens = len(value) if want_tokens else value
        else:
            metadata[key] = cursor.value(kind, keep=key not in _SKIPPED_ARRAYS)
    info = GGUFInfo(path, version, metadata, tokens=token_list, n_tokens=n_tokens)
    data_sizes = []
    for _ in range(tensor_count):
        cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        type_id, offset = cursor.take("<I"), cursor.take("<Q")
        n_elements = 1
        for dim in dims:
            n_elements *= dim
        info.n_params += n_elements
        try:
            quant = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[quant]
            info.tensor_types[quant.name] += 1
            data_sizes.append(offset + n_elements // block * type_size)
        except (ValueError, KeyError):  # a type newer than our gguf package: cannot bound it
            info.tensor_types[f"type{type_id}"] += 1
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.offset // alignment) * alignment
    data_end = data_start + max(data_sizes, default=0)
    if data_end > file_size:
        raise InvalidModelFileError(
            f"{path}: truncated GGUF: tensor data ends at byte {data_end:,} but the file has "
            f"{file_size:,} bytes"
        )
    return info


def check_pair_compatible(draft: GGUFInfo, target: GGUFInfo) -> None:
    """Raise IncompatiblePairError unless draft tokens mean the same thing to the target.

    Both infos must have been read with ``tokens=True``.
    """
    names = f"draft {draft.path.name} / target {target.path.name}"
    if draft.tokenizer_model != target.tokenizer_model:
        raise IncompatiblePairError(
            f"{names}: different tokenizer types ({draft.tokenizer_model} vs {target.tokenizer_model})"
        )
    if abs(draft.vocab_size - target.vocab_size) > VOCAB_SIZE_TOLERANCE:
        raise IncompatiblePairError(
            f"{names}: vocabulary sizes differ by more than {VOCAB_SIZE_TOLERANCE} "
            f"({draft.vocab_size} vs {target.vocab_size})"
        )
    for special in ("bos", "eos"):
        adds = (
            draft.get(f"tokenizer.ggml.add_{special}_token"),
            target.get(f"tokenizer.ggml.add_{special}_token"),
        )
        if adds[0] != adds[1]:
            raise IncompatiblePairError(f"{names}: one adds a {special.upper()} token, the other not")
        ids = (
            draft.get(f"tokenizer.ggml.{special}_token_id"),
            target.get(f"tokenizer.ggml.{special}_token_id"),
        )
        if adds[0] and ids[0] != ids[1]:
            raise IncompatiblePairError(f"{names}: {special.upper()} ids differ ({ids[0]} vs {ids[1]})")
    assert draft.tokens is not None and target.tokens is not None, "read with tokens=True"
    shared = min(len(draft.tokens), len(target.tokens))
    for token_id in range(FIRST_COMPARED_TOKEN_ID, shared):
        if draft.tokens[token_id] != target.tokens[token_id]:
            raise IncompatiblePairError(
                f"{names}: token {token_id} differs: draft {draft.tokens[token_id]!r}, "
                f"target {target.tokens[token_id]!r}"
            )
