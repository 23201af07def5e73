"""Decode semantics shared by every backend: delay pattern, delay mask, stopping rules, sanitising, sampling.

Vocabulary of one codebook: codes 0..1023, BOC 1024 (stream begin), EOC 1025 (stream end).
One decode step emits one *row* of 8 codes. Codebook k lags k rows behind codebook 0 (MusicGen delay
[0..7]), so frame t of audio is (row[t][0], row[t+1][1], ..., row[t+7][7]).
"""

from dataclasses import dataclass, field

import numpy as np

NUM_CODEBOOKS = 8
CODEBOOKS = range(NUM_CODEBOOKS)
CODEBOOK_SIZE = 1024
BOC = 1024
EOC = 1025
AUDIO_VOCAB = 1026

REPEAT_GUARD_ROWS = 32  # this many identical rows in a row end the utterance
HARD_CAP_ROWS = 2048  # ≈ 82 s of audio whatever the text
FRAMES_PER_SECOND = 25
SAMPLES_PER_FRAME = 960  # 24 kHz / 25 fps
NO_END = np.int64(1 << 40)  # end_frame while the utterance's end is unknown: never reached by row - k
CODEC_MAX_FRAMES = 128  # frames per codec call: audio is decoded in streaming windows of at most this many


# ---- delay pattern --------------------------------------------------------------------------------------------

def apply_delay(frames: np.ndarray) -> np.ndarray:
    """Frames [T, K] → delayed rows [T+K-1, K]: BOC above each codebook's start, EOC after its end."""
    t, k = frames.shape
    rows = np.full((t + k - 1, k), BOC, dtype=np.int32)
    for cb in range(k):
        rows[cb:cb + t, cb] = frames[:, cb]
        rows[cb + t:, cb] = EOC
    return rows


def revert_delay(rows: np.ndarray) -> np.ndarray:
    """Delayed rows [L, K] → frames [L-K+1, K] with frame[t][k] = row[t+k][k] (empty when L < K)."""
    n, k = rows.shape
    t = max(n - k + 1, 0)
    frames = np.empty((t, k), dtype=rows.dtype)
    for cb in range(k):
        frames[:, cb] = rows[cb:cb + t, cb]
    return frames


def delay_mask(codes: np.ndarray, row: np.ndarray, end_frame: np.ndarray) -> np.ndarray:
    """Force the codes of row `row` [B] that the delay pattern fixes, whatever the model chose.

    Codebook k is BOC before row k (ramp-up) and EOC once its frame (row - k) is at or past the utterance's
    end frame (ramp-down, as in the training layout). `end_frame` is a huge number while the end is unknown.
    The decode graphs compute exactly this; the runtime uses it after host-side sampling.
    """
    k = np.arange(codes.shape[-1])
    row = np.asarray(row)[:, None]
    end = np.asarray(end_frame)[:, None]
    out = np.where(row < k, BOC, codes)
    return np.where(row - k >= end, EOC, out).astype(np.int32)


def sanitize(frames: np.ndarray) -> np.ndarray:
    """Special codes (BOC, EOC, anything outside 0..1023) → 0. Never clamp: 1025→1023 is a real, wrong code."""
    return np.where((frames >= 0) & (frames < CODEBOOK_SIZE), frames, 0).astype(np.int32)


# ---- stopping -------------------------------------------------------------------------------------------------

