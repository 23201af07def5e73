"""Where streamed audio goes as chunks are ready: raw PCM on a byte stream, or a wav file that grows.

PCM is 24 kHz mono signed 16-bit little-endian. A growing wav is written under a temporary name beside the target
(its header's sizes filled in at the end) and renamed into place only when complete: a reader never finds a
half-written file under the final name.
"""

import struct
from pathlib import Path

import numpy as np

from .errors import HiggsError
from .outputs import commit, partial_file
from .wav import SAMPLE_RATE, pcm16

WAV_HEADER = 44
UNKNOWN_SIZE = 0xFFFFFFFF  # the RIFF and data sizes of a wav whose length is not known yet (streamed over HTTP)


def wav_header(data_bytes: int | None, sample_rate: int = SAMPLE_RATE) -> bytes:
    """The 44-byte header of a mono 16-bit wav; `None`: sizes unknown (0xFFFFFFFF), for a stream."""
    data = UNKNOWN_SIZE if data_bytes is None else data_bytes
    riff = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                           2 * sample_rate, 2, 16)
            + b"data" + struct.pack("<I", data))


class PcmSink:
    """Raw PCM to a binary stream (stdout), flushed chunk by chunk."""

    def __init__(self, stream, name: str = "standard output"):
        self.stream, self.name, self.samples, self.clipped = stream, name, 0, 0

    def write(self, chunk: np.ndarray) -> None:
        data, clipped = pcm16(chunk)
        try:
            self.stream.write(data)
            self.stream.flush()
        except BrokenPipeError:
            raise  # the reader left (`| head`): click exits quietly, as a pipe's writer should
        except OSError as e:
            raise HiggsError(f"{self.name}: cannot write ({e.strerror or e})") from None
        self.samples += len(chunk)
        self.clipped += clipped

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class WavSink(PcmSink):
    """A wav file written as it grows, under a temporary name until `close()` renames it into place."""

    def __init__(self, path: Path, inputs=()):
        self.path, self.inputs = Path(path), inputs
        _, self.tmp = partial_file(self.path, inputs)
        try:
            super().__init__(open(self.tmp, "wb"), str(self.path))
            self.stream.write(wav_header(0))
        except BaseException as e:
            self.tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise HiggsError(f"{self.path}: cannot write ({e.strerror or e})") from None
            raise

    def close(self) -> None:
        try:
            self.stream.seek(0)
            self.stream.write(wav_header(2 * self.samples))
            self.stream.close()  # the buffered tail is written here: a full disk may show only now
        except OSError as e:
            self.abort()
            raise HiggsError(f"{self.name}: cannot write ({e.strerror or e})") from None
        commit(self.tmp, self.path, self.inputs)

    def abort(self) -> None:
        try:
            self.stream.close()
        except OSError:  # flushing what a full disk refused fails again: the file goes anyway
            pass
        self.tmp.unlink(missing_ok=True)
