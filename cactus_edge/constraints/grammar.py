"""Grammars that constrain a reply: JSON schemas, Lark grammars and regexes, through llguidance.

llguidance is what llama.cpp, vLLM and SGLang use: it has no required dependencies, compiles a
grammar against a tokenizer once, and gives a token mask per position, unlimited rollback and the
tokens a grammar forces (fast-forward tokens, kept canonical). This module imports no llama.cpp:
the tokenizer it needs comes from :meth:`cactus_edge.llama.model.LlamaModel.grammar_tokenizer`.

Two stages, so a bad grammar is refused before a request takes a queue place:
- :func:`grammar_source` turns the request's ``json_schema`` / ``grammar`` / ``regex`` into
  llguidance's grammar text and validates it without a tokenizer (cached, bounded);
- :class:`CompiledGrammars` compiles it against one model's tokenizer (cached per engine,
  bounded) and hands out a fresh :class:`GrammarMatcher` per reply.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from types import MappingProxyType

import llguidance
import numpy as np

from ..errors import GrammarStateError, InvalidSettingError

__all__ = [
    "CompiledGrammars",
    "GrammarMatcher",
    "TokenMask",
    "grammar_source",
    "parse_json_schema",
    "PARSER_LIMITS",
]

# llguidance's own resource limits bound a pathological grammar (its lexer fuel and Earley items
# per mask); these are its defaults, named here so the bound is visible.
PARSER_LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=500_000)
MAX_CACHED_SOURCES = 256
# How constrained JSON is laid out: Python's json.dumps separators and no other whitespace, the
# layout models write most (and our tool calls use). With no whitespace to choose, keys and
# separators are forced tokens (free drafts), a reply takes fewer tokens than with a space or an
# indented newline allowed between tokens, and a small model cannot loop on blank lines. Compact
# "," / ":" is fewer tokens still, but the default model wrote worse values under it
# (docs/performance.md, "JSON layout").
JSON_LAYOUT = MappingProxyType({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
# A schema whose own top-level "x-guidance" sets either of these chooses its whitespace itself.
_WHITESPACE_KEYS = frozenset({"whitespace_flexible", "whitespace_pattern"})
# Unsupported keywords are an error (never silently unconstrained output), whatever the schema says.
JSON_OPTIONS = {"lenient": False}
MAX_COMPILED_PER_ENGINE = 32
logger = logging.getLogger("cactus_edge.constraints.grammar")


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)


def parse_json_schema(schema, param: str = "json_schema") -> str:
    """A JSON schema as compact JSON text: a dict, or text holding a JSON object (True, or the
    empty dict: any JSON object). Raises InvalidSettingError naming ``param``."""
    if schema is True:
        schema = {"type": "object"}
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise InvalidSettingError(f"{param} is not valid JSON: {error}", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidSettingError(
            f"{param} must be a JSON object (a schema), got {schema!r:.80}", param=param
        )
    # Key order is kept: a schema's property order is the order the object is written in.
    return json.dumps(schema or {"type": "object"}, separators=(",", ":"))


def grammar_source(json_schema: str | None, lark: str | None, regex: str | None) -> str | None:
    """llguidance's grammar text for at most one of the three (None when all are None), checked
    without a tokenizer. json_schema: compact JSON text (:func:`parse_json_schema`). An invalid or
    unsupported grammar raises InvalidSettingError naming the field, with llguidance's message."""
    given = [
        (name, text) for name, text in (("json_schema", json_schema), ("grammar", lark), ("regex", regex))
    ]
    given = [(name, text) for name, text in given if text is not None]
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise InvalidSettingError(f"give one constraint, not {names}", param=given[1][0])
    name, text = given[0]
    if not isinstance(text, str) or not text:
        raise InvalidSettingError(f"{name} must be a non-empty string", param=name)
    return _checked_source(name, text)


