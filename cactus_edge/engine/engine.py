"""The speculative decoding engine: propose, verify, commit — streamed token by token.

State between steps is one list, ``committed`` (prompt + every accepted token). Each model's KV cache
always holds a prefix of it; a step first feeds each model whatever committed tokens it has not
seen, so rollback is a single truncate. The first step is plain: its one target decode is the
prompt's prefill and yields the first token, as plain decoding's does. The draft is fed lazily:
only a step that drafts with it feeds it what it lacks (the prompt the first time, a new turn's
text, the tokens it skipped during plain steps), so no draft work ever delays the first token and
a request that never drafts with the model never prefills it.

**One exit path.** However a generation ends — end of text, stop string, length, cancel, the
consumer closing or abandoning the stream, an exception inside a step, KeyboardInterrupt — its
``finally`` brings both caches back to a prefix of prompt + the tokens handed to the consumer
(tokens held back for a possible stop string and then cut are not kept), checked against
llama.cpp's own position range, not only our mirror of it.

**Concurrency contract.** One engine runs one generation at a time. A stream takes the engine when
it starts (its first ``next()``) and gives it back on any exit; other callers wait for it, forever
by default or up to ``timeout`` seconds, then get :class:`EngineBusy`. A thread that already holds
an open stream of this engine and starts another gets EngineBusy at once instead of a deadlock.
An abandoned stream gives the engine back when it is garbage-collected. ``close()`` is safe at any
time from any thread: the running generation ends at its next step and the models are freed when
it has let go. Tokenizing and rendering never wait for a generation and share no buffer with it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..catalog.registry import resolve_pair
from ..constraints.grammar import CompiledGrammars
from ..constraints.shaper import LogitShaper
from ..constraints.templates import Prompts
from ..errors import ContextLengthError, InvalidSettingError
from ..llama.model import Model
from ..rules.draft_length import CostModel
from .cache_files import CacheFolder, check_cache_folder
from .calibration import measure_engine_costs
from .config import DEFAULT_CACHE_DISK_MIB, DEFAULT_CACHE_MIB, GenerationConfig
from .events import GenerationResult, StreamEvent
from .generation import Generation, collect
from .lifecycle import Guard, Lifecycle
from .loading import ForeignTokens, load_models
from .prompt_cache import PromptCache, keep_live
from .stats import GenerationStats, StepStats

# A prompt that does not fit is told which --n-ctx would hold it with this much room to reply.
REPLY_ROOM = 1024

__all__ = ["Engine", "GenerationConfig", "GenerationResult", "GenerationStats", "StepStats", "StreamEvent"]


class Engine:
    """A target model and optionally a draft model, and the speculative decoding loop over them.
    Build one from loaded models (tests inject their own), or with :meth:`load` / :meth:`from_pair`,
    which resolve names and check the pair first (:func:`load_models`)."""

    def __init__(
        self,
        target: Model,
        draft: Model | None = None,
        *,
        cache_ram_mib: int = DEFAULT_CACHE_MIB,
        cache_dir: str | Path | None = None,
        cache_disk_mib: int = DEFAULT_CACHE_DISK_MIB,
    ) -> None:
        if draft is not None and draft.vocab_size < target.vocab_size:
            draft.foreign_tokens = ForeignTokens(draft, target)
        if not isinstance(target, Model) or not isinstance(draft, (Model, type(None))):
            raise TypeError("Engine(target, draft) takes loaded models; use Engine.load(draft, target)")
        self.target, self.draft = target, draft
        self.prompts = Prompts(target)
        self._guard = Guard()
        self._life = Lifecycle()
        self.grammars = CompiledGrammars(target.grammar_tokenizer, target.vocab_size)
        self.last_shaper: LogitShaper | None = None  # for check_caches
        memory_bytes = _checked_cache_mib(cache_ram_mib, "cache_ram_mib") * 2**20
        folder = None
        if cache_dir is not None:
            disk_bytes = _checked_cache_mib(cache_disk_mib, "cache_disk_mib") * 2**20
            folder = CacheFolder(Path(cache_dir), self.models_by_role, disk_bytes)
        self.prompt_cache = PromptCache(memory_bytes, folder)
        self.reset_estimates()

    @classmethod
    def load(
        cls,
        draft: str | Path | None,
        target: str | Path,
        *,
        cache_ram_mib: int = DEFAULT_CACHE_MIB,
        cache_dir: str | Path | None = None,
        cache_disk_mib: int = DEFAULT_CACHE_DISK_MIB,
        **settings,
    ) -> Engine:
        """An engine over models given by path or registered name; see :func:`load_models`.
        cache_ram_mib: the prompt cache's bound in memory (0: off); cache_dir: a folder that keeps
        evicted entries and the conversations :meth:`keep_conversation` keeps, at most
        cache_disk_mib of them. Bad values and an unwritable folder are refused before any model
        loads."""
        _checked_cache_mib(cache_ram_mib, "cache_ram_mib")
        if cache_dir is not None:
            _checked_cache_mib(cache_disk_mib, "cache_disk_mib")
            check_cache_folder(Path(cache_dir))
        models = load_models(draft, target, **settings)
        try:
            return cls(
                *models, cache_ram_mib=cache_ram_mib, cache_dir=cache_dir, cache_disk_mib=cache_disk_mib
            )
        except BaseException:
            for model in filter(None, models):
                model.close()
            raise

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> Engine:
        """An engine over a registered pair (None: the default pair)."""
        return cls.load(*resolve_pair(name), **kwargs)

    def reset_estimates(self) -> None:
        """Forget what `n_draft="auto"` learnt (costs; acceptance per drafter, method, delta)."""
        self.use_estimates(CostModel(), {})

    def use_estimates(self, costs: CostModel, acceptance: dict) -> None:
        """Let `auto` learn into these from now on (bench gives each variant its own)."""
        self.costs, self.acceptance = costs, acceptance

    def measure_costs(self, sizes: Sequence[int] = range(1, 10), repeats: int = 3) -> dict:
        """{"verify_ms": {n: ms}, "draft_ms": one draft token's ms or None}, medians inside
        llama_decode at the end of the cached text (calibration.measure_batch_costs), under the lock."""
        with self._guard.hold(None):
            return measure_engine_costs(self.target, self.draft, sizes, repeats)

    def close(self, wait: float = 5.0) -> None:
        """Free both models. A running generation is cancelled at its next step; the models are
        freed once it has let go (at once when idle, else waiting up to ``wait`` s). Idempotent."""
        if self._life.close():
            self._guard.run_when_free(self._free_models, wait)

    def _free_models(self) -> None:
        self._life.wait_for_prompt_operations()
        for model in filter(None, (self.draft, self.target)):
            model.close()

    @property
    def closed(self) -> bool:
        return self._life.closed

    @property
    def closing(self) -> bool:
        """Closed or closing: a running generation ends at its next step."""
        return self._life.closing.is_set()

    @property
    def models_by_role(self) -> dict[str, Model]:
        """The models by role ("target", "draft"), as the prompt cache names them."""
        return {role: model for role, model in (("target", self.target), ("draft", self.draft)) if model}

    def keep_conversation(self, timeout: float | None = None) -> bool:
        """Write the live caches (the last conversation) to the cache folder now, so that a later
        engine, after a restart, restores it instead of prefilling; False when there is no folder,
        nothing worth keeping, or the disk refused (a warning says why)."""
        self._life.check_open()
        with self._guard.hold(timeout):
            self._life.check_open()  # closed while this call waited
            return keep_live(self.models_by_role, self.prompt_cache)

    @property
    def models(self) -> list[Model]:
        """Both models, also a draft a generation does not use: no cache may keep another text
        than the running generation's."""
        return [model for model in (self.target, self.draft) if model is not None]

    @property
    def description(self) -> str:
        """Which models run ("draft A -> target B"), for the first line of a front end."""
        target = Path(str(self.target.path)).name
        target_device = getattr(self.target, "device", None)
        if self.draft is None:
            return f"target {target}, no draft model" + (f" · {target_device}" if target_device else "")
        draft_device = getattr(self.draft, "device", None)
        if draft_device == target_device:
            where = f" · {target_device}" if target_device else ""
        else:
            where = f" · draft on {draft_device}, target on {target_device}"
        return f"draft {Path(str(self.draft.path)).name} -> target {target}{where}"

    @property
    def n_ctx(self) -> int:
        """The context llama.cpp allocated (it may round the requested one up), both models'."""
        return min(m.n_ctx for m in self.models)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- prompts (never wait for a generation; see the concurrency contract) ---------------------

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template's text for ``messages`` (for display; generation uses token ids)."""
        with self._life.prompt_operation():
            return self.prompts.render(messages, tools=tools)

    def tokenize_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Prompt ids for a conversation and OpenAI ``tools`` (pasted ``<|im_start|>`` stays text)."""
        with self._life.prompt_operation():
            return self.prompts.tokenize_chat(messages, tools=tools)

    def tokenize_prompt(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Raw prompt ids; see :meth:`Prompts.tokenize_prompt`."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        with self._life.prompt_operation():
            return self.prompts.tokenize_prompt(prompt, chat=chat)

    def warm_up(self, grammars: bool = False) -> None:
        """A short fixed-k generation pages the weights in and builds the compute graphs; its cold
        timings are then forgotten (they would skew the cost table), and a 2-token `auto` generation
        measures the batch costs `auto` needs (calibration.calibrate, after its first token). The caches
        keep a short prompt; no acceptance rate is learnt.

        ``grammars``: also build the grammar tokenizer index (:meth:`CompiledGrammars.prepare`), as a
        server does before it says it is ready: otherwise the first constrained request builds it,
        holding Python's GIL (and a server's event loop) for most of a second."""
        if grammars:
            with self._life.prompt_operation():
                self.grammars.prepare()
        drafter = "model" if self.draft else "lookup"
        self.generate(
            "Hello", GenerationConfig(method="sps", n_draft=2, drafter=drafter, max_tokens=4, seed=0)
        )
        self.reset_estimates()
        self.generate(
            "Hello", GenerationConfig(method="sps", n_draft="auto", drafter=drafter, max_tokens=2, seed=0)
        )

    # --- generation ------------------------------------------------------------------------------

    def generate(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, **kwargs
    ) -> GenerationResult:
        return collect(self.stream(prompt, config, **kwargs))

    def chat(
        self, messages: list[dict[str, str]], config: GenerationConfig | None = None, **kwargs
    ) -> GenerationResult:
        return collect(self.stream_chat(messages, config, **kwargs))

    def stream_chat(self, messages: list[dict], config=None, *, tools=None, **kwargs) -> Iterator:
        return self.stream(self.tokenize_chat(messages, tools), config, **kwargs)

    def stream(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        *,
        cancel: threading.Event | None = None,
        timeout: float | None = None,
    ) -> Iterator[StreamEvent]:
        """Stream the continuation of ``prompt`` (raw text, or token ids), one event per token.
        cancel: set it to end the generation at the end of the current step.
        timeout: seconds to wait for the engine if another generation holds it (None: wait),
            then :class:`EngineBusy`."""
        config = config or GenerationConfig()
        self._life.check_open()
        prompt_tokens = self.tokenize_prompt(prompt)
        self.check_request(prompt_tokens, config)
        return self._run(prompt_tokens, config, cancel or threading.Event(), timeout)

    def check_request(self, prompt_tokens: Sequence[int], config: GenerationConfig) -> None:
        """Refuse what cannot run before a generation takes the engine: InvalidSettingError naming the
        parameter (grammars compile here), ContextLengthError when the context has no room to reply."""
        self._check_models_fit(config, list(prompt_tokens))
        if config.grammar_source is not None:  # compiled (and cached) here, so its errors come first
            with self._life.prompt_operation():
                self.grammars.matcher(config.grammar_source, _grammar_param(config))

    def _run(self, prompt_tokens, config, cancel, timeout) -> Iterator[StreamEvent]:
        with self._guard.hold(timeout):
            self._life.check_open()  # closed while this stream waited
            generation = Generation(self, prompt_tokens, config, cancel)
            self.last_shaper = generation.shaper
            yield from generation.events()

    def clear_caches(self, timeout: float | None = None) -> None:
        """Empty both KV caches and the prompt cache in memory: with a fixed draft length the next
        reply then depends on prompt, config and seed alone (a reused prefix changes llama.cpp's
        rounding). A cache folder's files stay (they are the user's kept conversations), so with
        one a kept conversation may still come back. timeout: as stream's."""
        self._life.check_open()
        with self._guard.hold(timeout):
            self._life.check_open()
            for model in filter(None, (self.target, self.draft)):
                model.reset()
            self.prompt_cache.clear()

    def check_caches(self, expected: Sequence[int] | None = None) -> list[str]:
        """Problems with the caches, [] when consistent: llama.cpp's position range must equal our
        mirror of each, and each must hold a prefix of ``expected`` (prompt + emitted tokens)."""
        return _cache_problems({"target": self.target, "draft": self.draft}, expected, self.last_shaper)

    def reply_shaper(self, prompt_tokens: Sequence[int], config: GenerationConfig) -> LogitShaper:
        """What changes raw logits for one reply to ``prompt_tokens`` (inactive when nothing does)."""
        new_matcher, trigger = None, ()
        source = config.grammar_source
        if source is not None:
            grammars, param = self.grammars, _grammar_param(config)
            new_matcher = lambda: grammars.matcher(source, param)  # noqa: E731
            if config.grammar_trigger:
                trigger = self.target.tokenize(config.grammar_trigger, add_special=False, parse_special=True)
        bias = None
        if config.logit_bias:
            ids, values = zip(*config.logit_bias, strict=True)
            bias = (np.array(ids, dtype=np.int64), np.array(values, dtype=np.float32))
        end_tokens = self.target.end_of_generation_tokens() if new_matcher else frozenset()
        return LogitShaper(
            prompt_tokens,
            new_matcher=new_matcher,
            trigger=trigger,
            bias=bias,
            penalties=config.penalties,
            end_tokens=end_tokens,
        )

    def _check_models_fit(self, config: GenerationConfig, prompt_tokens: list[int]) -> None:
        """The request's draft, token ids and length against these models and this context."""
        target, draft, n_ctx = self.target, self.draft, self.n_ctx
        if config.uses_model and draft is None:
            raise InvalidSettingError(
                f"drafter {config.drafter!r} needs a draft model and this engine has none; "
                "use drafter='lookup' or method='none'",
                param="drafter",
            )
        if not prompt_tokens:
            raise InvalidSettingError("the prompt is empty", param="prompt")
        if any(not 0 <= t < target.vocab_size for t in prompt_tokens):
            raise InvalidSettingError(f"prompt token ids must be in [0, {target.vocab_size})", param="prompt")
        if any(token >= target.vocab_size for token, _ in config.logit_bias):
            raise InvalidSettingError(
                f"logit_bias token ids must be in [0, {target.vocab_size})", param="logit_bias"
            )
        if len(prompt_tokens) >= n_ctx:
            needed = -(-(len(prompt_tokens) + REPLY_ROOM) // 1024) * 1024
            raise ContextLengthError(
                f"the prompt has {len(prompt_tokens)} tokens but the context holds {n_ctx} "
                f"(with room for at least one generated token); shorten it, or load the model with "
                f"--n-ctx {needed} or more ({REPLY_ROOM:,} tokens for the reply)"
            )


def _checked_cache_mib(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidSettingError(f"{name} must be 0 or a whole number of MiB, not {value!r}", param=name)
    return value


def _grammar_param(config: GenerationConfig) -> str:
    """The field that holds a config's grammar, for errors."""
    return next(name for name in ("json_schema", "regex", "grammar") if getattr(config, name) is not None)


def _cache_problems(models: dict, expected: Sequence[int] | None, shaper: LogitShaper | None) -> list[str]:
    """Engine.check_caches for the named models (None: no such model) and the last reply's shaper
    (its grammar state must follow the reply as the caches do)."""
    problems = shaper.problems(expected) if expected is not None and shaper is not None else []
    for name, model in models.items():
        if model is None:
            continue
        low, high = model.cache_range()
        if (low, high) != ((0, model.n_past - 1) if model.n_past else (-1, -1)):
            problems.append(
                f"{name}: llama.cpp holds positions {low}..{high}, our mirror {model.n_past} tokens"
            )
        if expected is not None and list(expected[: model.n_past]) != model.tokens:
            problems.append(f"{name}: the cache is not a prefix of the {len(expected)} expected tokens")
    return problems
