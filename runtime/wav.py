"""24 kHz mono 16-bit wav output, written atomically (a temp file renamed into place: never a partial wav)."""

import wave
from pathlib import Path

import numpy as np

from .errors import HiggsError
from .outputs import output_file, write_file

SAMPLE_RATE = 24000

# The names callers used before the output rule moved to outputs.py (code on other branches still imports them).
check_writable, write_atomic = output_file, write_file


NON_FINITE = "NaN or infinite samples: the engine's weights are broken"


def pcm16(samples: np.ndarray) -> tuple[bytes, int]:
    """Float samples in [-1, 1] → s16le bytes, and how many samples had to be clipped. NaN or infinite samples
    (an engine whose weights are broken) are refused: they have no 16-bit value."""
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if not np.isfinite(samples).all():
        raise HiggsError(f"the decoded audio holds {NON_FINITE}")
    clipped = int(np.count_nonzero(np.abs(samples) > 1.0))
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes(), clipped


def write_wav(path: Path, samples: np.ndarray, sample_rate: int = SAMPLE_RATE, inputs=()) -> int:
    """Write float samples in [-1, 1] as 16-bit PCM; returns how many samples had to be clipped."""
    pcm, clipped = pcm16(samples)

    def write(tmp: Path) -> None:
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm)

    write_file(path, write, inputs)
    return clipped
