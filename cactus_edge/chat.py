"""Rendering conversations with the chat template stored in a GGUF.

Templates come from files users download, so they run in Jinja's immutable sandbox: a template can
format text but cannot reach Python objects or mutate what it is given.
"""

from __future__ import annotations

import logging
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import CactusEdgeError

logger = logging.getLogger(__name__)

# Used when a GGUF carries no template: ChatML, which most instruction-tuned models understand.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(CactusEdgeError):
    """The model's chat template failed to render these messages."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    messages: list[dict[str, str]],
    template: str | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for ``messages`` (dicts with ``role`` and ``content``)."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ChatTemplateError(f"message {index} needs 'role' and 'content'")
    if not template:
        logger.warning("the model has no chat template; using ChatML")
        template = FALLBACK_TEMPLATE
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as error:
        raise ChatTemplateError(f"the chat template failed: {error}") from error
