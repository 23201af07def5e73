"""Named voices: `default` (zero-shot) and those stored under `serve --voices DIR`, one per NAME:

  NAME.wav|.flac|.ogg|.mp3   a 1–30 s recording, encoded when the engine starts
  NAME.npy                   reference codes [T, 8], as `encode-audio` writes them
  NAME.txt                   beside either: the reference's transcript
  NAME.npz                   a voice uploaded through the API: codes and transcript in one file, written under a
                             temporary name and renamed, so a failure or a crash leaves the old voice or the new one

The server's `/v1/audio/voices` routes add and delete voices here; the files are what the next start reads.
"""

import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from higgs_trt.runtime.audio import ReferenceAudio, load_reference_audio
from higgs_trt.runtime.decoding import FRAMES_PER_SECOND, Sampling
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.inputs import CODES_BYTES, input_file
from higgs_trt.runtime.outputs import write_file
from higgs_trt.runtime.prompt import build_prompt, check_reference_codes, check_text, load_reference_codes
from higgs_trt.runtime.request import request_for

VOICE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
REFERENCES = (*AUDIO_SUFFIXES, ".npy", ".npz")
UPLOADED = ".npz"
CHECK_TEXT = "Hello."  # a voice must leave room for this beside it in the engine's prefill


@dataclass
class Voice:
    codes: np.ndarray | None = None  # reference codes [T, 8]; None for `default` (zero-shot)
    text: str | None = None  # transcript of the reference
    audio: ReferenceAudio | None = None  # a recording, encoded into `codes` when the engine starts
    files: tuple[Path, ...] = ()  # where it is stored

    def describe(self, name: str) -> dict:
        frames = len(self.codes) if self.codes is not None else 0
        return {"name": name, "seconds": frames / FRAMES_PER_SECOND, "transcript": self.text,
                "stored": [p.name for p in self.files]}


def check_name(name: str, what: str = "voice name") -> str:
    if not isinstance(name, str) or not VOICE_NAME.fullmatch(name) or name == "default":
        raise HiggsError(f"{what} {str(name)[:80]!r}: a voice name is 1–64 letters, digits, '_' or '-', and not "
                         "'default'")
    return name


def check_fits(engine, tokenizer, codes: np.ndarray, text: str | None) -> None:
    """A voice no request could use (its reference leaves no room in the engine's prefill) is refused up front, not
    at each request; `engine`: anything with max_prompt and max_seq (an EngineSpec)."""
    request_for(engine, build_prompt(tokenizer, CHECK_TEXT, codes, text), Sampling())


def prepare_voices(voices: dict[str, Voice], encode, no_encoder: str | None, engine, tokenizer) -> None:
    """When the engine is there: recorded voices encoded (`encode`: audio → codes; None: no encoder, `no_encoder`
    says why) and every voice checked to fit the engine."""
    for name, voice in voices.items():
        if voice.audio is not None:
            if encode is None:
                raise HiggsError(f"voice {name!r} is a recording, but: {no_encoder}")
            voice.codes, voice.audio = encode(voice.audio), None
        if voice.codes is not None:
            try:
                check_fits(engine, tokenizer, voice.codes, voice.text)
            except HiggsError as e:
                raise HiggsError(f"voice {name!r} does not fit this engine: {e}") from None


class VoiceStore:
    """The voices a server (or `run --voices`) knows, by name; every file under `directory` checked when loaded."""

    def __init__(self, directory: Path | None, tokenizer):
        self.directory, self.tokenizer = directory, tokenizer
        self.voices: dict[str, Voice] = {"default": Voice()}
        if directory is None:
            return
        if not directory.is_dir():
            raise HiggsError(f"--voices {directory}: not a directory")
        files: dict[str, list[Path]] = {}
        for path in sorted(directory.iterdir()):
            if path.name.startswith("."):
                continue
            if not path.is_file() or path.suffix.lower() not in (*REFERENCES, ".txt"):
                raise HiggsError(f"{path}: not a voice file (NAME{'|'.join(REFERENCES)}, and an optional NAME.txt "
                                 "transcript)")
            try:
                check_name(path.stem)
            except HiggsError:
                raise HiggsError(f"{path}: a voice name is 1–64 letters, digits, '_' or '-', and not 'default'") from None
            files.setdefault(path.stem, []).append(path)
        for name, paths in files.items():
            self.voices[name] = self._load(directory, name, paths)

    def _load(self, directory: Path, name: str, paths: list[Path]) -> Voice:
        refs = [p for p in paths if p.suffix.lower() != ".txt"]
        transcript = next((p for p in paths if p.suffix.lower() == ".txt"), None)
        if len(refs) != 1:
            raise HiggsError(f"{directory}: voice {name!r} needs exactly one reference (a recording, codes .npy or an "
                             f"uploaded .npz), found {len(refs)}")
        voice = Voice(files=tuple(paths))
        suffix = refs[0].suffix.lower()
        if suffix == UPLOADED:
            if transcript is not None:
                raise HiggsError(f"{transcript}: an uploaded voice ({refs[0].name}) carries its own transcript")
            voice.codes, voice.text = self._read_uploaded(refs[0])
        elif suffix == ".npy":
            voice.codes = load_reference_codes(refs[0])
        else:
            voice.audio = load_reference_audio(refs[0])
        if transcript is not None:
            try:
                voice.text = self.check_transcript(transcript.read_text(encoding="utf-8").strip(), str(transcript))
            except UnicodeDecodeError:
                raise HiggsError(f"{transcript}: not UTF-8 text") from None
        return voice

    def _read_uploaded(self, path: Path) -> tuple[np.ndarray, str | None]:
        try:
            with np.load(input_file(path, CODES_BYTES), allow_pickle=False) as kept:
                codes, text = kept["codes"], str(kept["transcript"]) if "transcript" in kept else None
        except (OSError, ValueError, KeyError, EOFError) as e:
            raise HiggsError(f"{path}: not a voice this server stored ({e})") from None
        codes = check_reference_codes(codes, str(path))
        return codes, self.check_transcript(text, str(path)) if text else None

    def check_transcript(self, text: str, what: str) -> str:
        self.tokenizer.encode(check_text(text, what), what)
        return text

    def add(self, name: str, codes: np.ndarray, transcript: str | None, replace: bool = False) -> Voice:
        """Store a voice as NAME.npz (atomically), in place of an existing one of that name only with `replace`."""
        check_name(name)
        if self.directory is None:
            raise HiggsError("this server stores no voices: it was started without --voices DIR")
        old = self.voices.get(name)
        if old is not None and not replace:
            raise VoiceExists(f"voice {name!r} exists; send replace=true to replace it")
        target = self.directory / f"{name}{UPLOADED}"
        buffer = io.BytesIO()
        np.savez(buffer, codes=np.asarray(codes, np.int32), **({"transcript": transcript} if transcript else {}))
        write_file(target, lambda tmp: tmp.write_bytes(buffer.getvalue()))
        if old is not None:  # its other files (a recording, a transcript) would define the name twice at the next start
            for path in old.files:
                if path != target:
                    path.unlink(missing_ok=True)
        voice = self.voices[name] = Voice(codes, transcript, files=(target,))
        return voice

    def delete(self, name: str) -> None:
        voice = self.voices.get(name)
        if voice is None or name == "default":
            raise VoiceMissing(f"no voice {name[:80]!r}" + (" to delete ('default' is built in)" if voice else ""))
        for path in voice.files:
            path.unlink(missing_ok=True)
        del self.voices[name]


class VoiceExists(HiggsError):
    pass


class VoiceMissing(HiggsError):
    pass
