"""OpenAI request bodies read into what the engine takes: a
:class:`~cactus_edge.engine.config.GenerationConfig`, chat messages or a completions prompt.

How each request field is treated:

* Used (:data:`SETTINGS`): ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``
  (a string or at most 4 strings), ``max_tokens`` / ``max_completion_tokens`` (either; equal if
  both), ``stream``, ``stream_options.include_usage``, ``model``, ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias``, ``logprobs`` (chat: a boolean; completions: a count,
  0–5) and ``top_logprobs``, ``response_format`` (``text``, ``json_object`` with an optional
  ``schema`` as llama-cpp-python takes it, ``json_schema``), ``tools`` / ``tool_choice`` /
  ``parallel_tool_calls`` (:mod:`cactus_edge.constraints.tools`), llama-cpp-python's ``repeat_penalty`` and
  llama-server's ``repeat_last_n``, our ``grammar`` (Lark, llguidance's syntax) and ``regex``,
  ``prompt_cache_key`` (among saved prompt caches sharing as long a prefix, the key's own are
  restored first; it never restores differing tokens), ``prediction`` (Predicted Outputs: a
  draft source, the reply stays the target's), and our extension ``speculative:
  {"method", "delta", "n_draft", "drafter", "draft_p_min", "kl_budget", "posterior_threshold",
  "posterior_alpha"}``.
* Accepted at their neutral value only (:data:`NEUTRAL_ONLY`): a field whose other values would
  change what the client gets back, so ignoring them would silently answer a different question:
  ``n`` (1), ``functions`` (empty), ``function_call`` ("none"), ``modalities`` (["text"]),
  ``audio`` (absent), completions' ``echo`` (false), ``best_of`` (1), ``suffix`` (""), and
  llama-cpp-python's ``mirostat_mode`` (0). Other values raise
  :class:`~cactus_edge.errors.UnsupportedParameterError`.
* Ignored (:data:`IGNORED`, and any other unknown field): ``user``, ``metadata``, ``store``,
  ``service_tier``, ``prediction`` (a latency hint; the output is the same without it),
  ``prompt_cache_key``, ``safety_identifier``.
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

from ..checks import is_int
from ..constraints.tools import ToolSetup, parse_tools
from ..engine.config import MAX_LOGIT_BIAS, GenerationConfig
from ..errors import InvalidSettingError, UnsupportedParameterError

MAX_STOP = 4  # OpenAI's limit on stop sequences

# Fields with the same name in the request and in GenerationConfig.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "logit_bias",
    "top_logprobs",
    "grammar",
    "regex",
)
# Every field this module reads: the above, and those it turns into settings itself.
SETTINGS = (
    *SAMPLING_FIELDS,
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "model",
    "speculative",
    "logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "prompt_cache_key",
    "prediction",
)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for completions' logprobs count

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
        "service_tier",
        "safety_identifier",
    }
)


# --- fields accepted at their neutral value only -----------------------------------------------


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
    "n": _Neutral(lambda v: is_int(v) and v >= 1, "an integer >= 1", lambda v: v == 1, "1"),
    "best_of": _Neutral(lambda v: is_int(v) and v >= 1, "an integer >= 1", lambda v: v == 1, "1"),
    "mirostat_mode": _Neutral(is_int, "an integer", lambda v: v == 0, "0"),
    "echo": _Neutral(lambda v: isinstance(v, bool), "a boolean", lambda v: v is False, "false"),
    "suffix": _Neutral(lambda v: isinstance(v, str), "a string", _is_empty, '""'),
    # OpenAI's deprecated function calling: use tools.
    "functions": _Neutral(lambda v: isinstance(v, list), "an array", _is_empty, "[] (use tools)"),
    "function_call": _Neutral(
        lambda v: isinstance(v, (str, dict)), "a string or an object", lambda v: v == "none", '"none"'
    ),
    "modalities": _Neutral(_is_str_list, "an array of strings", lambda v: list(v) == ["text"], '["text"]'),
    # Any value asks for something we cannot do (audio output).
    "audio": _Neutral(lambda v: True, "anything", lambda v: False, "null"),
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
    tools: the request's tools (None without any); the config then holds the grammar they call
        for (none with tool_choice "none").
    """

    config: GenerationConfig
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    ignored: tuple[str, ...] = ()
    tools: ToolSetup | None = None


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
    if "logit_bias" in present and not isinstance(present["logit_bias"], Mapping):
        raise InvalidSettingError("logit_bias must be an object of token ids to biases", param="logit_bias")
    changes, names = _sampling_changes(present)
    changes.update(_logprobs_changes(present))
    changes.update(_response_format_changes(present.get("response_format")))
    tools = parse_tools(present.get("tools"), present.get("tool_choice"), present.get("parallel_tool_calls"))
    changes.update(_tool_changes(tools, changes))
    if "prompt_cache_key" in present:
        changes["cache_key"] = present["prompt_cache_key"]
    if "prediction" in present:
        changes["prediction"] = _prediction(present["prediction"])
    names.update(
        {"json_schema": "response_format", "grammar_trigger": "tools", "cache_key": "prompt_cache_key"}
    )
    if tools is not None and tools.constrained:
        names["grammar"] = "tool_choice"
    speculative = _speculative_changes(present.get("speculative"))
    return ParsedRequest(
        config=_configured(base or GenerationConfig(), {**changes, **speculative}, names),
        stream=_optional_bool(present, "stream"),
        include_usage=_include_usage(present.get("stream_options")),
        model=_model(present.get("model")),
        ignored=tuple(sorted(present.keys() - set(SETTINGS) - NEUTRAL_ONLY.keys() - {"messages", "prompt"})),
        tools=tools,
    )


