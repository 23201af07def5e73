"""OpenAI's `POST /v1/audio/speech` body → a checked `Speech`, or an `ApiError` whose `param` names the field.

OpenAI's fields: `model`, `input` (≤ `serve --max-input-chars`, 4096 by default; longer than one prompt, it is
spoken in segments: runtime/longform.py), `voice` (a name or `{"id": name}`), `response_format`,
`speed` (1.0 only: the model has no rate control and resampling would change the voice), `stream_format`
(`audio` | `sse`), `instructions` (refused: style comes from inline tags in `input`, e.g. <|emotion:…|>).
Extensions, named as vLLM-Omni names them: `stream` (true alone means SSE), `seed`, `temperature`, `top_k`, `top_p`,
`max_new_tokens` (decode steps, one row of 8 codes each), `ref_audio` (base64, a data: URL, or a file:// path below
the server's --ref-dir), `ref_text` (≤ 4096 characters); and `ref_codes` (reference codes [T][8], the layout of
`--ref-codes`), `speakers` (dialogue: {"S1": voice name, …} for the [S1] … tags in `input`).
Sampling defaults are the CLI's (temperature 1.0, top_k 0, top_p 1.0, seed 0), so a request without options sounds
exactly like `higgs-trt run` with none: same text, same audio; send `seed` for another take.

Unknown fields are refused, not ignored; JSON null means "not given". Types are not cast: `"1.0"`, `true` for a
number, `2.0` for an integer are refused. Text and sampling ranges use the CLI's own checks (runtime/prompt.py,
runtime/options.py).
"""

import base64
import binascii
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from higgs_trt.runtime.decoding import AUDIO_VOCAB, HARD_CAP_ROWS, Sampling
from higgs_trt.runtime.errors import HiggsError, TextError
from higgs_trt.runtime.longform import check_speakers
from higgs_trt.runtime.options import sampling
from higgs_trt.runtime.prompt import check_reference_codes, check_text
from higgs_trt.runtime.request import MIN_ROWS

from .limits import MAX_INPUT_CHARS

MODEL_ID = "higgs-audio-v3"  # the one model a server serves (GET /v1/models)
STREAMED = ("wav", "pcm")  # written chunk by chunk as the audio is decoded
ENCODED = {  # written by soundfile once the utterance is complete: (format, subtype, media type)
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": ("OGG", "OPUS", "audio/ogg"),
}
FORMATS = STREAMED + tuple(ENCODED)
DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0}  # the CLI's
FIELDS = {"model", "input", "voice", "response_format", "speed", "stream_format", "instructions", "stream",
          "temperature", "top_k", "top_p", "seed", "max_new_tokens", "ref_audio", "ref_text", "ref_codes", "speakers"}
DATA_URL = re.compile(r"data:[^,;]*(?:;[^,;]*)*;base64,(.*)", re.DOTALL)


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_value",
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@contextmanager
def field(name: str):
    """A HiggsError raised inside is the client's mistake in field `name` (a TextError: in `input`): 400 naming it."""
    try:
        yield
    except TextError as e:
        raise ApiError(400, str(e), "input") from None
    except HiggsError as e:
        message = str(e).replace(f"--{name.replace('_', '-')}", name)  # the CLI's option name → the field's
        raise ApiError(400, message, name) from None


@dataclass(frozen=True)
class Speech:
    text: str
    voice: str
    response_format: str
    sse: bool
    sampling: Sampling
    max_new_tokens: int
    ref_audio: bytes | Path | None = None  # an upload's bytes, or a file below --ref-dir
    ref_codes: np.ndarray | None = None  # [T, 8] int32
    ref_text: str | None = None
    speakers: dict[str, str] | None = None  # tag → voice name


