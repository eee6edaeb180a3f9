"""Where the pipeline is between ``train_batch`` calls: the micro-batches fed so far and the next clock.

The engine keeps one :class:`Timeline`; each call is a :class:`Window` of clocks; checkpoints save the
timeline's clock and fed intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .clock import delay

@dataclass(frozen=True)
class FedMicroBatches:
    """The micro-batches fed to stage 0, as sorted half-open index intervals.

    Micro-batch ``m`` enters at clock ``m``; a clock that feeds nothing (a drain, a short batch) leaves
    a hole in the numbering, so indices stay equal to entry clocks and the equations above stay exact.
    """

    intervals: tuple[tuple[int, int], ...] = ()

    def fed(self, m: int) -> bool:
        return any(lo <= m < hi for lo, hi in self.intervals)

    def ordinal(self, m: int) -> int:
        """How many fed micro-batches have an index ``<= m`` (1 for the first one fed)."""
        return sum(max(0, min(hi, m + 1) - lo) for lo, hi in self.intervals)

    @property
    def total(self) -> int:
        return sum(hi - lo for lo, hi in self.intervals)

    @property
    def last(self) -> int | None:
        return self.intervals[-1][1] - 1 if self.intervals else None

    def feed(self, start: int, count: int) -> "FedMicroBatches":
        """This log plus ``count`` micro-batches entering at clocks ``start, start+1, ...``."""
        if count < 0:
            raise ValueError(f"cannot feed {count} micro-batches")
        if count == 0:
            return self
        if self.last is not None and start <= self.last:
            raise ValueError(f"micro-batch {start} would enter before the last one fed ({self.last})")
        intervals = list(self.intervals)
        if intervals and intervals[-1][1] == start:
            intervals[-1] = (intervals[-1][0], start + count)
        else:
            intervals.append((start, start + count))
        return FedMicroBatches(tuple(intervals))

    def drained_at(self, petra_stages: int) -> int:
        """The first clock at which no fed micro-batch has a backward still to run."""
        return 0 if self.last is None else self.last + delay(0, petra_stages) + 1


@dataclass(frozen=True)
class Window:
    """A run of clocks: ``train_batch`` (k clocks feeding up to k micro-batches) or ``drain``."""

    start_clock: int
    clocks: int
    micro_batches: int
    feed: FedMicroBatches


@dataclass
class Timeline:
    """Where the pipeline is between windows: the next clock and the micro-batches fed so far."""

    petra_stages: int
    clock: int = 0
    feed: FedMicroBatches = field(default_factory=FedMicroBatches)

    def train_window(self, clocks: int, micro_batches: int | None = None, synchronous: bool = False) -> Window:
        """``clocks`` clocks feeding ``micro_batches`` (default: one per clock) from the first one; ``synchronous``:
        then on until every fed micro-batch had its backward everywhere (a fill and a drain: GPipe's schedule)."""
        micro_batches = clocks if micro_batches is None else micro_batches
        if not 0 <= micro_batches <= clocks:
            raise ValueError(f"cannot feed {micro_batches} micro-batches in {clocks} clocks")
        feed = self.feed.feed(self.clock, micro_batches)
        if synchronous:
            clocks = max(clocks, feed.drained_at(self.petra_stages) - self.clock)
        return Window(self.clock, clocks, micro_batches, feed)

    def drain_window(self) -> Window:
        """The clocks, with no new data, until every fed micro-batch had its backward everywhere."""
        clocks = max(0, self.feed.drained_at(self.petra_stages) - self.clock)
        return Window(self.clock, clocks, 0, self.feed)

    def advance(self, window: Window) -> None:
        if window.start_clock != self.clock:
            raise ValueError(f"window starts at clock {window.start_clock}, timeline is at {self.clock}")
        self.clock += window.clocks
        self.feed = window.feed

    @property
    def in_flight(self) -> bool:
        return self.clock < self.feed.drained_at(self.petra_stages)
