"""Tokenizer and prompt layouts.

zero-shot:  <|tts|> <|text|> text <|audio|>
clone:      <|tts|> [<|ref_text|> ref_text] <|ref_audio|> ref_rows×(T+7) <|text|> text <|audio|>
history:    after the reference (if any), one more reference block per earlier segment of the same voice,
            <|ref_text|> its text <|ref_audio|> its generated rows×(T+7), oldest first

Special ids always come from the tokenizer's added vocabulary, never from constants. Reference-audio positions
carry a delayed row of codes each (`is_audio`); their token id is 0, a valid id the graph ignores there.

A history block has the layout of a reference with its transcript, the one layout the model knows for audio in the
prompt (how upstream servers place history is not published). The voice's own reference comes first, so a prompt's
reference part (`Prompt.prefix`) is the same for every segment of a request and every request of that voice: the
engines keep its keys and values (the reference prefix cache).

User text (CLI, compare's prompt files, the server) is checked here, once for every caller: valid Unicode without
control characters, and no token that builds prompt structure. Of the tokenizer's added tokens only the inline
style tags may appear in text (`INLINE_TAG`: <|emotion:…|>, <|prosody:…|>, <|style:…|>, <|sfx:…|>); <|tts|>,
<|text|>, <|audio|>, <|audio_end|>, <|eoc|>, <|ref_text|>, <|ref_audio|>, <|text_end|>, <|endoftext|> and any
other added token are refused, so text cannot forge a prompt.
"""

import hashlib
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .decoding import CODEBOOK_SIZE, FRAMES_PER_SECOND, NUM_CODEBOOKS, apply_delay
from .errors import HiggsError
from .inputs import CODES_BYTES, TOKENIZER_BYTES, input_file

TTS, TEXT, AUDIO, REF_TEXT, REF_AUDIO = "<|tts|>", "<|text|>", "<|audio|>", "<|ref_text|>", "<|ref_audio|>"
REQUIRED_SPECIALS = (TTS, TEXT, AUDIO)
CONTROL_TAG = re.compile(r"<\|[^<>|\s]+\|>")
INLINE_TAG = re.compile(r"<\|(?:emotion|prosody|style|sfx):[^<>|\s]+\|>")  # the added tokens user text may hold
TEXT_WHITESPACE = "\t\n\r"  # the only control characters text may hold


def is_inline_tag(token: str) -> bool:
    return INLINE_TAG.fullmatch(token) is not None


def check_text(text, what: str = "text") -> str:
    """Text as a user gave it, refused unless it is a str of valid Unicode with something visible and without control
    characters (argv bytes that are not UTF-8 arrive as lone surrogates and are refused here)."""
    if not isinstance(text, str):
        raise HiggsError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise HiggsError(f"{what} is empty")
    if all(ch.isspace() or unicodedata.category(ch) == "Cf" for ch in text):  # zero-width spaces, joiners, BOMs
        raise HiggsError(f"{what} has nothing to say: only invisible format characters and spaces")
    for i, ch in enumerate(text):
        kind = unicodedata.category(ch)
        if kind == "Cs":
            raise HiggsError(f"{what} is not valid UTF-8 (undecodable byte or lone surrogate at character {i})")
        if kind == "Cc" and ch not in TEXT_WHITESPACE:
            raise HiggsError(f"{what} contains the control character U+{ord(ch):04X} at character {i}")
    return text


@dataclass(frozen=True)
class Prompt:
    input_ids: np.ndarray  # [P] int32
    audio_rows: np.ndarray  # [P, 8] int32, delayed reference rows where is_audio
    is_audio: np.ndarray  # [P] bool
    text_chars: int  # length of the target text, for the row cap
    prefix: int = 0  # tokens of the reference part (<|tts|> and the voice's reference block); 0 without a reference
    prefix_key: str | None = None  # the reference part's identity: a digest of its token ids and codes

    def __len__(self) -> int:
        return len(self.input_ids)

    def too_long(self, limit: int, what: str) -> str:
        """The error for a prompt longer than `limit` tokens (`what` names the limit); with reference audio, how
        long a reference fits beside this text (its frames and the delay pattern's NUM_CODEBOOKS - 1 rows)."""
        audio = int(self.is_audio.sum())
        message = (f"{'text and reference audio' if audio else 'text'} too long: the prompt takes {len(self)} tokens, "
                   f"{what} {limit}")
        if audio:
            frames = limit - (len(self) - audio) - (NUM_CODEBOOKS - 1)
            seconds = frames * 10 // FRAMES_PER_SECOND / 10  # rounded down: what is said to fit does
            message += f"; beside this text a reference of at most {seconds:.1f} s fits" if frames > 0 else \
                "; the text alone fills it"
        return message


