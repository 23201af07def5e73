"""A request to the scheduler (runtime/scheduler.py): its prompt, sampling and caps, and the state the loop keeps for
it; `request_for` sizes one to the text and the engine's cache."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from .decoding import FRAMES_PER_SECOND, HARD_CAP_ROWS, NUM_CODEBOOKS, CodeStream, Sampling, Utterance, row_cap
from .errors import HiggsError
from .prompt import Prompt

if TYPE_CHECKING:
    from .longform import Script

MIN_ROWS = NUM_CODEBOOKS  # fewer rows than this cannot complete a single frame


class QueueFull(HiggsError):
    pass


@dataclass(eq=False)
class Request:
    prompt: Prompt | None  # the current segment's; None until a streamed text's first segment is complete
    sampling: Sampling
    max_rows: int
    fixed_rows: bool = False  # benchmarks: exactly max_rows rows, no EOC or repeat stop
    on_chunk: Callable[[np.ndarray], None] | None = None  # audio as it is ready; else kept for audio()
    on_done: Callable[["Request"], None] | None = None
    script: "Script | None" = None  # long-form: the segments after this prompt's (runtime/longform.py)
    segment_cap: int = HARD_CAP_ROWS  # rows each segment may take (max_new_tokens)
    max_frames: int | None = None  # frames of the whole stream at most (the request's duration cap)
    # kept by the scheduler
    utterance: Utterance | None = None  # the current (or last) segment's
    stream: CodeStream | None = None
    emitted: int = 0  # frames whose audio went out
    planned: int = 0  # frames whose audio went out or is being decoded
    due: int = 0  # ready frames at which the window after `planned` falls due (0: not looked at yet)
    chunks: list = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    error: str | None = None
    submitted_at: float = 0.0
    admitted_at: float | None = None  # when the prefill call that gave it a slot began
    first_audio_at: float | None = None
    finished_at: float | None = None
    last_launch: int = 0  # the scheduler's count of launched rows at which this request's last possible row is launched

    def audio(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)

    @property
    def stop_reason(self) -> str:
        return "cancelled" if self.cancelled else self.utterance.stop_reason


def request_for(engine, prompt: Prompt | None, sampling: Sampling, hard_cap: int = HARD_CAP_ROWS, *, script=None,
                max_seconds: float | None = None, **callbacks) -> Request:
    """A request whose row cap fits the text and the engine's cache; refused if the prompt leaves too little room.
    With a `script`, `prompt` is its first segment's (None: its text streams in) and `hard_cap` applies to each
    segment."""
    max_frames = round(max_seconds * FRAMES_PER_SECOND) if max_seconds is not None else None
    rows = segment_rows(engine, prompt, hard_cap, max_frames) if prompt is not None else 0
    return Request(prompt, sampling, rows, script=script, segment_cap=hard_cap, max_frames=max_frames, **callbacks)


def segment_rows(engine, prompt: Prompt, hard_cap: int, frames_left: int | None = None) -> int:
    """The rows a segment may take: its text's row cap within `hard_cap`, the engine's cache and the frames its
    request has left; refused if the prompt leaves too little room."""
    if len(prompt) > engine.max_prompt:
        raise HiggsError(prompt.too_long(engine.max_prompt, "the engine's prefill takes at most"))
    room = engine.max_seq - len(prompt)
    if room < MIN_ROWS:
        raise HiggsError(prompt.too_long(engine.max_seq - MIN_ROWS, f"leaving fewer than {MIN_ROWS} of the engine's "
                                         f"{engine.max_seq} cache positions for audio: it may take at most"))
    cap = min(row_cap(prompt.text_chars, hard_cap), room)
    return cap if frames_left is None else max(MIN_ROWS, min(cap, frames_left + NUM_CODEBOOKS - 1))
