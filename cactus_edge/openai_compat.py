"""OpenAI / llama-cpp-python shaped chat completions over the Engine, so embedding apps can switch.

Two layers:

* :func:`parse_request` turns an OpenAI request body (chat or legacy completions) into a
  :class:`~cactus_edge.config.GenerationConfig` plus what the response needs (stream,
  include_usage, model). It is pure, so an HTTP server can reuse it as is.
* :func:`chat_completion` runs one parsed request on an engine and shapes the result as a
  ``chat.completion`` dict or a stream of ``chat.completion.chunk`` dicts.

How each request field is treated:

* Used (:data:`SETTINGS`): ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``
  (a string or at most 4 strings), ``max_tokens`` / ``max_completion_tokens`` (either; equal if
  both), ``stream``, ``stream_options.include_usage``, ``model``, and our extension
  ``speculative: {"method", "delta", "n_draft", "drafter", "draft_p_min", "kl_budget",
  "posterior_threshold", "posterior_alpha"}``.
* Accepted at their neutral value only (:data:`NEUTRAL_ONLY`): a field whose other values would
  change what the client gets back, so ignoring them would silently answer a different question:
  ``n`` (1), ``presence_penalty`` / ``frequency_penalty`` (0), ``logit_bias`` (empty),
  ``logprobs`` (false), ``top_logprobs`` (0), ``tools`` / ``functions`` (empty), ``tool_choice`` /
  ``function_call`` ("none"), ``response_format`` ({"type": "text"}), ``modalities`` (["text"]),
  ``audio`` (absent), completions' ``echo`` (false), ``best_of`` (1), ``suffix`` (""), and
  llama-cpp-python's ``repeat_penalty`` (1), ``mirostat_mode`` (0), ``grammar`` (absent).
  Other values raise :class:`~cactus_edge.errors.UnsupportedParameterError`.
* Ignored (:data:`IGNORED`, and any other unknown field): ``user``, ``metadata``, ``store``,
  ``parallel_tool_calls`` (there are never tools), ``service_tier``, ``prediction`` (a latency
  hint; the output is the same without it), ``prompt_cache_key``, ``safety_identifier``.
* ``messages`` (chat) and ``prompt`` (completions) are the caller's to read; not looked at here.

``null`` always means "the default", as in OpenAI. Wrong types and out-of-range values raise
:class:`~cactus_edge.errors.InvalidSettingError`; every error's ``param`` names the field
(``"speculative.delta"`` inside the extension). No input raises ``TypeError``.

This module imports no llama.cpp, and knows the engine only by duck type (``stream_chat``), so
importing it never loads a model library and there is no engine ↔ OpenAI-layer import cycle.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import GenerationConfig
from .errors import InvalidSettingError, UnsupportedParameterError
from .events import StreamEvent
from .stats import GenerationStats

if TYPE_CHECKING:  # only for annotations: importing .engine would load llama.cpp
    from .engine import Engine

MAX_STOP = 4  # OpenAI's limit on stop sequences

SETTINGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "model",
    "speculative",
)

# Keys of the "speculative" extension; each is the GenerationConfig field of the same name.
SPECULATIVE_KEYS = (
    "method",
    "delta",
    "n_draft",
    "drafter",
    "draft_p_min",
    "kl_budget",
    "posterior_threshold",
    "posterior_alpha",
)

IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "service_tier",
        "prediction",
        "prompt_cache_key",
        "safety_identifier",
    }
)


# --- value checks ------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a number


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value)


def _is_empty(value: Any) -> bool:
    return len(value) == 0


@dataclass(frozen=True)
class _Neutral:
    """A field accepted only at the value(s) that leave the request's meaning unchanged."""

    well_typed: Callable[[Any], bool]  # otherwise InvalidSettingError
    expected: str  # what well_typed wants, for the message
    is_neutral: Callable[[Any], bool]  # otherwise UnsupportedParameterError
    neutral: str  # the accepted value, for the message


