"""OpenAI's API over the engine, one package for the HTTP server and the Python facade, so both
read the same requests and answer in the same shapes.

* ``requests``: request bodies into what the engine takes (:func:`parse_request`: a
  GenerationConfig and the stream options; :func:`chat_messages`, :func:`completion_prompt`),
  and the request's name for a field an engine error names (:func:`openai_param`).
* ``shapes``: response bodies and stream chunks (:class:`ResponseShape`) and the blocks every
  response carries (:func:`response_blocks`), from ids and times given as arguments.
* ``completions``: :func:`create_chat_completion`, the Python facade.

Above the engine: it imports no llama.cpp and knows the engine by duck type, and the engine
imports nothing of it (tests/test_layout.py).
"""

from .completions import create_chat_completion
from .requests import (
    IGNORED,
    NEUTRAL_ONLY,
    SETTINGS,
    SPECULATIVE_KEYS,
    ParsedRequest,
    chat_messages,
    completion_prompt,
    openai_param,
    parse_request,
    with_openai_param,
)
from .shapes import MODEL_ALIAS, ResponseShape, Timeline, openai_finish, response_blocks

__all__ = [
    "IGNORED",
    "MODEL_ALIAS",
    "NEUTRAL_ONLY",
    "SETTINGS",
    "SPECULATIVE_KEYS",
    "ParsedRequest",
    "ResponseShape",
    "Timeline",
    "chat_messages",
    "completion_prompt",
    "create_chat_completion",
    "openai_finish",
    "openai_param",
    "parse_request",
    "response_blocks",
    "with_openai_param",
]
