"""Long-form speech and dialogue: one request's text as segments, each spoken in its speaker's voice after that
voice's latest segments (their text and generated frames) as history, so the voice stays the same from one segment
to the next. The scheduler speaks the segments one after another into one code stream (decoding.CodeStream).

Text arrives whole (`run --text-file`, the server's `input`) or in pieces (text streamed in): the same rule cuts it
(runtime/segment.py), so where a segment ends depends only on the text. Dialogue: `[S1] … [S2] …` tags switch the
speaker; each tag names a key of `speakers`, which maps it to a voice. A turn ends its segment.
"""

import re
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .errors import HiggsError, TextError
from .prompt import HiggsTokenizer, Prompt, build_prompt
from .segment import Segmenter

SPEAKER_TAG = re.compile(r"\[(S\d{1,2})\]")
SPEAKER_KEY = re.compile(r"S\d{1,2}")
PARTIAL_TAG = re.compile(r"\[(S\d{0,2})?$")  # the start of a tag the next piece of text may complete
DEFAULT_HISTORY = 2  # earlier segments of a voice in its prompt, at most (as many as fit)
STRUCTURE_TOKENS = 2  # <|text|> and <|audio|> around a segment's text


@dataclass(frozen=True)
class Reference:
    """A voice as the prompt carries it."""

    codes: np.ndarray | None = None  # reference codes [T, 8]; None: zero-shot
    text: str | None = None  # the reference's transcript


@dataclass
class Speaker:
    voice: Reference
    segmenter: Segmenter
    history: deque = field(default_factory=deque)  # (text, frames) of its latest segments