NEUTRAL_ONLY: dict[str, _Neutral] = {
    "n": _Neutral(lambda v: _is_int(v) and v >= 1, "an integer >= 1", lambda v: v == 1, "1"),
    "best_of": _Neutral(lambda v: _is_int(v) and v >= 1, "an integer >= 1", lambda v: v == 1, "1"),
    "presence_penalty": _Neutral(_is_number, "a number", lambda v: v == 0, "0"),
    "frequency_penalty": _Neutral(_is_number, "a number", lambda v: v == 0, "0"),
    "repeat_penalty": _Neutral(_is_number, "a number", lambda v: v == 1, "1"),
    "mirostat_mode": _Neutral(_is_int, "an integer", lambda v: v == 0, "0"),
    "logit_bias": _Neutral(lambda v: isinstance(v, dict), "an object", _is_empty, "{}"),
    # Chat's logprobs is a boolean, completions' a count; `is False` so a count of 0 is refused.
    "logprobs": _Neutral(
        lambda v: isinstance(v, bool) or _is_int(v), "a boolean", lambda v: v is False, "false"
    ),
    "top_logprobs": _Neutral(lambda v: _is_int(v) and v >= 0, "an integer >= 0", lambda v: v == 0, "0"),
    "echo": _Neutral(lambda v: isinstance(v, bool), "a boolean", lambda v: v is False, "false"),
    "suffix": _Neutral(lambda v: isinstance(v, str), "a string", _is_empty, '""'),
    "tools": _Neutral(lambda v: isinstance(v, list), "an array", _is_empty, "[]"),
    "functions": _Neutral(lambda v: isinstance(v, list), "an array", _is_empty, "[]"),
    "tool_choice": _Neutral(
        lambda v: isinstance(v, (str, dict)), "a string or an object", lambda v: v == "none", '"none"'
    ),
    "function_call": _Neutral(
        lambda v: isinstance(v, (str, dict)), "a string or an object", lambda v: v == "none", '"none"'
    ),
    "response_format": _Neutral(
        lambda v: isinstance(v, dict), "an object", lambda v: v == {"type": "text"}, '{"type": "text"}'
    ),
    "modalities": _Neutral(_is_str_list, "an array of strings", lambda v: list(v) == ["text"], '["text"]'),
    # Any value asks for something we cannot do (audio output, constrained sampling).
    "audio": _Neutral(lambda v: True, "anything", lambda v: False, "null"),
    "grammar": _Neutral(lambda v: True, "anything", lambda v: False, "null"),
}


def _check_neutral(name: str, value: Any) -> None:
    rule = NEUTRAL_ONLY[name]
    if not rule.well_typed(value):
        raise InvalidSettingError(f"{name} must be {rule.expected}, got {value!r}", param=name)
    if not rule.is_neutral(value):
        raise UnsupportedParameterError(
            f"{name}={value!r} is not supported by cactus-edge (only {rule.neutral})", param=name
        )


# Types of the generation settings, checked here because GenerationConfig's own checks accept
# JSON booleans as numbers and do not say which field was wrong.
_SETTING_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "min_p": (_is_number, "a number"),
    "top_k": (_is_int, "an integer"),
    "seed": (_is_int, "an integer"),
    "max_tokens": (_is_int, "an integer"),
    "delta": (_is_number, "a number"),
    "draft_p_min": (_is_number, "a number"),
    "kl_budget": (_is_number, "a number of nats"),
    "posterior_threshold": (_is_number, "a number"),
    "posterior_alpha": (_is_number, "a number"),
    "method": (lambda v: isinstance(v, str), "a string"),
    "drafter": (lambda v: isinstance(v, str), "a string"),
    "n_draft": (lambda v: _is_int(v) or v == "auto", 'an integer or "auto"'),
    "stop": (lambda v: isinstance(v, str) or _is_str_list(v), "a string or an array of strings"),
}


def _check_setting(field: str, value: Any, param: str) -> None:
    """Type-check one GenerationConfig field, then range-check it alone, so the error can name
    ``param`` (GenerationConfig checks all fields at once and cannot tell us which one failed)."""
    well_typed, expected = _SETTING_TYPES[field]
    if not well_typed(value):
        raise InvalidSettingError(f"{param} must be {expected}, got {value!r}", param=param)
    if field == "stop" and not isinstance(value, str) and len(value) > MAX_STOP:
        raise InvalidSettingError(f"stop takes at most {MAX_STOP} strings, got {len(value)}", param=param)
    try:
        GenerationConfig(**{field: value})
    except InvalidSettingError as error:
        raise InvalidSettingError(str(error), param=param) from error


