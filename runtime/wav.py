"""24 kHz mono 16-bit wav output, written atomically (a temp file renamed into place: never a partial wav)."""

import os
import tempfile
import wave
from pathlib import Path

import numpy as np

from .errors import HiggsError

SAMPLE_RATE = 24000


def check_writable(path: Path) -> None:
    """Fail before any work if `path` cannot be written."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise HiggsError(f"{path}: directory {parent} does not exist")
    if Path(path).is_dir():
        raise HiggsError(f"{path}: is a directory")
    if not os.access(parent, os.W_OK):
        raise HiggsError(f"{path}: directory {parent} is not writable")


def write_atomic(path: Path, write) -> None:
    """Call write(tmp_path), then rename tmp over `path`; on any failure nothing is left behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise HiggsError(f"{path}: cannot write ({e.strerror or e})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_wav(path: Path, samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> int:
    """Write float samples in [-1, 1] as 16-bit PCM; returns how many samples had to be clipped."""
    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    clipped = int(np.count_nonzero(np.abs(samples) > 1.0))
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")

    def write(tmp: Path) -> None:
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm.tobytes())

    write_atomic(path, write)
    return clipped