class Script:
    """The segments of one request, produced as their text completes, and the prompt of each."""

    def __init__(self, tokenizer: HiggsTokenizer, voice: Reference, speakers: dict[str, Reference] | None,
                 max_prompt: int, history: int = DEFAULT_HISTORY):
        self.tokenizer, self.max_prompt, self.max_history = tokenizer, max_prompt, history
        self.speakers = {key: self._speaker(v, f"speaker {key}") for key, v in (speakers or {}).items()}
        self.narrator = self._speaker(voice, "voice") if not speakers else None
        self.turn: Speaker | None = self.narrator
        self.pending: deque[tuple[Speaker, str]] = deque()  # segments whose text is complete, not spoken yet
        self.speaking: tuple[Speaker, str] | None = None
        self.said: list[str] = []  # the segments' texts, in the order they were spoken
        self.prompt_tokens = 0  # of every segment's prompt
        self.unparsed = ""  # a speaker tag that the next piece of text may complete
        self.finished = False  # no more text will come
        self.flushed_at: int | None = None  # a flush: the stream's audio is finished off after this many segments

    def _speaker(self, voice: Reference, name: str) -> Speaker:
        """A speaker whose segments fit the prefill beside its voice's reference (history only where it fits)."""
        shortest = build_prompt(self.tokenizer, ".", voice.codes, voice.text)
        if len(shortest) > self.max_prompt:
            raise HiggsError(f"{name}: " + shortest.too_long(self.max_prompt, "the engine's prefill takes at most"))
        budget = self.max_prompt - (shortest.prefix or 1) - STRUCTURE_TOKENS  # prefix 0: <|tts|> alone
        return Speaker(voice, Segmenter(self._measure, budget, max(1, budget // 2)))

    def _measure(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    # ---- text in ------------------------------------------------------------------------------------------------

    def feed(self, text: str) -> None:
        text = self.unparsed + text
        self.unparsed = ""
        partial = PARTIAL_TAG.search(text)
        if partial:
            text, self.unparsed = text[:partial.start()], text[partial.start():]
        position = 0
        for tag in SPEAKER_TAG.finditer(text):
            self._say(text[position:tag.start()])
            self._switch(tag.group(1))
            position = tag.end()
        self._say(text[position:])

    def flush(self) -> None:
        """Speak the text so far now, to its last sample (a cut that arrival makes, the one exception to the rule:
        the audio before it is decoded as an utterance's end, so the next segment starts after a seam)."""
        if self.turn is not None:
            self._queue(self.turn, self.turn.segmenter.flush())
        self.flushed_at = len(self.said) + len(self.pending) or None

    def finish(self) -> None:
        self.feed("")
        self._say(self.unparsed)
        self.unparsed = ""
        if self.turn is not None:
            self._queue(self.turn, self.turn.segmenter.finish())
        self.finished = True

    def _say(self, text: str) -> None:
        if not text:
            return
        if self.turn is None:
            if text.strip():
                raise TextError(f"text before the first speaker tag: {text.strip()[:40]!r} (with speakers, every turn "
                                 "starts with a tag such as [S1])")
            return
        self._queue(self.turn, self.turn.segmenter.feed(text))

    def _switch(self, key: str) -> None:
        if not self.speakers:
            raise TextError(f"the speaker tag [{key}] needs a `speakers` mapping (e.g. {{\"{key}\": \"default\"}})")
        if key not in self.speakers:
            raise TextError(f"the speaker tag [{key}] is not mapped to a voice (speakers: "
                             f"{', '.join(sorted(self.speakers))})")
        if self.turn is not None:
            self._queue(self.turn, self.turn.segmenter.finish())
        self.turn = self.speakers[key]

    def _queue(self, speaker: Speaker, segments: list[str]) -> None:
        self.pending.extend((speaker, s) for s in segments)

    # ---- segments out -------------------------------------------------------------------------------------------

    @property
    def exhausted(self) -> bool:
        """Every segment has been spoken and no more text will come."""
        return self.finished and not self.pending and self.speaking is None

    def next_prompt(self) -> Prompt | None:
        """The next segment's prompt, or None until its text is complete."""
        if not self.pending:
            return None
        self.speaking = speaker, text = self.pending.popleft()
        history = list(speaker.history)
        while True:  # the latest segments that fit beside the text
            prompt = build_prompt(self.tokenizer, text, speaker.voice.codes, speaker.voice.text, history)
            if len(prompt) <= self.max_prompt or not history:
                self.said.append(text)
                self.prompt_tokens += len(prompt)
                return prompt
            history.pop(0)

    def spoken(self, frames: np.ndarray) -> None:
        """The segment from the last next_prompt() ended with these frames: history for its speaker's next ones."""
        speaker, text = self.speaking
        self.speaking = None
        if self.max_history and len(frames):
            speaker.history.append((text, frames))
            while len(speaker.history) > self.max_history:
                speaker.history.popleft()


def plan_text(tokenizer: HiggsTokenizer, text: str, voice: Reference, speakers: dict[str, Reference] | None,
         max_prompt: int, history: int = DEFAULT_HISTORY) -> tuple[Prompt, Script | None]:
    """The first prompt of a request's text, and the script of its later segments when it takes more than one (text
    that fits one prompt and names no speaker is one segment, its prompt the whole text as given)."""
    if not speakers and not SPEAKER_TAG.search(text):
        prompt = build_prompt(tokenizer, text, voice.codes, voice.text)
        if len(prompt) <= max_prompt:
            return prompt, None
    script = Script(tokenizer, voice, speakers, max_prompt, history)
    script.feed(text)
    script.finish()
    prompt = script.next_prompt()
    if prompt is None:
        raise TextError("the text has nothing to say beside its speaker tags")
    return prompt, script


def check_speakers(speakers, voices) -> None:
    """A `speakers` mapping's keys are tags S1..S99 and its values known voice names."""
    for key, name in speakers.items():
        if not SPEAKER_KEY.fullmatch(str(key)):
            raise HiggsError(f"speaker {key!r}: a speaker is named S1 to S99 (its tag in the text is [S1])")
        if name not in voices:
            raise HiggsError(f"speaker {key}: no voice {name!r} (known: {', '.join(sorted(voices))})")

