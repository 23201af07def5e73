"""Streaming codec windows whose audio equals the one-shot decode.

The codec decoder is not causal: every convolution pads symmetrically, so a sample depends on latent frames on
both sides. `receptive_field` derives how many, from the decoder's geometry alone, by walking an output sample's
dependency interval back through each layer (exact integer arithmetic):

  Conv1d(k, dilation d, padding p):          out[o] reads in[o − p + j·d], j = 0..k−1
  ConvTranspose1d(k, stride s, padding p):   out[o] reads in[i] where i·s − p + j = o, j = 0..k−1
  residual unit:                             the union of the branch and the identity

Layers, output to input: conv2 (k7), then per block from the last: 3 residual units (k7 at dilations 9, 3, 1, then
k1) and the transposed conv (k = 2·stride, padding ⌈stride/2⌉), then conv1 (k7). For Higgs' strides (8, 5, 4, 2, 3)
this gives 10 frames on each side: a window that carries L ≥ left and H ≥ right frames of real context around the
frames it emits decodes them exactly as the one-shot decode does; with one frame less, the seam samples differ.

Windows: the first chunk is `first` frames, then chunks grow to `chunk` frames, each at most RAMP times the audio
emitted before it (a 2-frame first chunk is followed by 8, then 25; after the default 8 the next is 25 already): a
chunk must be decoded before the audio sent ahead of it has played, and under load a row takes a sizeable share of
the 40 ms its frame plays, so 25 rows behind a 2-frame first chunk would arrive late. A stream of several segments
(long-form text, text streamed in) ramps up again where each segment starts: the chunk that reaches into a new
segment stops `first` frames into it, so a segment whose text came late is heard as soon as its first chunk is fixed.
Every window is decoded with up to `left` frames before and `right` after; the last window ends at the utterance's
end (where the one-shot decode pads too), never padded past it. A window reaches back as far as a middle window is
long (left + chunk + right frames, the extra ones real context: the same samples), so that an utterance's tail and a
segment's first chunk decode at the length of every other window (the GPU engine's captured codec graphs; eagerly,
~100 launches) unless the whole utterance is shorter. `first_right` < right trades exactness of the first chunk's
tail for earlier audio. A window's codec call returns the audio of its emitted frames alone (`Window.keep`), which an
engine may compute without the rest.
"""

from dataclasses import dataclass

from .decoding import CODEC_MAX_FRAMES
from .errors import HiggsError

RESIDUAL_DILATIONS = (1, 3, 9)
CONV_KERNEL = 7
RAMP = 4  # a chunk after the first is at most RAMP × the frames emitted before it


def conv_reads(lo: int, hi: int, k: int, d: int = 1) -> tuple[int, int]:
    """The input samples (inclusive) a same-padded Conv1d (kernel k, dilation d) reads for outputs lo..hi."""
    pad = d * (k - 1) // 2
    return lo - pad, hi - pad + d * (k - 1)


