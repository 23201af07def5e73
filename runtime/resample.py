"""torchaudio.functional.resample with its defaults (Hann-windowed sinc, 6 zero crossings, roll-off 0.99), in numpy.

The codec tokenizer's encode derives its 16 kHz (HuBERT) signal from the 24 kHz one with that call, so the codes the
model was trained on carry this filter's droop and aliasing; the runtime derives its 16 kHz branch the same way.
The arithmetic follows torchaudio's `_get_sinc_resample_kernel` / `_apply_sinc_resample_kernel` for a float32
waveform: rates reduced by their gcd, the kernel built in float32 as torchaudio builds it for that dtype, the signal
zero-padded by `width` before and `width + orig` after, one strided convolution per output phase, the output cut to
⌈new·N/orig⌉ samples.
"""

import math

import numpy as np

ZEROS = 6  # torchaudio's lowpass_filter_width: zero crossings of the sinc on each side
ROLLOFF = 0.99


def sinc_kernel(orig: int, new: int) -> tuple[np.ndarray, int]:
    """Kernel [new, 2·width + orig] float32 and `width`, for gcd-reduced rates, as torchaudio computes them."""
    base = min(orig, new) * ROLLOFF
    width = math.ceil(ZEROS * orig / base)
    idx = np.arange(-width, width + orig, dtype=np.float32)[None] / orig
    t = np.arange(0, -new, -1, dtype=np.float32)[:, None] / new + idx
    t = np.clip(t * base, -ZEROS, ZEROS)
    # the arguments in float32 as torchaudio forms them; sin and cos correctly rounded, where torch's float32 ones may
    # be an ulp off
    window = _f32(np.cos, t * math.pi / ZEROS / 2) ** 2
    t = t * math.pi
    with np.errstate(invalid="ignore"):
        kernel = np.where(t == 0, np.float32(1), _f32(np.sin, t) / t)
    return kernel * (window * (base / orig)), width


def _f32(fn, x: np.ndarray) -> np.ndarray:
    return fn(x.astype(np.float64)).astype(np.float32)


def resample(x: np.ndarray, orig: int, new: int) -> np.ndarray:
    """1-D float32 signal at `orig` Hz → float32 at `new` Hz, ⌈new·len/orig⌉ samples."""
    x = np.asarray(x, np.float32)
    if orig == new:
        return x
    gcd = math.gcd(orig, new)
    orig, new = orig // gcd, new // gcd
    kernel, width = sinc_kernel(orig, new)
    frames = len(x) // orig + 1  # conv1d's output length for the padded signal
    padded = np.pad(x.astype(np.float64), (width, width + orig))
    out = np.zeros((frames, new))
    # sums in float64, rounded to float32 once: the result does not hang on the order torch's conv1d adds in
    for i, tap in enumerate(kernel.T.astype(np.float64)):
        out += padded[i:i + orig * frames:orig, None] * tap
    return out.reshape(-1)[:-(-new * len(x) // orig)].astype(np.float32)
