"""Counters for GET /metrics, rendered as Prometheus text."""

from __future__ import annotations

import threading
from collections import Counter

from ..engine.stats import GenerationStats

KL_BUCKETS = (0.0, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


class Metrics:
    """Counters for GET /metrics (Prometheus text format); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.generations: Counter[str] = Counter()  # by finish reason (stop, length, cancelled, error)
        self.prompt_tokens = self.completion_tokens = 0
        self.drafted = self.accepted = self.verifier_calls = 0
        self.kl_buckets = [0] * len(KL_BUCKETS)
        self.kl_sum, self.kl_count = 0.0, 0

    def count_request(self, status: int) -> None:
        with self._lock:
            self.requests[str(status)] += 1

    def count_failed_generation(self) -> None:
        with self._lock:
            self.generations["error"] += 1

    def record_generation(self, stats: GenerationStats, finish: str) -> None:
        with self._lock:
            self.generations[finish] += 1
            self.prompt_tokens += stats.n_prompt_tokens
            self.completion_tokens += stats.n_tokens
            self.drafted += stats.n_drafted
            self.accepted += stats.n_accepted
            self.verifier_calls += stats.n_verifier_calls
            kl = stats.kl_mean
            if kl is not None:
                self.kl_sum += kl
                self.kl_count += 1
                for index, bound in enumerate(KL_BUCKETS):
                    if kl <= bound:
                        self.kl_buckets[index] += 1

    def render(self, waiting: int, running: int, prompt_cache: dict | None = None) -> str:
        """The text of GET /metrics; ``prompt_cache``: :meth:`PromptCache.snapshot`."""
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP cactus_edge_{name} {help}")
            lines.append(f"# TYPE cactus_edge_{name} {kind}")
            lines.extend(f"cactus_edge_{name}{labels} {_number(value)}" for labels, value in samples)

        with self._lock:
            metric(
                "requests_total",
                "counter",
                "HTTP requests answered, by status code (499: the client went away).",
                [(f'{{status="{s}"}}', n) for s, n in sorted(self.requests.items())],
            )
            metric(
                "generations_total",
                "counter",
                "Generations run, by finish reason.",
                [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.generations.items())],
            )
            for name, help, value in (
                ("prompt_tokens_total", "Prompt tokens of finished generations.", self.prompt_tokens),
                ("completion_tokens_total", "Tokens generated.", self.completion_tokens),
                ("draft_tokens_total", "Draft tokens proposed.", self.drafted),
                ("draft_tokens_accepted_total", "Draft tokens accepted.", self.accepted),
                ("verifier_calls_total", "Target (verifier) forward passes.", self.verifier_calls),
            ):
                metric(name, "counter", help, [("", value)])
            metric("queue_depth", "gauge", "Requests waiting for the engine.", [("", waiting)])
            metric("requests_running", "gauge", "Generations running (0 or 1).", [("", running)])
            buckets = [
                (f'_bucket{{le="{_number(b)}"}}', n) for b, n in zip(KL_BUCKETS, self.kl_buckets, strict=True)
            ]
            buckets.append(('_bucket{le="+Inf"}', self.kl_count))
            metric(
                "response_kl_mean",
                "histogram",
                "Per-response mean KL(output || target) of decided draft positions (0 when lossless).",
                [*buckets, ("_sum", self.kl_sum), ("_count", self.kl_count)],
            )
        if prompt_cache is not None:
            for name, kind, help, value in _prompt_cache_samples(prompt_cache):
                metric(name, kind, help, [("", value)])
        return "\n".join(lines) + "\n"


def _prompt_cache_samples(cache: dict) -> list[tuple[str, str, str, float]]:
    counter, gauge = "counter", "gauge"
    return [
        ("prompt_cache_hits_total", counter, "Generations that restored a saved cache.", cache["hits"]),
        ("prompt_cache_misses_total", counter, "Generations that restored none.", cache["misses"]),
        ("prompt_cache_saves_total", counter, "Live caches saved before a prompt cut them.", cache["saves"]),
        ("prompt_cache_evictions_total", counter, "Saved caches dropped for the bound.", cache["evictions"]),
        ("prompt_cache_bytes", gauge, "Bytes the saved caches hold.", cache["bytes"]),
        ("prompt_cache_max_bytes", gauge, "The bound on those bytes (--cache-ram).", cache["max_bytes"]),
        ("prompt_cache_entries", gauge, "Saved caches held.", cache["entries"]),
        ("prompt_cache_restore_seconds_total", counter, "Time spent restoring.", cache["restore_ms"] / 1000),
        ("prompt_cache_save_seconds_total", counter, "Time spent saving.", cache["save_ms"] / 1000),
        ("prompt_cache_disk_hits_total", counter, "Restores read from --cache-dir.", cache["disk_hits"]),
        ("prompt_cache_disk_writes_total", counter, "Files written to --cache-dir.", cache["disk_writes"]),
        ("prompt_cache_disk_bytes", gauge, "Bytes of files in --cache-dir.", cache["disk_bytes"]),
        ("prompt_cache_disk_max_bytes", gauge, "The bound on them (--cache-disk).", cache["disk_max_bytes"]),
        ("prompt_cache_disk_entries", gauge, "Files in --cache-dir.", cache["disk_entries"]),
    ]


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