def row_cap(text_chars: int, hard_cap: int = HARD_CAP_ROWS) -> int:
    """Most rows one utterance may take: 3 s plus 1 s per 4 characters of text (slower than any speech)."""
    seconds = 3 + -(-max(text_chars, 0) // 4)
    return min(hard_cap, NUM_CODEBOOKS - 1 + FRAMES_PER_SECOND * seconds)


def find_end(row_codes: np.ndarray, row: int, end_frame: int) -> int:
    """The utterance's end frame after row `row` [8]: EOC on codebook 0 ends the audio at this row's frame; after the
    ramp-up (row ≥ 8), EOC on codebook k ends it at frame row - k. The earliest end wins."""
    for k in np.flatnonzero(np.asarray(row_codes) == EOC):
        if (k == 0 or row >= NUM_CODEBOOKS) and row - k >= 0:
            end_frame = min(end_frame, row - int(k))
    return end_frame


@dataclass
class Utterance:
    """The rows of one utterance and the rules that end it.

    - The end frame follows `find_end`; decoding continues until every kept frame is complete (end + 7 rows).
    - 32 identical rows in a row, or `max_rows` rows, also stop it (keeping the complete frames).
    Frames are de-delayed as rows arrive: frame t is complete once row t + 7 exists. They are kept as numpy rows,
    converted one frame per push: a codec call of many windows then slices them instead of converting tens of
    thousands of Python ints at once while the decode stream idles.
    """

    max_rows: int
    # False: only the row cap ends it and every row completes a frame, EOC or not (benchmarks fix the length: random
    # weights repeat rows and emit EOC at random)
    stop_rules: bool = True
    rows: list = field(default_factory=list)  # each row's 8 codes, as a list
    end_frame: int | None = None
    stop_reason: str | None = None
    _repeats: int = 0
    _frames: np.ndarray = field(default_factory=lambda: np.zeros((64, NUM_CODEBOOKS), np.int32))

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def _complete(self) -> int:
        """Frames de-delayed so far: frame t once row t + 7 exists."""
        return max(0, len(self.rows) - NUM_CODEBOOKS + 1)

    def push(self, row) -> None:
        """One row; the host's per-row work (for every busy request at every row), so plain Python on the row's list
        of codes: numpy calls on 8 values cost several µs each."""
        assert self.stop_reason is None, "push after the utterance ended"
        rows = self.rows
        j = len(rows)
        codes = row.tolist() if isinstance(row, np.ndarray) else list(row)  # a copy: backends reuse their buffers
        if EOC in codes and self.stop_rules:
            end = find_end(codes, j, NO_END if self.end_frame is None else self.end_frame)
            self.end_frame = None if end == NO_END else int(end)
        self._repeats = self._repeats + 1 if j and codes == rows[-1] else 1
        rows.append(codes)
        t = j - NUM_CODEBOOKS + 1
        if t >= 0:
            if t == len(self._frames):
                self._frames = np.concatenate([self._frames, np.zeros_like(self._frames)])
            self._frames[t] = list(map(list.__getitem__, rows[t:], CODEBOOKS))  # codebook k of row t + k
        if not self.stop_rules:
            self.stop_reason = "cap" if j + 1 >= self.max_rows else None
        elif self.end_frame is not None and j + 1 >= self.rows_needed(self.end_frame):
            self.stop_reason = "eoc"
        elif self._repeats >= REPEAT_GUARD_ROWS:
            self.stop_reason = "repeat"
        elif j + 1 >= self.max_rows:
            self.stop_reason = "cap"

    @staticmethod
    def rows_needed(end_frame: int) -> int:
        return end_frame + NUM_CODEBOOKS - 1 if end_frame > 0 else 0

    def ready(self) -> int:
        """Frames that are complete and before the end: they will not change."""
        return self._complete if self.end_frame is None else min(self._complete, self.end_frame)

    def frames(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Frames [start, stop) of the utterance [T, 8] (default: all ready ones), sanitised."""
        return sanitize(self.codes(start, stop))

    def codes(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Frames [start, stop) as decoded, special codes included (a view: sanitize before use, as `frames`
        does; a codec call of many windows sanitizes them all at once)."""
        stop = self.ready() if stop is None else stop
        return self._frames[start:min(stop, self._complete)]


class CodeStream:
    """A request's frames: its segments' utterances one after another, as one stream. The codec windows decode the
    stream, not each utterance, so the frame boundary between two segments is decoded like any other: no seam.
    Frames of an ended segment are its ready ones (up to its end frame)."""

    def __init__(self):
        self._ended = np.zeros((0, NUM_CODEBOOKS), np.int32)  # frames of the segments that ended
        self.current: Utterance | None = None
        self.segments = 0
        self.bounds: list[int] = []  # the stream's frames at the end of each segment that ended
        self.rows = 0  # rows of the segments that ended
        self.finished = False  # no segment will follow the current one
        # a flush ends the stream's audio at part_end as an utterance's end; the frames after it, from part_start on,
        # are decoded as a new utterance's (the one seam, which the client asked for)
        self.part_start, self.part_end = 0, None

    def start(self, utterance: Utterance) -> None:
        self.current = utterance
        self.segments += 1

    def end_segment(self) -> np.ndarray:
        """The current segment's frames [T, 8] as decoded, now part of the stream before the next one."""
        u, self.current = self.current, None
        frames = u.codes(0, u.ready()).copy()
        self._ended = np.concatenate([self._ended, frames])
        self.bounds.append(len(self._ended))
        self.rows += len(u.rows)
        return frames

    @property
    def done(self) -> bool:
        """Every segment has ended: the stream's frames will not grow."""
        return self.finished and (self.current is None or self.current.done)

    @property
    def total_rows(self) -> int:
        return self.rows + (len(self.current.rows) if self.current is not None else 0)

    def ready(self) -> int:
        return len(self._ended) + (self.current.ready() if self.current is not None else 0)

    def codes(self, start: int, stop: int) -> np.ndarray:
        """Frames [start, stop) as decoded, special codes included (sanitize before use)."""
        ended = len(self._ended)
        if stop <= ended or self.current is None:
            return self._ended[start:stop]
        later = self.current.codes(max(start - ended, 0), stop - ended)
        return later if start >= ended else np.concatenate([self._ended[start:], later])

    def frames(self) -> np.ndarray:
        """Every ready frame [T, 8], sanitised."""
        return sanitize(self.codes(0, self.ready()))


# ---- choosing codes -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax, ties to the lowest index); otherwise seeded sampling per codebook
    (runtime/sampling.py)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0
