"""Reference audio for voice cloning: file → checked mono signal → 24 kHz + 16 kHz → codec encoder → codes [T, 8].

Reading: `soundfile` (libsndfile: wav, flac, ogg/vorbis/opus, mp3, …); down-mix to mono by the channel mean.
Resampling: `soxr` (libsoxr, "HQ") from the file's rate to 24 kHz (the acoustic branch; a 24 kHz file passes
unchanged); the 16 kHz signal (HuBERT) is derived from the 24 kHz one with the tokenizer's own filter, torchaudio's
resample (runtime/resample.py), as transformers' encode does: equal 24 kHz signals give equal codes. Resampling stays
outside the encoder graph. docs/reference-audio.md has the whole path and the resamplers' accuracy.

The encoder graph has one path: when the acoustic branch would give a different frame count than the semantic one,
transformers pads the 24 kHz signal by hop/2 = 480 samples each side; `acoustic_padding` decides that here from
the graph's geometry (recorded in the manifest), and the padded signal is what the graph gets.

Encoded references are cached in this process by a hash of the decoded audio (samples + rate) and the encoder's
identity (checkpoint fingerprint + encoder graph digest), never by token ids: a server or a batch run encodes each
distinct reference once. Across processes, save codes with `higgs-trt encode-audio` and pass them as --ref-codes.
"""

import hashlib
import io
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from . import extras
from .errors import HiggsError
from .resample import resample
from .wav import SAMPLE_RATE  # the codec's rate (acoustic branch)
SEMANTIC_RATE = 16000  # HuBERT's rate
SEMANTIC_PAD = 160  # zeros each side of the 16 kHz signal (transformers' encode)
MIN_SECONDS, MAX_SECONDS = 1.0, 30.0
MAX_CHANNELS = 2
MIN_RATE = 8000  # telephone speech; below it a recording holds no voice to clone
SILENCE = 1e-3  # peak below −60 dBFS: nothing for the encoder to clone
LOUDEST = 100.0  # float samples are nominally within ±1; past ±100 (40 dB over full scale) a file is not audio
RESAMPLE_QUALITY = "HQ"
CACHE_SIZE = 32


@dataclass(frozen=True)
class ReferenceAudio:
    audio_24k: np.ndarray  # [N] float32
    audio_16k: np.ndarray  # [ceil(2N/3)] float32
    sha256: str  # of the decoded mono samples and their rate
    seconds: float
    source_rate: int


def load_reference_audio(path: Path, what: str | None = None) -> ReferenceAudio:
    """Read, check, down-mix and resample a reference recording; every problem is one HiggsError, which starts with
    `what` (default: the path)."""
    path = Path(path)
    what = what or str(path)
    if not path.is_file():
        raise HiggsError(f"{what}: reference audio {'is not a regular file' if path.exists() else 'not found'}")
    return _reference(str(path), what)


def reference_audio_from_bytes(data: bytes, what: str = "reference audio") -> ReferenceAudio:
    """The same, from an encoded file's bytes (a server's base64 upload); `what` names it in errors."""
    if not data:
        raise HiggsError(f"{what}: is empty (no audio bytes)")
    return _reference(io.BytesIO(data), what)


