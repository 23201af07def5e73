"""Real-time scheduling: who is closest to a stall, and whether one more stream would push the others under real
time (issue 57).

A listener plays at 1×: a stream that has sent `emitted` frames since its first audio runs dry at
first_audio_at + emitted · 40 ms; one that has not started is due FIRST_AUDIO_TARGET after it was submitted. When more
streams hold slots than one step decodes (the scheduler's `lanes`), the streams whose deadlines come first are
decoded and the others, their clients' buffers furthest ahead, wait (earliest deadline first). A request's codes do
not depend on when its rows are decoded, so its audio stays the same; only its timing changes.

Capacity. A step over n slots takes the loop t(n) seconds (measured: StepTimes) and gives each of them `rows` frames.
With S streams of which L = min(S, lanes) are decoded at a time, each stream gets L · rows frames per S · t(L)
seconds, so all keep up while S · t(L) / (L · rows) ≤ 40 ms, less HEADROOM for what the measure misses (joins'
prefills, the codec's tail). A request that would break this is refused (the server's 429) rather than stalling
everyone.
"""

from dataclasses import dataclass, field

FRAME_SECONDS = 0.04
FIRST_AUDIO_TARGET = 0.3  # seconds after submission a stream that has not played yet is due
SWAP_MARGIN = 0.2  # seconds earlier a waiting stream's deadline must be than a decoded one's to take its lane
HEADROOM = 0.85  # of a frame's 40 ms the measured loop time per frame may take
MEASURE_WEIGHT = 0.2  # of each new step in the running mean of a batch size's loop time


def deadline(request) -> float:
    """When the request's listener runs out of audio (or, before its first audio, when that is due)."""
    if request.first_audio_at is None:
        return request.submitted_at + FIRST_AUDIO_TARGET
    return request.first_audio_at + request.emitted * FRAME_SECONDS


@dataclass
class StepTimes:
    """The loop's seconds per row launched, by the number of slots a step decoded: a running mean per size."""

    per_row: dict[int, float] = field(default_factory=dict)

    def record(self, slots: int, seconds: float, rows: int) -> None:
        seen = self.per_row.get(slots)
        value = seconds / rows
        self.per_row[slots] = value if seen is None else seen + MEASURE_WEIGHT * (value - seen)

    def estimate(self, slots: int) -> float | None:
        """Seconds per row of a step over `slots` slots: the measured size nearest at or above it (a step costs no
        less for fewer slots of its bucket), else the largest below scaled up in proportion; None before any."""
        above = [n for n in self.per_row if n >= slots]
        if above:
            return self.per_row[min(above)]
        if not self.per_row:
            return None
        largest = max(self.per_row)
        return self.per_row[largest] * slots / largest

    def keeps_up(self, streams: int, lanes: int) -> bool:
        """Whether `streams` streams, `lanes` of them decoded at a time, all get their frames in real time."""
        decoded = min(streams, lanes)
        seconds = self.estimate(decoded)
        return seconds is None or streams * seconds / decoded <= HEADROOM * FRAME_SECONDS
