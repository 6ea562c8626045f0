"""What a generation hands to its consumer: token events with their text, minus anything that
could still turn out to be part of a stop string. Imports no llama.cpp."""

from __future__ import annotations

from collections.abc import Sequence

from .events import StreamEvent
from .stats import GenerationStats


class StopFilter:
    """Holds back events whose text could begin a stop string. At a complete stop string the text
    is cut there and the events after the cut are dropped: those tokens were never shown."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending: list[StreamEvent] = []
        self.hit: str | None = None  # the stop string that ended the text, once one has

    def push(self, event: StreamEvent) -> tuple[list[StreamEvent], bool]:
        """(events safe to hand out now, whether a stop string was hit)."""
        self.pending.append(event)
        if not self.stops:
            return self.release(len(self.pending)), False
        text = "".join(e.text for e in self.pending)
        hits = sorted((text.find(stop), index) for index, stop in enumerate(self.stops) if stop in text)
        if hits:
            position, index = hits[0]
            self.hit = self.stops[index]
            return self.cut(position), True
        held = max((self._held_length(text, stop) for stop in self.stops), default=0)
        boundary, n_ready = len(text) - held, 0
        offset = 0
        for event in self.pending:
            offset += len(event.text)
            if offset > boundary:
                break
            n_ready += 1
        return self.release(n_ready), False

    @staticmethod
    def _held_length(text: str, stop: str) -> int:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                return length
        return 0

    def cut(self, position: int) -> list[StreamEvent]:
        kept, offset = [], 0
        for event in self.pending:
            if offset >= position:
                break
            kept.append(_with_text(event, event.text[: position - offset]))
            offset += len(event.text)
        self.pending = []
        return kept

    def release(self, n_events: int) -> list[StreamEvent]:
        ready, self.pending = self.pending[:n_events], self.pending[n_events:]
        return ready


def _with_text(event: StreamEvent, text: str) -> StreamEvent:
    return StreamEvent(
        text, event.token, event.from_draft, event.step, stats=event.stats, logprob=event.logprob
    )


class Output:
    """Turns emitted tokens into events: detokenizes (never half a UTF-8 character), holds back
    possible stop-string starts, cuts at a stop string, and records which tokens were shown.

    detokenizer: has ``add(token) -> str`` and ``flush() -> str``.
    """

    def __init__(self, detokenizer, stops: Sequence[str], stats: GenerationStats) -> None:
        self.detokenizer, self.stats = detokenizer, stats
        self.stop_filter = StopFilter(stops)
        self.shown: list[int] = []  # generated tokens handed to the consumer

    def push(self, token: int, from_draft: bool, step: int, logprob=None) -> tuple[list[StreamEvent], bool]:
        """(events ready to hand out, whether a stop string was hit)."""
        text = self.detokenizer.add(token)
        event = StreamEvent(text, token, from_draft, step, stats=self.stats, logprob=logprob)
        return self.stop_filter.push(event)

    def finish(self, finish: str, stopped_by_string: bool) -> tuple[list[StreamEvent], StreamEvent]:
        """The events still held back, and the final event (carrying the text the detokenizer
        held back, an unfinished UTF-8 character)."""
        ready: list[StreamEvent] = []
        hit = stopped_by_string
        if not hit:
            ready, hit = self.stop_filter.push(StreamEvent(self.detokenizer.flush(), None))
            if not hit:
                ready += self.stop_filter.release(len(self.stop_filter.pending))
        self.stats.finish_reason = "stop" if hit else finish
        self.stats.stop_string = self.stop_filter.hit
        tail = "".join(e.text for e in ready if e.token is None)
        final = StreamEvent(tail, None, finish_reason=self.stats.finish_reason, stats=self.stats)
        return [e for e in ready if e.token is not None], final

    def shown_events(self, events: list[StreamEvent]):
        """Hand events out, counting their tokens as shown (the caches may keep those only)."""
        for event in events:
            self.shown.append(event.token)
            self.stats.n_tokens = len(self.shown)
            yield event
