"""Streaming codec windows: the receptive field derived from the geometry is the real one, and streamed audio equals
the one-shot decode (fp32, CPU) exactly when the windows carry that much context — and not with one frame less."""

import numpy as np
import pytest
import torch

from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.runtime.decoding import EOC, Utterance, apply_delay
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.gpu.codec import CodecDecoder
from higgs_trt.runtime.streaming import CODEC_MAX_FRAMES, StreamPlan, receptive_field


@pytest.fixture(scope="module")
def codec(tiny_ckpt):
    return CodecDecoder.from_checkpoint(Checkpoint(tiny_ckpt)).double()


def decode(codec, frames: np.ndarray, keep: tuple[int, int] | None = None) -> np.ndarray:
    with torch.no_grad():
        return codec(torch.from_numpy(frames.T[None].astype(np.int64)), keep).numpy()[0, 0]


def streamed(codec, frames: np.ndarray, plan: StreamPlan) -> np.ndarray:
    """Frames arrive one at a time; every window due is decoded at its own length, its emitted frames alone (as
    the scheduler asks the engines); then the final ones."""
    out = [decode(codec, frames[w.start:w.stop], w.keep) for w in plan.windows(len(frames))]
    return np.concatenate(out) if out else np.zeros(0)


def test_the_receptive_field_from_the_geometry_is_the_real_one(codec):
    """Change one latent frame: exactly the samples of frames within (left, right) of it change."""
    left, right = receptive_field(codec.dims.strides)
    assert (left, right) == (10, 10)  # Higgs' strides (8, 5, 4, 2, 3); the tiny codec shares them
    frames = np.random.default_rng(0).integers(0, 1024, size=(60, 8))
    base = decode(codec, frames)
    changed = frames.copy()
    changed[30] = (changed[30] + 512) % 1024
    diff = np.flatnonzero(np.abs(decode(codec, changed) - base) > 1e-12)
    hop = 960
    assert diff.min() // hop == 30 - right and diff.max() // hop == 30 + left


@pytest.mark.parametrize("frames, keep", [(45, (10, 35)), (45, (10, 45)), (18, (0, 8)), (43, (8, 33)), (45, (0, 45)),
                                          (60, (30, 31)), (7, (2, 5)), (1, (0, 1)), (30, (29, 30))])
def test_a_window_decodes_its_kept_frames_alone_as_the_whole_decode_does(codec, frames, keep):
    """Each layer computes only the samples the kept ones depend on (in double precision: a sample computed from
    a zero where the whole decode had a real neighbour would be off by far more than rounding)."""
    codes = np.random.default_rng(frames).integers(0, 1024, size=(frames, 8))
    whole = decode(codec, codes)[keep[0] * 960:keep[1] * 960]
    got = decode(codec, codes, keep)
    assert got.shape == whole.shape and np.abs(got - whole).max() < 1e-12 * (1 + np.abs(whole).max())


@pytest.mark.parametrize("length", [63, 64, 70])
@pytest.mark.parametrize("dilation", [3, 9])
def test_a_dilated_convolution_runs_undilated_over_its_phases(length, dilation):
    """The cropped decode's dilated convolutions (codec._dilated_rows): lengths that are and are not multiples of the
    dilation, zeros past the window's edges."""
    from higgs_trt.runtime.gpu.codec import _conv_rows

    torch.manual_seed(length)
    conv = torch.nn.Conv1d(6, 5, 7, dilation=dilation, bias=False).double()
    x = torch.randn(2, length, 6, dtype=torch.float64)
    for edges in ((0, 0), (3, 9)):
        want = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), edges), conv.weight,
                                          dilation=dilation).transpose(1, 2)
        got = _conv_rows(conv, x, edges)
        assert got.shape == want.shape and (got - want).abs().max() < 1e-12


def test_the_fp16_codec_decodes_within_fp16s_rounding(codec, tiny_ckpt):
    """The GPU engine's codec (CodecDecoder.fp16: every convolution and the activations between passes in fp16) gives
    fp32 samples within fp16's rounding of the exact decode (run here on the CPU: the same ops), windows and the
    whole alike."""
    half = CodecDecoder.from_checkpoint(Checkpoint(tiny_ckpt)).channels_last().fp16()
    convs = [m for m in half.acoustic_decoder.modules() if isinstance(m, torch.nn.Conv1d)]
    assert convs and all(m.weight.dtype == torch.float16 for m in convs)
    frames = np.random.default_rng(1).integers(0, 1024, size=(45, 8))
    for keep in ((10, 35), None):
        want = decode(codec, frames, keep)
        with torch.no_grad():
            got = half(torch.from_numpy(frames.T[None].astype(np.int64)), keep)
        assert got.dtype == torch.float32 and got.shape[-1] == want.shape[-1]
        error_db = 10 * np.log10(np.mean((got.numpy()[0, 0] - want) ** 2) / np.mean(want ** 2))
        assert -70 < error_db < -40, error_db  # fp16's rounding: there, and no more


@pytest.mark.parametrize("first", [8, 2])
@pytest.mark.parametrize("length", [5, 8, 33, 61, 100])
def test_streamed_equals_one_shot(codec, length, first):
    frames = np.random.default_rng(length).integers(0, 1024, size=(length, 8))
    plan = StreamPlan.exact(codec.dims.strides, first=first)
    got, want = streamed(codec, frames, plan), decode(codec, frames)
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5


@pytest.mark.parametrize("short", ["left", "right"])
def test_one_frame_less_context_is_not_exact(codec, short):
    """The test has teeth: the seams of a plan one frame short of the receptive field differ from the one-shot."""
    left, right = receptive_field(codec.dims.strides)
    plan = StreamPlan(left - (short == "left"), right - (short == "right"))
    frames = np.random.default_rng(7).integers(0, 1024, size=(100, 8))  # a middle window past the first frames
    assert np.abs(streamed(codec, frames, plan) - decode(codec, frames)).max() > 1e-5


