"""`cactus-edge serve`: an OpenAI-compatible HTTP server over one Engine, for desktop apps.

Layout, one concern a module:

* ``settings``: :class:`ServerSettings` (how the server listens, what it lets through, its
  timeouts and limits), the defaults, the `serve` flags made from its fields
  (:func:`~.settings.setting_flags`), Host-header names.
* ``connections``: below the app, uvicorn's h11 protocol with deadlines for idle connections,
  headers and bodies, a cap on open connections under the descriptor limit, envelopes for the
  protocol layer's own answers (malformed HTTP, 408, 503), rate-limited accept-error logs.
* ``app``: :class:`ServerApp`, a plain ASGI application over an Engine (or none yet: ``/health``
  says 503 while the CLI loads the models, then :meth:`ServerApp.attach` makes it ready). It
  routes each request after ``guards`` checked it (Host, Origin, CORS preflight, API key).
* ``admission``: the generation routes. A request takes a place in the queue before its body is
  read, is parsed with ``parsing`` (size, JSON, lone surrogates, then
  :mod:`cactus_edge.openai_api` for the fields, messages or prompt; tokenizing one prompt at a
  time), checked by the engine (``Engine.check_request``: context, token ids, drafter) and
  handed to the scheduler.
* ``scheduler``: :class:`Scheduler` owns the engine: ONE worker thread runs one generation at a
  time, in arrival order, from a bounded queue (``max_queue`` waiting behind the running one or
  being read; more get 503). A running generation is never pre-empted. A request whose client
  goes away is withdrawn from the queue, or, if it runs, cancelled at the engine's next step (the
  engine leaves its caches consistent, so the next request sees what a fresh engine would give);
  with ``debug`` it checks that after every generation.
* ``streaming``: a job's events as one JSON body or server-sent events, in the shapes of
  :mod:`cactus_edge.openai_api.shapes` (the Python facade's too); ``exchange``: one ASGI
  request/response.
* ``errors``: :class:`HTTPError`, the mapping of library errors to statuses (the library's
  message, OpenAI's type, code and field name), and ``quote``, how a message shows a client's
  value (clipped); ``metrics``: the counters of GET /metrics.
* ``runner``: :class:`Server` runs the app on uvicorn (h11, asyncio) in a background thread, on a
  socket it binds itself (so port 0 is known before serving); :func:`run` is what the CLI calls:
  signals, loading, the ready line, a clean shutdown.

``/v1/models``, ``/health`` and ``/metrics`` never touch the engine or wait for it.

Every error is OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``, including
the protocol layer's own answers (``connections``).
"""

from .app import ServerApp
from .errors import HTTPError, QueueFull, ShuttingDown, error_body
from .metrics import KL_BUCKETS, Metrics
from .runner import Server, create_server, run
from .scheduler import Job, Scheduler
from .settings import (
    API_KEY_ENV,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    LOOPBACK_HOSTS,
    MODEL_ALIAS,
    RETRY_AFTER_SECONDS,
    ServerSettings,
    SettingFlag,
    setting_flags,
)

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_HOST",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_PORT",
    "KL_BUCKETS",
    "LOOPBACK_HOSTS",
    "MODEL_ALIAS",
    "RETRY_AFTER_SECONDS",
    "HTTPError",
    "Job",
    "Metrics",
    "QueueFull",
    "Scheduler",
    "Server",
    "ServerApp",
    "ServerSettings",
    "SettingFlag",
    "ShuttingDown",
    "create_server",
    "error_body",
    "run",
    "setting_flags",
]