@lru_cache(maxsize=MAX_CACHED_SOURCES)
def _checked_source(name: str, text: str) -> str:
    try:
        if name == "json_schema":
            source = llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults=_layout(text), overrides=JSON_OPTIONS
            )
        elif name == "grammar":
            source = llguidance.LLMatcher.grammar_from_lark(text)
        else:
            source = llguidance.LLMatcher.grammar_from_regex(text)
    except (ValueError, TypeError) as error:
        raise InvalidSettingError(f"invalid {name}: {error}", param=name) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, None, limits=_limits())
    if is_error:
        raise InvalidSettingError(f"invalid {name}: {_short(messages[0])}", param=name)
    unsupported = [m for m in messages if "unsupported" in m.lower() or "unknown" in m.lower()]
    if unsupported:
        raise InvalidSettingError(f"unsupported {name} feature: {_short(unsupported[0])}", param=name)
    return source


def _layout(schema_text: str) -> dict | None:
    """Our layout where the schema's x-guidance does not say (llguidance merges it key by key), or
    none where the schema chooses its own whitespace: our separators, kept, would refuse the
    newlines it asked for (llguidance's flexible whitespace is unbounded; max_tokens bounds it)."""
    schema = json.loads(schema_text)
    given = schema.get("x-guidance") if isinstance(schema, dict) else None
    if isinstance(given, dict) and _WHITESPACE_KEYS & given.keys():
        return None
    return dict(JSON_LAYOUT)


def _short(message: str, limit: int = 400) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= limit else message[: limit - 1] + "…"


class CompiledGrammars:
    """Grammars compiled against one tokenizer, least recently used dropped past
    MAX_COMPILED_PER_ENGINE. A compiled grammar is a matcher prototype: each reply gets a deep
    copy (cheap), so compiling is paid once per grammar, not per request.

    What compiling cost is kept: ``tokenizer_ms`` (building llguidance's tokenizer index, once per
    model; None before the first compile) and ``compile_ms`` (each cached grammar's compile), and
    each compile is logged at INFO on ``cactus_edge.constraints.grammar``."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], vocab_size: int) -> None:
        # The tokenizer is built on first use (about a second for a 150k vocabulary).
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._prototypes: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.compile_ms: dict[str, float] = {}  # per cached source
        self.tokenizer_ms: float | None = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Build the tokenizer index now (once). llguidance holds the GIL for much of that build,
        which would stall a server's event loop under the first structured request; compiling a
        grammar releases it."""
        with self._lock:
            self._built_tokenizer()

    def _built_tokenizer(self) -> llguidance.LLTokenizer:
        start = time.perf_counter()
        tokenizer = self._tokenizer()
        if self.tokenizer_ms is None:
            self.tokenizer_ms = (time.perf_counter() - start) * 1000
            logger.info("built the grammar tokenizer index in %.0f ms", self.tokenizer_ms)
        return tokenizer

    def matcher(self, source: str, param: str = "grammar") -> GrammarMatcher:
        """A fresh matcher for one reply (nothing consumed)."""
        with self._lock:
            prototype = self._prototypes.get(source)
            if prototype is None:
                prototype = self._compile(source, param)
                self._prototypes[source] = prototype
                while len(self._prototypes) > MAX_COMPILED_PER_ENGINE:
                    dropped, _ = self._prototypes.popitem(last=False)
                    self.compile_ms.pop(dropped, None)
            self._prototypes.move_to_end(source)
        return GrammarMatcher(prototype.deep_copy(), self.vocab_size)

    def _compile(self, source: str, param: str) -> llguidance.LLMatcher:
        tokenizer = self._built_tokenizer()
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=_limits())
        compile_ms = (time.perf_counter() - start) * 1000
        if matcher.is_error():
            raise InvalidSettingError(f"invalid {param}: {_short(matcher.get_error())}", param=param)
        self.compile_ms[source] = compile_ms
        logger.info("compiled a grammar from %s (%d characters) in %.1f ms", param, len(source), compile_ms)
        return matcher


