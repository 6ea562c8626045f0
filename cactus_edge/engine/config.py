"""What shapes one generation, defined once: method and drafter names, sampling defaults, and
:class:`GenerationConfig`. Imports numpy-only modules, never llama.cpp, so the TUI, the CLI's
option parsing and the OpenAI-shaped layer can use it without loading a model library."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from ..checks import is_int, is_number
from ..constraints.grammar import grammar_source, parse_json_schema
from ..constraints.penalties import Penalties
from ..errors import InvalidSettingError
from ..llama import DEFAULT_N_CTX  # noqa: F401  (re-exported: the CLI's default)
from ..rules.acceptance import AcceptanceRule, KLBudgetRule, make_rule
from ..rules.sampling import SamplingConfig

METHODS = ("cactus", "sps", "tas", "exact", "none")
LOSSLESS_METHODS = ("sps", "exact", "none")
DRAFTERS = ("model", "lookup", "model+lookup")
DEFAULT_METHOD = "cactus"
DEFAULT_DELTA = 1.0
DEFAULT_DRAFTER = "model+lookup"  # lookup when the context repeats, the model when it pays (README)
# The paper's sampling settings.
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_K = 20
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.0
# The prompt cache's bound. 1 GiB holds about 20 conversations of 1.3k tokens with the default pair
# (about 28 KiB of KV per token for the 1.5B target and 12 KiB for the 0.5B draft): the
# conversations a chat app or an agent switches between, at an eighth of llama-server's 8 GiB.
DEFAULT_CACHE_MIB = 1024
# The bound of a prompt cache folder (--cache-dir): disk is cheaper than memory.
DEFAULT_CACHE_DISK_MIB = 4096
# Typical acceptance's defaults (Medusa, vLLM).
DEFAULT_POSTERIOR_THRESHOLD = 0.09
DEFAULT_POSTERIOR_ALPHA = 0.3
MAX_DRAFT = 64  # the longest fixed block accepted
MAX_AUTO_DRAFT = 12  # the longest block `auto` considers
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]
AUTO_DRAFT_P_MIN = 0.2  # with `auto`, stop drafting once the draft's own p(d) falls below this


@dataclass(frozen=True)
class Bounds:
    """A numeric setting's type and range, and the words an error states them in."""

    says: str  # the allowed values, as in "top_p must be in (0, 1] (1 = disabled), got 1.5"
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    finite: bool = False
    optional: bool = False  # None allowed

    def allows(self, value) -> bool:
        if value is None:
            return self.optional
        if not (is_int(value) if self.integer else is_number(value)):
            return False
        if self.finite and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def problem(self, name: str, value) -> str:
        if value is not None and not self.integer and not is_number(value):
            return f"{name} must be a number, got {value!r}"  # a boolean or a string, say
        return f"{name} must be {self.says}, got {value!r}"


# Every numeric field of GenerationConfig, checked in this order; n_draft also takes "auto".
BOUNDS = {
    "delta": Bounds("a finite number >= 0", low=0.0, finite=True),
    "draft_p_min": Bounds("in [0, 1)", low=0.0, high=1.0, high_open=True, optional=True),
    "temperature": Bounds("a finite number >= 0 (0 = greedy)", low=0.0, finite=True),
    "top_k": Bounds("an integer >= 0 (0 = disabled)", low=0, integer=True),
    "top_p": Bounds("in (0, 1] (1 = disabled)", low=0.0, high=1.0, low_open=True),
    "min_p": Bounds("in [0, 1) (0 = disabled)", low=0.0, high=1.0, high_open=True),
    "max_tokens": Bounds("an integer >= 1", low=1, integer=True),
    "seed": Bounds("an integer >= 0 or None", low=0, integer=True, optional=True),
    "kl_budget": Bounds("a number >= 0 or None", low=0.0, optional=True),
    "posterior_threshold": Bounds("in [0, 1]", low=0.0, high=1.0),
    "posterior_alpha": Bounds("in [0, 1]", low=0.0, high=1.0),
    "presence_penalty": Bounds("in [-2, 2]", low=-2.0, high=2.0),
    "frequency_penalty": Bounds("in [-2, 2]", low=-2.0, high=2.0),
    "repeat_penalty": Bounds("in (0, 10] (1 = off)", low=0.0, high=10.0, low_open=True),
    "repeat_last_n": Bounds("an integer >= -1 (-1 = the whole context)", low=-1, integer=True),
    "top_logprobs": Bounds(
        f"an integer in [0, {MAX_TOP_LOGPROBS}]", low=0, high=MAX_TOP_LOGPROBS, integer=True
    ),
    "n_draft": Bounds(f"'auto' or an integer in [0, {MAX_DRAFT}]", low=0, high=MAX_DRAFT, integer=True),
}


def needs_draft_model(method: str, drafter: str) -> bool:
    """Whether a generation with this method and drafter runs the draft model."""
    return method != "none" and drafter in ("model", "model+lookup")