# --- request parsing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedRequest:
    """What :func:`parse_request` found in a request body.

    config: the generation settings (``base`` with the request's changes).
    stream: whether the client asked for a chunk stream.
    include_usage: whether a stream should end with a usage chunk (``stream_options``).
    model: the requested model name, or None.
    ignored: top-level fields present in the body and ignored (documented or unknown), sorted.
    """

    config: GenerationConfig
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    ignored: tuple[str, ...] = ()


def parse_request(body: Mapping[str, Any], base: GenerationConfig | None = None) -> ParsedRequest:
    """Read an OpenAI chat or completions request body (see the module docstring for the fields).

    ``base`` supplies the defaults the request does not set (e.g. a server's command-line
    settings); GenerationConfig's defaults otherwise. Raises InvalidSettingError or
    UnsupportedParameterError with ``param`` naming the offending field.
    """
    if not isinstance(body, Mapping):
        raise InvalidSettingError(f"the request body must be an object, got {type(body).__name__}")
    present = {key: value for key, value in body.items() if value is not None}  # null = default
    for name in NEUTRAL_ONLY.keys() & present.keys():
        _check_neutral(name, present[name])
    changes = {**_sampling_changes(present), **_speculative_changes(present.get("speculative"))}
    config = (base or GenerationConfig()).with_changes(**changes)
    stream = _optional_bool(present, "stream")
    return ParsedRequest(
        config=config,
        stream=stream,
        include_usage=_include_usage(present.get("stream_options")),
        model=_model(present.get("model")),
        ignored=tuple(sorted(present.keys() - set(SETTINGS) - NEUTRAL_ONLY.keys() - {"messages", "prompt"})),
    )


def _sampling_changes(present: dict[str, Any]) -> dict[str, Any]:
    changes = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop"):
        if name in present:
            value = present[name]
            if name == "seed" and isinstance(value, int) and not isinstance(value, bool):
                # OpenAI seeds are any 64-bit integer; numpy's generator takes only non-negative
                # ones. Folding keeps "same seed, same output" without refusing valid requests.
                value %= 2**64
            _check_setting(name, value, name)
            changes[name] = value
    if "stop" in changes and not isinstance(changes["stop"], str):
        changes["stop"] = tuple(changes["stop"])
    max_tokens = _max_tokens(present)
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens
    return changes


def _max_tokens(present: dict[str, Any]) -> int | None:
    """max_completion_tokens is OpenAI's current name, max_tokens the older one; take either."""
    values = {name: present[name] for name in ("max_tokens", "max_completion_tokens") if name in present}
    for name, value in values.items():
        _check_setting("max_tokens", value, name)
    if len(set(values.values())) > 1:
        raise InvalidSettingError(
            f"max_tokens ({values['max_tokens']}) and max_completion_tokens "
            f"({values['max_completion_tokens']}) disagree; give one",
            param="max_completion_tokens",
        )
    return next(iter(values.values()), None)


def _speculative_changes(speculative: Any) -> dict[str, Any]:
    if speculative is None:
        return {}
    if not isinstance(speculative, Mapping):
        raise InvalidSettingError(f"speculative must be an object, got {speculative!r}", param="speculative")
    changes = {}
    for key, value in speculative.items():
        param = f"speculative.{key}"
        if key not in SPECULATIVE_KEYS:
            raise UnsupportedParameterError(
                f"unknown key {param}; the keys are {', '.join(SPECULATIVE_KEYS)}", param=param
            )
        if value is not None:
            _check_setting(key, value, param)
            changes[key] = value
    return changes


def _optional_bool(present: dict[str, Any], name: str) -> bool:
    value = present.get(name, False)
    if not isinstance(value, bool):
        raise InvalidSettingError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _include_usage(stream_options: Any) -> bool:
    # Accepted without `stream` too: it changes nothing there (a full response always has usage).
    if stream_options is None:
        return False
    if not isinstance(stream_options, Mapping):
        raise InvalidSettingError(
            f"stream_options must be an object, got {stream_options!r}", param="stream_options"
        )
    value = stream_options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise InvalidSettingError(
            f"stream_options.include_usage must be a boolean, got {value!r}",
            param="stream_options.include_usage",
        )
    return bool(value)