@pytest.mark.parametrize("length", [44, 45, 46, 61, 100, 243])
def test_every_window_after_the_first_has_one_length(length):
    """The last window reaches back to a middle window's length (so the GPU engine replays one captured graph for
    it), emitting only what is left; an utterance shorter than that decodes whole."""
    plan = StreamPlan.exact((8, 5, 4, 2, 3))
    windows = plan.windows(length)
    full = plan.left + plan.chunk + plan.right
    assert windows[-1].emit_to == length and windows[-1].stop == length
    assert all(w.stop - w.start == min(full, w.stop) for w in windows[1:])
    assert all(a.emit_to == b.emit_from for a, b in zip(windows, windows[1:]))
    if length >= full:  # the lengths the GPU engine captures cover every window
        shapes = plan.window_shapes()
        assert all(any(f == w.stop - w.start and a <= w.keep[0] and w.keep[1] <= b for f, (a, b) in shapes)
                   for w in windows)


@pytest.mark.parametrize("first, sizes", [(8, [8, 25, 25]), (2, [2, 8, 25]), (1, [1, 4, 20, 25]), (30, [30, 25])])
def test_chunks_grow_to_the_chunk_size_at_most_fourfold(first, sizes):
    """A small first chunk is followed by chunks at most 4× the audio before them, so that each one is decoded while
    that audio plays; the default 8 is followed by 25 at once."""
    emitted = [w.emit_to - w.emit_from for w in StreamPlan.exact((8, 5, 4, 2, 3), first=first).windows(300)]
    assert emitted[:len(sizes)] == sizes and set(emitted[len(sizes):-1]) == {25} and sum(emitted) == 300


@pytest.mark.parametrize("starts", [(33, 34, 90), (8, 60, 61, 62, 150)])
def test_chunks_ramp_up_again_where_a_segment_starts_and_stay_exact(codec, starts):
    """The chunk reaching into a segment stops `first` frames into it (or sooner); the next grows from there. Every window still
    carries the whole receptive field (the stream's audio is the one-shot decode), and once the stream is that long
    it is as long as a middle window with its kept frames inside one, so the GPU engine replays its captured graphs."""
    plan = StreamPlan.exact(codec.dims.strides)
    frames = np.random.default_rng(sum(starts)).integers(0, 1024, size=(160, 8))
    windows = plan.windows(len(frames), starts)
    for start in starts:
        assert any(w.emit_from < start < w.emit_to <= start + plan.first or w.emit_from == start for w in windows)
    shapes, middle = plan.window_shapes(), plan.left + plan.chunk + plan.right
    assert all(any(f == w.stop - w.start and a <= w.keep[0] and w.keep[1] <= b for f, (a, b) in shapes)
               for w in windows if w.stop >= middle)
    out = np.concatenate([decode(codec, frames[w.start:w.stop], w.keep) for w in windows])
    whole = decode(codec, frames)
    assert np.abs(out - whole).max() < 1e-12 * (1 + np.abs(whole).max())


def test_window_shapes_name_the_first_windows_the_middle_ones_and_the_last():
    """The second window starts at frame 0 while the first chunk is shorter than the left context: 8 + 25 + 10; the
    last window keeps up to a chunk at the end of a middle window's length."""
    assert StreamPlan.exact((8, 5, 4, 2, 3)).window_shapes() == [(18, (0, 8)), (43, (8, 33)), (45, (10, 35)),
                                                                 (45, (10, 45))]
    assert StreamPlan.exact((8, 5, 4, 2, 3), first=2).window_shapes() == [(12, (0, 2)), (20, (2, 10)),
                                                                          (45, (10, 35)), (45, (10, 45))]
    assert StreamPlan(10, 10, first=12, first_right=4).window_shapes() == [(16, (0, 12)), (45, (10, 35)),
                                                                          (45, (10, 45))]


def test_an_utterance_ending_by_eoc_in_its_first_rows_streams_what_it_has(codec):
    u = Utterance(max_rows=100)
    rows = apply_delay(np.random.default_rng(3).integers(0, 1024, size=(3, 8)).astype(np.int32))
    rows[3, 0] = EOC  # EOC on codebook 0 at row 3: three frames
    for row in np.concatenate([rows, np.full((8, 8), EOC, np.int32)]):
        if not u.done:
            u.push(row)
    assert u.done and u.stop_reason == "eoc" and u.ready() == 3
    got = streamed(codec, u.frames(), StreamPlan.exact(codec.dims.strides))
    assert np.abs(got - decode(codec, u.frames())).max() < 1e-5 and len(got) == 3 * 960


def test_plan_bounds_are_refused():
    with pytest.raises(HiggsError, match="^--first-chunk must be at least 1 frame, got 0$"):
        StreamPlan(10, 10, first=0)
    with pytest.raises(HiggsError, match="^--context must be at least 0 frames, got -1$"):
        StreamPlan(-1, 10)
    with pytest.raises(HiggsError, match=r"\(--context 60 \+ chunk 25 \+ --holdback 60\) exceeds the codec's 128-frame"):
        StreamPlan(60, 60, chunk=25)
    with pytest.raises(HiggsError, match=r"^--first-holdback must lie in 0\.\.10 \(the holdback\), got 11$"):
        StreamPlan(10, 10, first_right=11)
    assert StreamPlan(10, 10, chunk=CODEC_MAX_FRAMES - 20).chunk == CODEC_MAX_FRAMES - 20
