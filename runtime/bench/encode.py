"""Reference-encoding benchmark (`higgs-trt bench encode`): a synthetic voice-like recording of N seconds, 44.1 kHz
stereo wav, read + checked + resampled (runtime/audio.py), then the codec encoder alone, uncached."""

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from higgs_trt.runtime.audio import Encoder, encoder_inputs, load_reference_audio

FILE_RATE = 44100


def synthetic_voice(seconds: float, rate: int = FILE_RATE, seed: int = 0) -> np.ndarray:
    """[n, 2] float32 stereo with a voice's broad spectrum: a gliding 110–180 Hz harmonic source (harmonics to 5 kHz,
    falling 6 dB/octave to 1 kHz and 12 dB/octave above) under a 4 Hz syllable envelope, noise bursts between 2.5
    and 5 kHz 20 dB below the vowels (fricatives), a −60 dBFS noise floor; the right channel a delayed, quieter copy."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    f0 = 145 + 25 * np.sin(2 * np.pi * 0.6 * t) + 10 * np.sin(2 * np.pi * 2.3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / (k if k * 145 < 1000 else k * k * 145 / 1000) for k in range(1, int(5000 / 180)))
    envelope = np.sin(np.pi * 4 * t) ** 2
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / rate)
    hiss = np.fft.irfft(spectrum * ((freqs > 2500) & (freqs < 5000)), n)
    bursts = (np.sin(np.pi * 1.3 * t + 1.0) > 0.9).astype(float)
    left = 0.25 * voiced * envelope + 0.05 * hiss / np.abs(hiss).max() * bursts
    left = 0.5 * left / np.abs(left).max() + 1e-3 * rng.standard_normal(n)
    delay = int(0.0008 * rate)
    right = 0.8 * np.concatenate([np.zeros(delay), left[:-delay]]) + 1e-3 * rng.standard_normal(n)
    return np.stack([left, right], axis=1).astype(np.float32)


def run_encode_bench(encoder: Encoder, seconds: float = 10.0, repeats: int = 5) -> str:
    import soundfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reference.wav"
        soundfile.write(path, synthetic_voice(seconds), FILE_RATE, subtype="PCM_16")
        t0 = time.perf_counter()
        reference = load_reference_audio(path)
        read_ms = 1e3 * (time.perf_counter() - t0)
    inputs = encoder_inputs(reference, encoder.geometry)
    encoder.encode(*inputs)  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codes = encoder.encode(*inputs)
        times.append(time.perf_counter() - t0)
    encode_s = statistics.median(times)
    return (f"{encoder.name:<5} reference {seconds:.1f} s (44.1 kHz stereo wav): read+check+resample {read_ms:7.1f} ms  "
            f"encode {1e3 * encode_s:8.1f} ms (median of {repeats}; min {1e3 * min(times):.1f})  "
            f"{codes.shape[-1]} frames  {seconds / encode_s:6.1f}× real time")
