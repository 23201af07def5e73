"""transformers' `HiggsAudioV2TokenizerModel`, the codec oracle of tests/test_oracles.py (decode) and
tests/test_codec_encoder.py (encode), importable where torchaudio is not.

Its module imports torchaudio at import time, but only encode() uses it (`torchaudio.functional.resample`); the PyPI
torchaudio wheels do not load beside a CPU torch. Where torchaudio is not installed, one stand-in module, shared by
every test of the session, satisfies the import, and a test that encodes hands it its resampler:
`torchaudio_resample`, torchaudio's algorithm transcribed in torch."""

import importlib
import importlib.machinery
import importlib.util
import math
import sys
import types

import torch

MODULE = "transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer"


def _stand_in() -> types.ModuleType | None:
    """The torchaudio stand-in (made on first use), or None where the real torchaudio is installed."""
    module = sys.modules.get("torchaudio")
    if module is not None:
        return module if getattr(module, "higgs_stand_in", False) else None
    if importlib.util.find_spec("torchaudio") is not None:
        return None
    module = types.ModuleType("torchaudio")
    module.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    module.higgs_stand_in = True
    sys.modules["torchaudio"] = module
    return module


def hf_codec_class(resample=None):
    """The oracle class; `resample` stands in for torchaudio.functional.resample (encode only)."""
    stand_in = _stand_in()
    if stand_in is not None and resample is not None:
        stand_in.functional = types.SimpleNamespace(resample=resample)
    return importlib.import_module(MODULE).HiggsAudioV2TokenizerModel


def torchaudio_kernel(orig: int, new: int, dtype=torch.float32, zeros: int = 6, rolloff: float = 0.99):
    """torchaudio's `_get_sinc_resample_kernel` (sinc_interp_hann) for gcd-reduced rates, line by line: the kernel
    [new, 1, 2·width + orig] in `dtype` (resample passes the waveform's) and width."""
    base_freq = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / base_freq)
    idx = torch.arange(-width, width + orig, dtype=dtype)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new + idx
    t *= base_freq
    t = t.clamp_(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t *= math.pi
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * (base_freq / orig)
    return kernels, width


def torchaudio_resample(waveform: torch.Tensor, orig_freq: int, new_freq: int) -> torch.Tensor:
    """`torchaudio.functional.resample(waveform, orig_freq, new_freq)` at its defaults (6 zero crossings, roll-off
    0.99, Hann window): `_apply_sinc_resample_kernel` line by line — zero padding, strided conv1d, ⌈new·N/orig⌉."""
    if orig_freq == new_freq:
        return waveform
    gcd = math.gcd(orig_freq, new_freq)
    orig, new = orig_freq // gcd, new_freq // gcd
    kernel, width = torchaudio_kernel(orig, new, waveform.dtype)
    shape = waveform.size()
    waveform = waveform.reshape(-1, shape[-1])
    num_wavs, length = waveform.shape
    waveform = torch.nn.functional.pad(waveform, (width, width + orig))
    resampled = torch.nn.functional.conv1d(waveform[:, None], kernel, stride=orig)
    resampled = resampled.transpose(1, 2).reshape(num_wavs, -1)[..., :math.ceil(new * length / orig)]
    return resampled.reshape(shape[:-1] + resampled.shape[-1:])