def transposed_reads(lo: int, hi: int, s: int) -> tuple[int, int]:
    """The input samples (inclusive) the codec's ConvTranspose1d (stride s, kernel 2s, padding ⌈s/2⌉) reads for
    outputs lo..hi."""
    k, pad = 2 * s, -(-s // 2)
    return -(-(lo + pad - k + 1) // s), (hi + pad) // s


def receptive_field(strides: tuple[int, ...]) -> tuple[int, int]:
    """(left, right): latent frames before / after frame t that some sample of frame t depends on."""
    hop = 1
    for s in strides:
        hop *= s

    t = 1000  # a frame far from both ends
    lo, hi = t * hop, t * hop + hop - 1
    lo, hi = conv_reads(lo, hi, CONV_KERNEL)  # conv2
    for s in reversed(strides):
        for d in reversed(RESIDUAL_DILATIONS):
            branch = conv_reads(*conv_reads(lo, hi, 1), CONV_KERNEL, d)
            lo, hi = min(lo, branch[0]), max(hi, branch[1])
        lo, hi = transposed_reads(lo, hi, s)
    lo, hi = conv_reads(lo, hi, CONV_KERNEL)  # conv1
    return t - lo, hi - t


@dataclass(frozen=True)
class Window:
    start: int  # first frame decoded
    stop: int  # one past the last frame decoded
    emit_from: int  # frames [emit_from, emit_to) are this window's audio
    emit_to: int

    @property
    def keep(self) -> tuple[int, int]:
        """The emitted frames within the window: a codec call decodes the window and returns their samples alone."""
        return self.emit_from - self.start, self.emit_to - self.start


@dataclass(frozen=True)
class StreamPlan:
    left: int
    right: int
    first: int = 8
    chunk: int = 25
    first_right: int | None = None  # None: `right` (exact); smaller: earlier first audio, not exact

    def __post_init__(self):  # the sizes come from the CLI's options, named here by them
        for option, value, low in (("--first-chunk", self.first, 1), ("--chunk", self.chunk, 1),
                                   ("--context", self.left, 0), ("--holdback", self.right, 0)):
            if value < low:
                raise HiggsError(f"{option} must be at least {low} frame{'s' * (low != 1)}, got {value}")
        if self.first_right is not None and not 0 <= self.first_right <= self.right:
            raise HiggsError(f"--first-holdback must lie in 0..{self.right} (the holdback), got {self.first_right}")
        widest = self.left + max(self.first, self.chunk) + self.right
        if widest > CODEC_MAX_FRAMES:
            raise HiggsError(f"a codec window of {widest} frames (--context {self.left} + chunk "
                             f"{max(self.first, self.chunk)} + --holdback {self.right}) exceeds the codec's "
                             f"{CODEC_MAX_FRAMES}-frame limit")

    @classmethod
    def exact(cls, strides: tuple[int, ...], first: int = 8, chunk: int = 25) -> "StreamPlan":
        left, right = receptive_field(strides)
        return cls(left, right, first, chunk)

    def windows(self, frames: int, starts: tuple[int, ...] = ()) -> list[Window]:
        """Every window of an utterance of `frames` frames (segments beginning at `starts`), in order, as they fall
        due while its frames are fixed one at a time."""
        windows, emitted = [], 0
        for ready in range(1, frames + 1):
            while window := self.next_window(emitted, ready, ready == frames, starts):
                windows.append(window)
                emitted = window.emit_to
        return windows

    def window_shapes(self) -> list[tuple[int, tuple[int, int]]]:
        """(frames, keep) of an utterance's windows once it is longer than the first few: the first chunks' (those
        still growing, and those that start at frame 0) and the middle windows'; and the final ones' at their widest
        (decoded once every frame is known, they reach back to a middle window's length: each keeps a part of all
        but its first `left` frames)."""
        frames = self.first + 4 * self.chunk + self.left + self.right
        middle = self.left + self.chunk + self.right
        shapes = {(w.stop - w.start, w.keep) for w in self.windows(frames)[:-1]}
        return sorted(shapes | {(middle, (self.left, middle))})

    def _next(self, emitted: int, starts: tuple[int, ...] = ()) -> tuple[int, int]:
        """(frames emitted, right holdback) of the window after `emitted` frames, unless the utterance ends first.
        `starts`: the frames where a later segment of the stream began (long-form, streamed text); the chunks ramp up
        again from each, so that a segment whose text came late is heard as soon as a first chunk of it is fixed."""
        if emitted == 0:
            return self.first, self.right if self.first_right is None else self.first_right
        since = emitted - max((b for b in starts if b <= emitted), default=0)
        size = self.first if since == 0 else min(self.chunk, RAMP * since)
        start = next((b for b in starts if emitted < b < emitted + size), None)
        if start is not None:  # a segment starts within: stop at its first chunk
            size = min(size, start - emitted + self.first)
        return size, self.right

    def due(self, emitted: int, starts: tuple[int, ...] = ()) -> int:
        """The fixed frames at which the window after `emitted` frames falls due (unless the utterance ends first)."""
        return emitted + sum(self._next(emitted, starts))

    def next_window(self, emitted: int, ready: int, final: bool, starts: tuple[int, ...] = ()) -> Window | None:
        """The next window once `ready` frames are fixed (`final`: no more will come), or None if not yet."""
        size, holdback = self._next(emitted, starts)
        if final:
            size = min(size, ready - emitted)
            if size <= 0:
                return None
        elif ready < emitted + size + holdback:
            return None
        stop = min(ready, emitted + size + holdback)
        # reach back to a whole window's length where there is more before: more real context, the same samples, and
        # the length of the middle windows (an engine's captured codec calls)
        start = max(0, min(emitted - self.left, stop - (self.left + self.chunk + self.right)))
        return Window(start, stop, emitted, emitted + size)