def _model(model: Any) -> str | None:
    if model is not None and not isinstance(model, str):
        raise InvalidSettingError(f"model must be a string, got {model!r}", param="model")
    return model


# --- completions -------------------------------------------------------------------------------


def create_chat_completion(
    engine: Engine, messages, *, stream: bool = False, model: str = "cactus-edge", **settings
):
    """Same shapes as llama-cpp-python's / OpenAI's chat completions (dict, or chunk iterator).
    A function of this layer, not an Engine method: the engine imports nothing of OpenAI's."""
    return chat_completion(engine, messages, stream=stream, model=model, **settings)


def chat_completion(engine: Engine, messages, *, stream: bool, model: str, **settings):
    """Run one chat completion on ``engine``: a ``chat.completion`` dict, or with ``stream`` an
    iterator of ``chat.completion.chunk`` dicts.

    ``settings`` are OpenAI request fields, parsed by :func:`parse_request` (so harmless unknown
    ones are ignored and meaning-changing ones raise UnsupportedParameterError before the engine
    runs). The speculative settings may also be given flat (``method="sps"``), as before.
    """
    settings = _lift_speculative(settings)
    request = parse_request({**settings, "stream": stream, "model": model})
    events = engine.stream_chat(messages, request.config)
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if request.stream:
        return _chunks(events, completion_id, created, model, request.include_usage)
    return _completion(events, completion_id, created, model)


def _lift_speculative(settings: dict[str, Any]) -> dict[str, Any]:
    """Python callers have always passed GenerationConfig's speculative fields flat; move them
    into the ``speculative`` object that :func:`parse_request` reads (flat values win)."""
    flat = {key: settings[key] for key in SPECULATIVE_KEYS if key in settings}
    nested = settings.get("speculative")
    if not flat or not (nested is None or isinstance(nested, Mapping)):
        return settings  # nothing to move, or a malformed object parse_request will report
    rest = {key: value for key, value in settings.items() if key not in SPECULATIVE_KEYS}
    return {**rest, "speculative": {**(nested or {}), **flat}}


def _usage(stats: GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.n_prompt_tokens,
        "completion_tokens": stats.n_tokens,
        "total_tokens": stats.n_prompt_tokens + stats.n_tokens,
    }


def _openai_finish(reason: str | None) -> str | None:
    # OpenAI has no "cancelled"; a cancelled reply ended on our side, like a stop sequence.
    return "stop" if reason == "cancelled" else reason


def _completion(events: Iterable[StreamEvent], completion_id: str, created: int, model: str) -> dict:
    text = []
    for event in events:
        text.append(event.text)
        if event.finish_reason is not None:
            return {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(text)},
                        "finish_reason": _openai_finish(event.finish_reason),
                    }
                ],
                "usage": _usage(event.stats),
                "speculative": event.stats.summary(),
            }
    raise RuntimeError("the engine's stream ended without a final event")


def _chunks(
    events: Iterable[StreamEvent], completion_id: str, created: int, model: str, include_usage: bool
) -> Iterator[dict]:
    """OpenAI's stream: a role chunk, content chunks, a finish chunk (ours also carries the
    ``speculative`` stats, complete by then) and, with include_usage, a last chunk with
    ``choices: []`` and ``usage`` (every earlier chunk then has ``usage: null``, as OpenAI's)."""

    def chunk(choices: list[dict], **extra) -> dict:
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = None
        return {**body, **extra}

    def choice(delta: dict, finish: str | None = None) -> list[dict]:
        return [{"index": 0, "delta": delta, "finish_reason": finish}]

    yield chunk(choice({"role": "assistant"}))
    for event in events:
        if event.text:
            yield chunk(choice({"content": event.text}))
        if event.finish_reason is not None:
            yield chunk(choice({}, _openai_finish(event.finish_reason)), speculative=event.stats.summary())
            if include_usage:
                yield chunk([], usage=_usage(event.stats))
            return