def parse_speech(body: bytes, model: str, voices, ref_dir: Path | None, max_input_chars: int = MAX_INPUT_CHARS
                 ) -> Speech:
    """Every check that needs no engine; `voices`: the names the server knows."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 and bad JSON
        raise ApiError(400, f"the body is not valid JSON ({type(e).__name__}: {str(e)[:200]})", None,
                       "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}", None, "invalid_json")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r} (this server takes {', '.join(sorted(FIELDS))})",
                       unknown[0], "unknown_parameter")
    given = {k: v for k, v in data.items() if v is not None}

    name = _typed(given, "model", str, model)
    if name != model:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {model!r}", "model",
                       "model_not_found")
    text = _typed(given, "input", str)
    if text is None:
        raise ApiError(400, "input is required: the text to speak", "input", "missing_required_parameter")
    _short(text, "input", max_input_chars)
    with field("input"):
        check_text(text, "input")
    if _typed(given, "instructions", str, ""):
        raise ApiError(400, "instructions are not supported: give style with inline tags in input "
                       "(e.g. <|emotion:elation|>)", "instructions", "unsupported_parameter")

    voice = given.get("voice", "default")
    if isinstance(voice, dict) and set(voice) == {"id"}:
        voice = voice["id"]
    if not isinstance(voice, str):
        raise ApiError(400, f"voice must be a name or {{\"id\": name}}, got {_kind(voice)}", "voice", "invalid_type")
    if voice not in voices:
        raise ApiError(400, f"unknown voice {voice[:100]!r}; this server has {', '.join(sorted(voices))}", "voice",
                       "voice_not_found")

    fmt = _typed(given, "response_format", str, "wav")
    if fmt not in FORMATS:
        raise ApiError(400, f"response_format {fmt[:40]!r} is not supported; use one of {', '.join(FORMATS)} "
                       "(aac has no encoder in libsndfile)", "response_format")
    speed = _typed(given, "speed", (int, float), 1.0)
    if speed != 1.0:
        raise ApiError(400, f"speed {speed} is not supported: only 1.0 (the model has no rate control)", "speed")
    stream = _typed(given, "stream", bool, False)
    stream_format = _typed(given, "stream_format", str, "sse" if stream else "audio")
    if stream_format not in ("audio", "sse"):
        raise ApiError(400, f"stream_format must be 'audio' or 'sse', got {stream_format[:40]!r}", "stream_format")
    sse = stream_format == "sse"
    if sse and fmt not in STREAMED:
        raise ApiError(400, f"SSE streams {' or '.join(STREAMED)}, not {fmt} (a {fmt} file is written whole, once "
                       "the audio is complete)", "response_format")

    options = {k: _typed(given, k, int if k in ("top_k", "seed") else (int, float), v) for k, v in DEFAULTS.items()}
    for k, v in options.items():  # each on its own, so the error names its field
        with field(k):
            sampling(**{**DEFAULTS, k: v})
    if not 0 <= options["top_k"] <= AUDIO_VOCAB:
        raise ApiError(400, f"top_k must lie in 0..{AUDIO_VOCAB} (0 keeps every code), got {options['top_k']}",
                       "top_k")
    max_new_tokens = _typed(given, "max_new_tokens", int, HARD_CAP_ROWS)
    if not MIN_ROWS <= max_new_tokens <= HARD_CAP_ROWS:
        raise ApiError(400, f"max_new_tokens must lie in {MIN_ROWS}..{HARD_CAP_ROWS} (decode steps; 25 make a "
                       f"second of audio), got {max_new_tokens}", "max_new_tokens")

    ref_audio = _reference_audio(_typed(given, "ref_audio", str), ref_dir)
    ref_codes = given.get("ref_codes")
    if ref_codes is not None:
        if ref_audio is not None:
            raise ApiError(400, "give ref_audio or ref_codes, not both", "ref_codes")
        if isinstance(ref_codes, list) and any(isinstance(code, bool) for row in ref_codes if isinstance(row, list)
                                               for code in row):
            raise ApiError(400, "ref_codes: reference codes must be integers, got a boolean", "ref_codes",
                           "invalid_type")
        with field("ref_codes"):
            ref_codes = check_reference_codes(ref_codes if isinstance(ref_codes, list) else None, "ref_codes")
    ref_text = _typed(given, "ref_text", str)
    if ref_text is not None:
        _short(ref_text, "ref_text")
        with field("ref_text"):
            check_text(ref_text, "ref_text")
        if ref_audio is None and ref_codes is None:
            raise ApiError(400, "ref_text needs ref_audio or ref_codes (the transcript of which reference?)",
                           "ref_text")
    if voice != "default" and (ref_audio is not None or ref_codes is not None):
        raise ApiError(400, f"voice {voice!r} brings its own reference; send ref_audio / ref_codes with voice "
                       "'default'", "voice")
    speakers = _typed(given, "speakers", dict)
    if speakers is not None:
        if ref_audio is not None or ref_codes is not None or voice != "default":
            raise ApiError(400, "speakers gives each turn its voice; leave voice, ref_audio and ref_codes out",
                           "speakers")
        if not speakers or not all(isinstance(v, str) for v in speakers.values()):
            raise ApiError(400, 'speakers maps tags to voice names, e.g. {"S1": "alice", "S2": "default"}',
                           "speakers", "invalid_type")
        with field("speakers"):
            check_speakers(speakers, voices)
    return Speech(text, voice, fmt, sse, Sampling(**options), max_new_tokens, ref_audio, ref_codes, ref_text,
                  speakers)


def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _typed(given: dict, key: str, types, default=None):
    """given[key] if it has one of `types` (never a bool for a number), else 400 naming the field."""
    if key not in given:
        return default
    value = given[key]
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        wanted = "a number" if float in types else _kind(types[0]())
        raise ApiError(400, f"{key} must be {wanted}, got {_kind(value)}", key, "invalid_type")
    return value


def _short(text: str, key: str, limit: int = MAX_INPUT_CHARS) -> None:
    """Texts are capped before any per-character check or tokenizing (a 16 MB body would hold the event loop)."""
    if len(text) > limit:
        raise ApiError(400, f"{key} is {len(text)} characters; at most {limit}", key)


def _reference_audio(value: str | None, ref_dir: Path | None) -> bytes | Path | None:
    """ref_audio: a data: URL or plain base64 → the file's bytes; file://PATH → a path below --ref-dir."""
    if value is None:
        return None
    if value.startswith("file://"):
        if ref_dir is None:
            raise ApiError(400, "file:// paths are refused: the server was started without --ref-dir", "ref_audio")
        root, name = ref_dir.resolve(), value[len("file://"):]
        try:
            path = (root / name).resolve()  # an absolute path replaces root; links are followed
            inside, found = path.is_relative_to(root), path.is_file()
        except (OSError, ValueError):  # a NUL byte, a name too long
            inside, found = True, False
        if not inside:
            raise ApiError(400, "ref_audio names a file outside the server's --ref-dir", "ref_audio")
        if not found:
            raise ApiError(400, f"ref_audio: no file {name[:200]!r} below --ref-dir", "ref_audio")
        return path
    if re.match(r"[a-z][a-z0-9+.-]*://", value, re.IGNORECASE):
        raise ApiError(400, "ref_audio: URLs are not fetched; send the file as base64, a data: URL, or a file:// "
                       "path below --ref-dir", "ref_audio")
    if value.startswith("data:"):
        match = DATA_URL.fullmatch(value)
        if match is None:
            raise ApiError(400, "ref_audio: a data: URL must be base64 (data:audio/wav;base64,…)", "ref_audio")
        value = match.group(1)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "ref_audio is not valid base64 (nor a data: URL or a file:// path)", "ref_audio") from None
    if not data:
        raise ApiError(400, "ref_audio is empty", "ref_audio")
    return data
