"""Named voices: `default` (zero-shot) and one per recording or codes file under `serve --voices DIR`."""

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from higgs_trt.runtime.audio import ReferenceAudio, load_reference_audio
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.prompt import check_text, load_reference_codes

VOICE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


@dataclass
class Voice:
    codes: np.ndarray | None = None  # reference codes [T, 8]; None for `default` (zero-shot)
    text: str | None = None  # transcript of the reference
    audio: ReferenceAudio | None = None  # a recording, encoded into `codes` when the engine starts


def load_voices(directory: Path | None, tokenizer) -> dict[str, Voice]:
    """`default`, and one voice per NAME in `directory`: NAME.wav|.flac|.ogg|.mp3 (a 1–30 s recording) or NAME.npy
    (codes [T,8], as `encode-audio` writes them), with an optional NAME.txt transcript. Anything else is refused."""
    voices = {"default": Voice()}
    if directory is None:
        return voices
    if not directory.is_dir():
        raise HiggsError(f"--voices {directory}: not a directory")
    files: dict[str, list[Path]] = {}
    for path in sorted(directory.iterdir()):
        if path.name.startswith("."):
            continue
        if not path.is_file() or path.suffix.lower() not in (*AUDIO_SUFFIXES, ".npy", ".txt"):
            raise HiggsError(f"{path}: not a voice file (NAME{'|'.join(AUDIO_SUFFIXES)} or NAME.npy, and an optional "
                             "NAME.txt transcript)")
        if not VOICE_NAME.fullmatch(path.stem) or path.stem == "default":
            raise HiggsError(f"{path}: a voice name is 1–64 letters, digits, '_' or '-', and not 'default'")
        files.setdefault(path.stem, []).append(path)
    for name, paths in files.items():
        refs = [p for p in paths if p.suffix.lower() != ".txt"]
        if len(refs) != 1:
            raise HiggsError(f"{directory}: voice {name!r} needs exactly one reference (a recording or codes .npy), "
                             f"found {len(refs)}")
        voice = Voice()
        if refs[0].suffix.lower() == ".npy":
            voice.codes = load_reference_codes(refs[0])
        else:
            voice.audio = load_reference_audio(refs[0])
        transcript = next((p for p in paths if p.suffix.lower() == ".txt"), None)
        if transcript is not None:
            try:
                text = transcript.read_text(encoding="utf-8").strip()
            except UnicodeDecodeError:
                raise HiggsError(f"{transcript}: not UTF-8 text") from None
            tokenizer.encode(check_text(text, str(transcript)), str(transcript))
            voice.text = text
        voices[name] = voice
    return voices