def _reference(source, name) -> ReferenceAudio:
    """`source`: a path or a file-like object soundfile reads; `name` starts every error message."""
    with extras.needed("audio", "reference audio"):
        import soundfile
        import soxr
    try:
        info = soundfile.info(source)
        _check_shape(name, info.channels, info.frames, info.samplerate)
        if not isinstance(source, str):
            source.seek(0)
        samples, rate = soundfile.read(source, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as e:  # unknown, corrupt, truncated
        why = (str(e).strip() or type(e).__name__).replace(f"Error opening {source!r}: ", "")  # an upload's repr
        if "does not exist" in why:  # libsndfile's words for a file that exists but no decoder accepts (a bad mp3)
            why = "corrupt, or not a format libsndfile decodes"
        raise HiggsError(f"{name}: cannot read audio ({why})") from None
    _check_shape(name, samples.shape[1], samples.shape[0], rate)
    if not np.isfinite(samples).all():
        raise HiggsError(f"{name}: contains NaN or infinite samples")
    peak = np.abs(samples).max()
    if peak > LOUDEST:  # float files only; the sum of two channels near float32's top overflows
        raise HiggsError(f"{name}: has samples up to {peak:.3g}, beyond ±{LOUDEST:g} (float audio lies within ±1)")
    mono = samples.mean(axis=1, dtype=np.float32)
    if np.abs(mono - mono.mean(dtype=np.float64)).max() < SILENCE:  # a constant (DC) offset is not sound
        raise HiggsError(f"{name}: is silent (peak below −60 dBFS once any DC offset is removed)")
    if rate == SAMPLE_RATE:  # the codec's own rate: the samples are what the tokenizer would get
        audio_24k = mono
    else:
        audio_24k = soxr.resample(mono, rate, SAMPLE_RATE, quality=RESAMPLE_QUALITY).astype(np.float32)
    audio_16k = resample(audio_24k, SAMPLE_RATE, SEMANTIC_RATE)
    digest = hashlib.sha256(np.int64(rate).tobytes() + mono.tobytes()).hexdigest()
    return ReferenceAudio(audio_24k, audio_16k, digest, len(mono) / rate, rate)


def _check_shape(path, channels: int, frames: int, rate: int) -> None:
    if channels > MAX_CHANNELS:
        raise HiggsError(f"{path}: has {channels} channels; reference audio must be mono or stereo")
    if frames <= 0 or rate <= 0:
        raise HiggsError(f"{path}: is empty (no audio samples)")
    if rate < MIN_RATE:
        raise HiggsError(f"{path}: sampled at {rate} Hz; reference audio needs at least {MIN_RATE} Hz")
    seconds = frames / rate
    # rounded away from the bound, so that 0.99996 s does not read "1.00 s … needs at least 1 s"
    if seconds < MIN_SECONDS:
        raise HiggsError(f"{path}: {math.floor(seconds * 100) / 100:.2f} s of audio; a reference needs at least "
                         f"{MIN_SECONDS:g} s")
    if seconds > MAX_SECONDS:
        raise HiggsError(f"{path}: {math.ceil(seconds * 10) / 10:.1f} s of audio; a reference may be at most "
                         f"{MAX_SECONDS:g} s (trim it)")


# ---- the encoder's input lengths -------------------------------------------------------------------------------

def conv_frames(length: int, convs: list) -> int:
    for kernel, stride, padding in convs:
        length = (length + 2 * padding - kernel) // stride + 1
    return length


def branch_frames(n_24k: int, n_16k: int, geometry: dict) -> tuple[int, int]:
    """(acoustic, semantic) frame counts of the encoder graph for signals of these lengths."""
    hubert = conv_frames(n_16k + 2 * geometry["semantic_pad"], geometry["semantic"])
    semantic = conv_frames(-(-hubert // geometry["semantic_downsample"]), geometry["semantic_encoder"])
    return conv_frames(n_24k, geometry["acoustic"]), semantic


def acoustic_padding(n_24k: int, n_16k: int, geometry: dict) -> int:
    """Samples of zeros each side of the 24 kHz signal: 0, or hop/2 when the branches' frame counts differ."""
    acoustic, semantic = branch_frames(n_24k, n_16k, geometry)
    if acoustic == semantic:
        return 0
    pad = geometry["acoustic_pad"]
    if branch_frames(n_24k + 2 * pad, n_16k, geometry)[0] != semantic:
        raise HiggsError(f"reference audio of {n_24k} + {n_16k} samples (24/16 kHz) gives no matching frame counts")
    return pad


# ---- encoding, cached ------------------------------------------------------------------------------------------

class Encoder(Protocol):
    name: str
    identity: str  # what the codes depend on besides the audio: checkpoint and encoder graph
    geometry: dict

    def encode(self, audio_24k: np.ndarray, audio_16k: np.ndarray) -> np.ndarray:
        """audio_24k [B,1,N] (padded by `acoustic_padding`), audio_16k [B,1,M] float32 → codes [B,8,T] int32."""


_cache: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()


def engine_identity(backend: str, engine) -> str:
    """What an engine directory's encoder codes depend on: backend, checkpoint, the encoder graph's bytes."""
    digest = engine.manifest["files"][engine.graph("codec_encoder")["file"]]
    return f"{backend}:{engine.fingerprint}:{digest.get('sha256') or digest.get('sampled_sha256')}"


def encoder_inputs(ref: ReferenceAudio, geometry: dict) -> tuple[np.ndarray, np.ndarray]:
    pad = acoustic_padding(len(ref.audio_24k), len(ref.audio_16k), geometry)
    return np.pad(ref.audio_24k, (pad, pad))[None, None], ref.audio_16k[None, None]


def encode_reference(ref: ReferenceAudio, encoder: Encoder) -> np.ndarray:
    """Reference codes [T, 8] int32 (the layout --ref-codes reads), from the cache when this audio was seen."""
    key = (encoder.identity, ref.sha256)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    codes = encoder.encode(*encoder_inputs(ref, encoder.geometry))[0].T.astype(np.int32)
    codes.flags.writeable = False
    _cache[key] = codes
    if len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return codes