class HiggsTokenizer:
    """tokenizer.json with the Higgs special tokens; with `vocab_size` (the model's text vocabulary), every id it
    can produce is checked to lie inside it."""

    def __init__(self, path: Path, vocab_size: int | None = None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(input_file(path, TOKENIZER_BYTES)))
        except Exception as e:  # tokenizers raises its own exception types for missing or malformed files
            raise HiggsError(f"{path}: cannot load tokenizer ({e})") from None
        self.specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        missing = [s for s in REQUIRED_SPECIALS if s not in self.specials]
        if missing:
            raise HiggsError(f"{path}: tokenizer lacks the Higgs special token(s) {', '.join(missing)}")
        self.structural = {i: t for t, i in self.specials.items() if not is_inline_tag(t)}
        self.unk_id = self._tok.token_to_id(self._tok.model.unk_token) if getattr(self._tok.model, "unk_token", None) else None
        if vocab_size is not None:
            outside = sorted(((t not in self.specials, i), t) for t, i in self._tok.get_vocab(with_added_tokens=True).items()
                             if i >= vocab_size)  # added tokens first: they are the usual culprits
            if outside:
                names = ", ".join(f"{t} ({i})" for (_, i), t in outside[:5]) + (" …" if len(outside) > 5 else "")
                raise HiggsError(f"{path}: {len(outside)} token id(s) lie outside the model's text vocabulary of "
                                 f"{vocab_size}: {names}")

    def special(self, token: str) -> int:
        if token not in self.specials:
            raise HiggsError(f"the tokenizer has no {token} token (an older checkpoint?)")
        return self.specials[token]

    def encode(self, text: str, what: str = "text") -> list[int]:
        check_text(text, what)
        unknown = sorted({tag for tag in CONTROL_TAG.findall(text) if tag not in self.specials})
        if unknown:
            raise HiggsError(f"{what} uses unknown control tag(s) {', '.join(unknown)}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        forged = sorted({self.structural[i] for i in ids if i in self.structural})
        if forged:
            raise HiggsError(f"{what} may not contain the prompt token(s) {', '.join(forged)} "
                             "(only inline style tags like <|emotion:…|> are allowed)")
        if self.unk_id is not None and self.unk_id in ids:
            raise HiggsError(f"{what} contains characters the tokenizer cannot encode")
        return ids


def load_reference_codes(path: Path) -> np.ndarray:
    """Reference audio codes [T, 8] (0..1023) from a .npy file."""
    try:
        with open(input_file(path, CODES_BYTES), "rb") as f:
            if f.read(6) != b"\x93NUMPY":  # else np.load reads .npz archives, and calls other files pickles
                raise HiggsError(f"{path}: not an .npy file (codes [T, 8] as numpy.save or encode-audio write them)")
            f.seek(0)
            codes = np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise HiggsError(f"{path}: cannot read reference codes ({e})") from None
    except MemoryError:  # a header that claims far more data than the file holds
        raise HiggsError(f"{path}: cannot read reference codes (its header claims more than memory holds)") from None
    return check_reference_codes(codes, str(path))


def check_reference_codes(codes, what: str) -> np.ndarray:
    """Reference audio codes as an int32 array [T, 8] of 0..1023, refused otherwise (`what` names their source)."""
    if isinstance(codes, list):  # from JSON, where numpy would read true as 1 and 2**70 or "abc" as objects
        values = [c for row in codes if isinstance(row, list) for c in row]
        odd = next((c for c in values if type(c) is not int), None)
        if odd is not None:
            kind = {bool: "a boolean", float: "a number with a fraction or exponent", str: "a string",
                    type(None): "null", dict: "an object", list: "an array"}.get(type(odd), type(odd).__name__)
            raise HiggsError(f"{what}: reference codes must be integers, got {kind}")
        if any(not 0 <= c < CODEBOOK_SIZE for c in values):
            raise HiggsError(f"{what}: reference codes must lie in 0..{CODEBOOK_SIZE - 1}")
    try:
        codes = np.asarray(codes)
    except (ValueError, TypeError):
        codes = np.asarray(None)
    if codes.ndim != 2 or codes.shape[1] != NUM_CODEBOOKS or codes.shape[0] == 0:
        raise HiggsError(f"{what}: reference codes must have shape [T, {NUM_CODEBOOKS}] with T ≥ 1, got "
                         f"{list(codes.shape) if codes.dtype != object else 'a ragged or non-numeric list'}")
    if not np.issubdtype(codes.dtype, np.integer):
        raise HiggsError(f"{what}: reference codes must be integers, got {codes.dtype}")
    if codes.min() < 0 or codes.max() >= CODEBOOK_SIZE:
        raise HiggsError(f"{what}: reference codes must lie in 0..{CODEBOOK_SIZE - 1}")
    return codes.astype(np.int32)


def build_prompt(tok: HiggsTokenizer, text: str, ref_codes: np.ndarray | None = None,
                 ref_text: str | None = None, history: Sequence[tuple[str, np.ndarray]] = ()) -> Prompt:
    """The prompt for `text` in the voice of (ref_codes [T, 8], ref_text), after `history`: earlier segments of the
    same voice as (text, frames [T, 8]), oldest first (module docstring)."""
    ids: list[int] = [tok.special(TTS)]
    rows: list[np.ndarray | None] = [None]

    def add_tokens(new: list[int]) -> None:
        ids.extend(new)
        rows.extend([None] * len(new))

    def add_reference(codes: np.ndarray, transcript: str | None, what: str) -> None:
        if transcript is not None:
            add_tokens([tok.special(REF_TEXT), *tok.encode(transcript, what)])
        add_tokens([tok.special(REF_AUDIO)])
        for row in apply_delay(codes):
            ids.append(0)
            rows.append(row)

    if ref_text is not None and ref_codes is None:
        raise HiggsError("a reference transcript needs reference audio codes too")
    prefix = key = None
    if ref_codes is not None:
        add_reference(ref_codes, ref_text, "reference text")
        prefix = len(ids)
        key = hashlib.sha256(np.asarray(ids, np.int64).tobytes() + np.ascontiguousarray(ref_codes, np.int32).tobytes()
                             ).hexdigest()
    for earlier, frames in history:
        add_reference(frames, earlier, "text")
    add_tokens([tok.special(TEXT), *tok.encode(text), tok.special(AUDIO)])

    is_audio = np.array([r is not None for r in rows], dtype=bool)
    audio_rows = np.zeros((len(ids), NUM_CODEBOOKS), dtype=np.int32)
    for i, r in enumerate(rows):
        if r is not None:
            audio_rows[i] = r
    return Prompt(np.asarray(ids, dtype=np.int32), audio_rows, is_audio, len(text), prefix or 0, key)