@dataclass(frozen=True)
class GenerationConfig:
    """Everything that shapes one generation. Sampling settings apply to draft and target alike.

    Invalid values raise :class:`~cactus_edge.errors.InvalidSettingError` (a ``ValueError``)
    naming the parameter.
    """

    method: str = DEFAULT_METHOD
    delta: float = DEFAULT_DELTA
    n_draft: int | str = "auto"  # a fixed block length, or "auto": chosen per step from costs
    drafter: str = DEFAULT_DRAFTER  # "model", "lookup" (prompt n-grams) or "model+lookup"
    draft_p_min: float | None = None  # stop drafting below this draft p(d); None: 0.2 with auto
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # KL budget for the whole response (nats): lossy verification while the running sum of the
    # exact per-token KL(out ‖ target) stays within it, SpS afterwards. None: unlimited.
    kl_budget: float | None = None
    # Typical acceptance (method "tas"): accept d iff q(d) > min(threshold, alpha · exp(−H(q))).
    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD
    posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA
    # Constraints (docs/methods.md, 'Constraints: the order of operations on a row'): at most one
    # of json_schema (a dict or JSON text; kept as compact JSON text), grammar (Lark, in
    # llguidance's syntax) and regex. grammar_trigger: the constraint starts once the reply has
    # produced this text (a tool call's opening marker).
    json_schema: str | None = None
    grammar: str | None = None
    regex: str | None = None
    grammar_trigger: str | None = None
    # Added to the raw logits before anything else: {token id: bias}, kept as sorted pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's, over generated tokens (in [-2, 2]), and llama.cpp's over the last repeat_last_n
    # tokens of the context (1 = off; -1 = the whole context).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    # Each emitted token's log-probability under the target's raw logits, and the top
    # alternatives (0..20).
    logprobs: bool = False
    top_logprobs: int = 0
    # The client's prompt_cache_key: among saved caches sharing as long a prefix, one saved under
    # this key is restored first. A hint; it never restores tokens that differ.
    cache_key: str | None = None
    # A predicted output (OpenAI's Predicted Outputs: the file an editor asks to change): drafts
    # come from it first. The reply stays the target's; only its speed changes.
    prediction: str | None = None

    def __post_init__(self) -> None:
        self._normalize_constraints()
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        self._validate()

    def _normalize_constraints(self) -> None:
        """Schemas to compact JSON text and bias to sorted pairs, so equal configs compare equal."""
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", parse_json_schema(self.json_schema))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted(_bias_pairs(self.logit_bias))))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias))

    def _validate(self) -> None:
        # Every error names its field in ``param``: the OpenAI layer renames it to the request's
        # field instead of checking each setting again itself.
        for name, choices in (("method", METHODS), ("drafter", DRAFTERS)):
            if getattr(self, name) not in choices:
                raise InvalidSettingError(
                    f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}", param=name
                )
        for name, bounds in BOUNDS.items():
            value = getattr(self, name)
            if not (name == "n_draft" and value == "auto") and not bounds.allows(value):
                raise InvalidSettingError(bounds.problem(name, value), param=name)
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSettingError(
                f"stop must be a string or a sequence of non-empty strings, got {self.stop!r}", param="stop"
            )
        self._validate_constraints()

    def _validate_constraints(self) -> None:
        if not isinstance(self.logprobs, bool):
            raise InvalidSettingError(f"logprobs must be a boolean, got {self.logprobs!r}", param="logprobs")
        _check_bias_pairs(self.logit_bias)
        if self.grammar_trigger is not None and (
            not isinstance(self.grammar_trigger, str) or not self.grammar_trigger
        ):
            raise InvalidSettingError("grammar_trigger must be a non-empty string", param="grammar_trigger")
        if self.grammar_trigger is not None and self.grammar_source is None:
            raise InvalidSettingError("grammar_trigger needs a grammar to start", param="grammar_trigger")
        _ = self.grammar_source
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise InvalidSettingError(
                f"prediction must be a string, got {type(self.prediction).__name__}", param="prediction"
            )
        if self.cache_key is not None and not isinstance(self.cache_key, str):
            raise InvalidSettingError(
                f"cache_key must be a string, got {self.cache_key!r}", param="cache_key"
            )

    @property
    def grammar_source(self) -> str | None:
        """llguidance's grammar text for the constraint, None without one (validated, cached)."""
        return grammar_source(self.json_schema, self.grammar, self.regex)

    @property
    def penalties(self) -> Penalties:
        return Penalties(
            self.repeat_penalty, self.repeat_last_n, self.frequency_penalty, self.presence_penalty
        )

    def with_changes(self, **changes) -> GenerationConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def rule(self) -> AcceptanceRule | None:
        """A fresh rule for one response (a KL budget keeps per-response state)."""
        if self.method == "none":
            return None
        rule = make_rule(self.method, self.delta, self.posterior_threshold, self.posterior_alpha)
        if self.kl_budget is None or self.kl_budget == float("inf") or rule.lossless:
            return rule
        return KLBudgetRule(rule, self.kl_budget)

    @property
    def lossless(self) -> bool:
        return self.method in LOSSLESS_METHODS

    @property
    def auto(self) -> bool:
        return self.n_draft == "auto"

    @property
    def max_draft(self) -> int:
        return MAX_AUTO_DRAFT if self.auto else self.n_draft

    @property
    def p_min(self) -> float:
        if self.draft_p_min is not None:
            return self.draft_p_min
        return AUTO_DRAFT_P_MIN if self.auto else 0.0

    @property
    def uses_model(self) -> bool:
        return needs_draft_model(self.method, self.drafter)


def _bias_pairs(bias: Mapping) -> list[tuple[int, float]]:
    """{token id: bias} with ids given as ints or as decimal strings (JSON object keys)."""
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            token = None
        if token is None or (isinstance(key, float) and not key.is_integer()):
            raise InvalidSettingError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        pairs.append((token, value))
    return pairs


def _check_bias_pairs(pairs) -> None:
    if not isinstance(pairs, tuple):
        raise InvalidSettingError(
            f"logit_bias must map token ids to numbers, got {pairs!r:.80}", param="logit_bias"
        )
    for pair in pairs:
        token, value = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
        if not is_int(token) or token < 0:
            raise InvalidSettingError(
                f"logit_bias keys must be token ids >= 0, got {token!r}", param="logit_bias"
            )
        if not is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidSettingError(
                f"logit_bias[{token}] must be a number in [-100, 100], got {value!r}", param="logit_bias"
            )