def config_for_vocabulary(request: ParsedRequest, engine) -> GenerationConfig:
    """The request's config with its tool grammar written for the engine's vocabulary: where the
    call marker (``<tool_call>``) is one token, as in Qwen2.5's, the grammar names that token;
    elsewhere it spells the marker out. With tool_choice "none" a one-token marker is banned
    (bias -100), so a model shown the tools cannot start a call; a spelled-out one cannot be."""
    tools = request.tools
    marker_ids = engine.target.tokenize(tools.trigger, add_special=False, parse_special=True) if tools else []
    if tools is not None and not tools.calls_allowed:
        if len(marker_ids) != 1:
            return request.config
        bias = dict(request.config.logit_bias)
        bias[marker_ids[0]] = -MAX_LOGIT_BIAS
        return request.config.with_changes(logit_bias=bias)
    if tools is None or len(marker_ids) == 1:
        return request.config
    grammar = tools.grammar(special_markers=False) if tools.constrained else None
    grammar = grammar or tools.grammar_after_trigger(special_markers=False)
    return request.config.with_changes(grammar=grammar)


def _logprobs_changes(present: dict[str, Any]) -> dict[str, Any]:
    """Chat's ``logprobs: true`` (with ``top_logprobs``), or completions' ``logprobs: N`` (0–5:
    the N most likely tokens at each position)."""
    value = present.get("logprobs")
    if value is None or value is False:
        if present.get("top_logprobs"):
            raise InvalidSettingError("top_logprobs needs logprobs: true", param="top_logprobs")
        return {}
    if value is True:
        return {"logprobs": True}
    if is_int(value) and 0 <= value <= MAX_COMPLETION_LOGPROBS:
        return {"logprobs": True, "top_logprobs": value}
    raise InvalidSettingError(
        f"logprobs must be a boolean (chat) or an integer in [0, {MAX_COMPLETION_LOGPROBS}] "
        f"(completions), got {value!r}",
        param="logprobs",
    )


def _response_format_changes(response_format: Any) -> dict[str, Any]:
    """``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON object, or the
    ``schema`` given beside it, as llama-cpp-python takes it) or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``."""
    if response_format is None:
        return {}
    if not isinstance(response_format, Mapping) or not isinstance(response_format.get("type"), str):
        raise InvalidSettingError(
            f"response_format must be an object with a string 'type', got {response_format!r:.100}",
            param="response_format",
        )
    kind = response_format["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": response_format.get("schema") or {"type": "object"}}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidSettingError(
                "response_format.json_schema must be an object with a 'schema'", param="response_format"
            )
        schema = spec.get("schema")
        return {"json_schema": {"type": "object"} if schema is None else schema}
    raise InvalidSettingError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def _prediction(prediction: Any) -> str | None:
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``."""
    if not isinstance(prediction, Mapping) or prediction.get("type") != "content":
        raise InvalidSettingError(
            f'prediction must be {{"type": "content", "content": ...}}, got {prediction!r:.100}',
            param="prediction",
        )
    content = prediction.get("content")
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise InvalidSettingError(
            "prediction.content must be a string or text parts", param="prediction.content"
        )
    return content or None


def _tool_changes(tools: ToolSetup | None, changes: dict[str, Any]) -> dict[str, Any]:
    """The grammar a request's tools call for: the whole reply with "required" or a named tool;
    with "auto", what follows the trigger once the model starts a call."""
    if tools is None or not tools.calls_allowed:
        return {}
    for other in ("grammar", "regex"):
        if changes.get(other) is not None:
            raise InvalidSettingError(f"{other} cannot be combined with tools", param=other)
    if tools.constrained:
        return {"grammar": tools.grammar()}
    return {"grammar": tools.grammar_after_trigger(), "grammar_trigger": tools.trigger}


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
    if is_int(changes.get("seed")):
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
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise UnsupportedParameterError(
            "a batch of several prompts is not supported; send one per request", param="prompt"
        )
    raise InvalidSettingError("prompt must be a non-empty string or array of token ids", param="prompt")