class GrammarMatcher:
    """One reply's grammar state: the tokens it has consumed, the mask of the next position, the
    tokens it forces next, rollback. Any end-of-generation token of the model counts as the
    grammar's end of text (the tokenizer was built with all of them as EOS)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher, self.vocab_size = matcher, vocab_size
        self.consumed: list[int] = []

    def mask(self) -> TokenMask:
        """The tokens the grammar allows after the consumed ones."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        self._check()
        return TokenMask(bits, self.vocab_size)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens), [] if none."""
        # Not compute_ff_bytes first, though cheaper: it forces the bytes into the parser even
        # where the grammar asked for no forcing (llguidance's no_forcing), changing its masks.
        tokens = self._matcher.compute_ff_tokens()
        self._check()
        return [int(t) for t in tokens]

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise GrammarStateError(
                f"the grammar refused token {token} after {len(self.consumed)} tokens: "
                f"{_short(self._matcher.get_error())}"
            )
        self.consumed.append(int(token))

    def rollback(self, n_tokens: int) -> None:
        if n_tokens <= 0:
            return
        if n_tokens > len(self.consumed) or not self._matcher.rollback(n_tokens):
            raise GrammarStateError(f"the grammar could not roll back {n_tokens} tokens")
        del self.consumed[-n_tokens:]

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarStateError(f"the grammar failed: {_short(self._matcher.get_error())}")


# Row i holds the additive mask of the 8 ids a byte i packs (bit j = id 8k + j): one gather turns
# a packed mask into 0 / -inf, faster than unpacking and taking a log.
_BYTE_MASKS = np.where(
    (np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(0), np.float32(-np.inf)
).astype(np.float32)


_BIT_OFFSETS = np.arange(8, dtype=np.int64)


class TokenMask:
    """One position's verdict, as llguidance packs it: bit j of byte k allows id 8k + j. The
    packed form answers the cheap questions (is this id allowed, how many are) without
    unpacking; the additive row is built once, when a row is shaped."""

    def __init__(self, packed: np.ndarray, vocab_size: int) -> None:
        self.packed, self.vocab_size = packed, vocab_size  # uint8 (≥ V / 8,)
        self._additive: np.ndarray | None = None
        self._n_allowed: int | None = None

    def allows(self, token: int) -> bool:
        token = int(token)
        return 0 <= token < self.vocab_size and bool((self.packed[token >> 3] >> (token & 7)) & 1)

    def allows_each(self, tokens: np.ndarray) -> np.ndarray:
        """bool (n,): whether each of ``tokens`` (int (n,)) is allowed."""
        tokens = np.asarray(tokens, dtype=np.int64)
        inside = (tokens >= 0) & (tokens < self.vocab_size)
        safe = np.where(inside, tokens, 0)
        return inside & ((self.packed[safe >> 3] >> (safe & 7)) & 1).astype(bool)

    @property
    def n_allowed(self) -> int:
        if self._n_allowed is None:
            self._n_allowed = int(np.bitwise_count(self.allowed_bytes()).sum())
        return self._n_allowed

    def allowed_bytes(self) -> np.ndarray:
        """The packed bits of ids below V only (llguidance pads to whole 32-bit words)."""
        n_bytes, n_bits = divmod(self.vocab_size, 8)
        if not n_bits:
            return self.packed[:n_bytes]
        last = self.packed[n_bytes : n_bytes + 1] & np.uint8((1 << n_bits) - 1)
        return np.concatenate([self.packed[:n_bytes], last])

    def sole_id(self) -> int | None:
        """The one allowed id when exactly one is allowed, else None; read off the packed bits
        (no pass over V ids)."""
        if self.n_allowed != 1:
            return None
        allowed = self.allowed_bytes()
        byte = int(np.flatnonzero(allowed)[0])
        return 8 * byte + int(allowed[byte]).bit_length() - 1

    def allowed_ids(self) -> np.ndarray:
        """int64 (n_allowed,): the allowed ids, ascending. Only the bytes that allow an id are
        unpacked: a narrow mask (most positions of a JSON reply) costs a pass over V / 8 bytes."""
        allowed = self.allowed_bytes()
        byte_index = np.flatnonzero(allowed)
        bits = np.unpackbits(allowed[byte_index], bitorder="little").view(bool).reshape(-1, 8)
        return (8 * byte_index[:, None] + _BIT_OFFSETS)[bits]

    def allowed(self) -> np.ndarray:
        """bool (V,)."""
        return np.unpackbits(self.packed, bitorder="little", count=self.vocab_size).astype(bool)

    @property
    def additive(self) -> np.ndarray:
        """float32 (V,): 0 where allowed, -inf where refused, to add to a row (adding costs a
        twentieth of assigning -inf through a boolean index)."""
        if self._additive is None:
            self._additive = np.take(_BYTE_MASKS, self.packed, axis=0).reshape(-1)[: self.vocab_size]
        return self._additive
