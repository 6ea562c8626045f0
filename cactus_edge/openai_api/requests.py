"""OpenAI request bodies read into what the engine takes: a
:class:`~cactus_edge.config.GenerationConfig`, chat messages or a completions prompt.

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
* ``messages`` (chat, :func:`chat_messages`) and ``prompt`` (completions,
  :func:`completion_prompt`) are read on their own: the caller decides which one it serves.

``null`` always means "the default", as in OpenAI. The generation settings are validated by
GenerationConfig alone; this module only renames the field its errors name to the request's
(``delta`` → ``speculative.delta``, :func:`openai_param`). Wrong types and out-of-range values
raise :class:`~cactus_edge.errors.InvalidSettingError` with ``param`` naming the field. No input
raises ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import GenerationConfig
from ..errors import InvalidSettingError, UnsupportedParameterError

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
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop")  # same name in both

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


# --- fields accepted at their neutral value only -----------------------------------------------


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


# --- error names ---------------------------------------------------------------------------------


def openai_param(param: str | None, prompt_param: str = "messages") -> str | None:
    """The request field for a ``param`` named by GenerationConfig or the engine's checks: a
    speculative setting sits under ``speculative``, the prompt is ``messages`` in chat requests
    (``prompt_param``); other settings have the same name in both."""
    if param in SPECULATIVE_KEYS:
        return f"speculative.{param}"
    if param == "prompt":
        return prompt_param
    return param


def with_openai_param(error: InvalidSettingError, prompt_param: str = "messages") -> InvalidSettingError:
    """``error`` (same type and message) naming the request's field instead of the engine's."""
    return type(error)(str(error), param=openai_param(error.param, prompt_param))


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
    changes, names = _sampling_changes(present)
    speculative = _speculative_changes(present.get("speculative"))
    return ParsedRequest(
        config=_configured(base or GenerationConfig(), {**changes, **speculative}, names),
        stream=_optional_bool(present, "stream"),
        include_usage=_include_usage(present.get("stream_options")),
        model=_model(present.get("model")),
        ignored=tuple(sorted(present.keys() - set(SETTINGS) - NEUTRAL_ONLY.keys() - {"messages", "prompt"})),
    )


def _configured(base: GenerationConfig, changes: dict[str, Any], names: dict[str, str]) -> GenerationConfig:
    """``base`` with ``changes``, validated by GenerationConfig; its error names the request's
    field (``names`` maps a config field to it where they differ)."""
    try:
        return base.with_changes(**changes)
    except InvalidSettingError as error:
        raise InvalidSettingError(
            str(error), param=names.get(error.param, openai_param(error.param))
        ) from None


def _sampling_changes(present: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(GenerationConfig changes, the request's name of a changed field where it differs)."""
    changes = {name: present[name] for name in SAMPLING_FIELDS if name in present}
    if _is_int(changes.get("seed")):
        # OpenAI seeds are any 64-bit integer; numpy's generator takes only non-negative ones.
        # Folding keeps "same seed, same output" without refusing valid requests.
        changes["seed"] %= 2**64
    stop = changes.get("stop")
    if isinstance(stop, (list, tuple)) and len(stop) > MAX_STOP:
        raise InvalidSettingError(f"stop takes at most {MAX_STOP} strings, got {len(stop)}", param="stop")
    given = [name for name in ("max_tokens", "max_completion_tokens") if name in present]
    if not given:
        return changes, {}
    # max_completion_tokens is OpenAI's current name, max_tokens the older one; take either.
    if len(given) == 2 and present["max_tokens"] != present["max_completion_tokens"]:
        raise InvalidSettingError(
            f"max_tokens ({present['max_tokens']!r}) and max_completion_tokens "
            f"({present['max_completion_tokens']!r}) disagree; give one",
            param="max_completion_tokens",
        )
    changes["max_tokens"] = present[given[0]]
    return changes, {"max_tokens": given[0]}


def _speculative_changes(speculative: Any) -> dict[str, Any]:
    if speculative is None:
        return {}
    if not isinstance(speculative, Mapping):
        raise InvalidSettingError(f"speculative must be an object, got {speculative!r}", param="speculative")
    for key in speculative:
        if key not in SPECULATIVE_KEYS:
            param = f"speculative.{key}"
            raise UnsupportedParameterError(
                f"unknown key {param}; the keys are {', '.join(SPECULATIVE_KEYS)}", param=param
            )
    return {key: value for key, value in speculative.items() if value is not None}


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


# --- messages and prompts ------------------------------------------------------------------------


def chat_messages(messages: Any, default_system: str | None = None) -> list[dict]:
    """A chat request's messages as the chat template takes them: OpenAI's ``developer`` role is
    ``system``, a null content is empty, and ``default_system`` is added first when no message
    is a system one. InvalidSettingError (param ``messages``) when they are not messages."""
    if not isinstance(messages, list) or not messages:
        raise InvalidSettingError("messages must be a non-empty array of messages", param="messages")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidSettingError(
                f"messages[{index}] must be an object with a string 'role', got {message!r}",
                param="messages",
            )
        message = dict(message)
        if message["role"] == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        if message.get("content") is None:
            message["content"] = ""
        out.append(message)
    if default_system and not any(m["role"] == "system" for m in out):
        out.insert(0, {"role": "system", "content": default_system})
    return out


def completion_prompt(prompt: Any) -> str | list[int]:
    """A completions request's prompt: a string, token ids, or a batch of one of either. Whether
    the ids exist is the engine's check (Engine.check_request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidSettingError("the prompt is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise UnsupportedParameterError(
            "a batch of several prompts is not supported; send one per request", param="prompt"
        )
    raise InvalidSettingError("prompt must be a non-empty string or array of token ids", param="prompt")
