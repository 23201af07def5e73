"""transformers' `HiggsAudioV2TokenizerModel`, the codec oracle of tests/test_oracles.py (decode) and
tests/test_codec_encoder.py (encode), importable where torchaudio is not.

Its module imports torchaudio at import time, but only encode() uses it (`torchaudio.functional.resample`); the PyPI
torchaudio wheels do not load beside a CPU torch. Where torchaudio is not installed, one stand-in module, shared by
every test of the session, satisfies the import, and a test that encodes hands it its resampler."""

import importlib
import importlib.machinery
import importlib.util
import sys
import types

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
