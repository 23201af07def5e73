"""The decode loop: prompt → prefill → one `lm` call per row → stopping rules → de-delay → codec → audio.

Backends (torch reference, ONNX Runtime, TensorRT) all expose the same three calls over the engine's graph
contract; the loop owns every decision (sampling, delay mask, EOC, guards, caps), so every backend decodes
by the same rules. Each `lm` call gets the same feed names:

  input_ids [B,S] int32, audio_codes [B,S,8] int32, is_audio [B,S] bool, write_pos [B] int64,
  new_len [B] int64, row_index [B] int64, end_frame [B] int64  →  logits [B,8,1026] fp32, codes [B,8] int32

S is the padded prompt length for prefill and 1 for a step; the KV caches stay inside the backend.
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .decoding import HARD_CAP_ROWS, NUM_CODEBOOKS, Sampling, Utterance, choose_codes, delay_mask, row_cap
from .errors import HiggsError
from .prompt import Prompt

NO_END = np.int64(1 << 40)  # end_frame while the utterance's end is unknown: never reached by row - k
MIN_ROWS = NUM_CODEBOOKS  # fewer rows than this cannot complete a single frame


class Backend(Protocol):
    name: str
    max_seq: int  # KV-cache rows: prompt + generated rows must fit
    max_batch: int

    def start(self, batch: int) -> None:
        """Prepare caches for a new batch of `batch` sequences."""

    def lm(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """One graph call; returns (logits [B,8,1026] fp32, codes [B,8] int32), valid until the next call."""

    def codec(self, codes: np.ndarray) -> np.ndarray:
        """codes [B,8,T] int32 → waveform [B,1,960·T] fp32."""


@dataclass
class Result:
    frames: np.ndarray  # [T, 8] int32, 0..1023
    audio: np.ndarray  # [960·T] fp32
    stop_reason: str  # "eoc", "repeat" or "cap"
    rows: int


def prefill_feeds(prompts: list[Prompt]) -> dict[str, np.ndarray]:
    b, p = len(prompts), max(len(x) for x in prompts)
    feeds = {
        "input_ids": np.zeros((b, p), np.int32),
        "audio_codes": np.zeros((b, p, NUM_CODEBOOKS), np.int32),
        "is_audio": np.zeros((b, p), bool),
        "write_pos": np.zeros(b, np.int64),
        "new_len": np.array([len(x) for x in prompts], np.int64),
        "row_index": np.zeros(b, np.int64),
        "end_frame": np.full(b, NO_END, np.int64),
    }
    for i, x in enumerate(prompts):
        feeds["input_ids"][i, : len(x)] = x.input_ids
        feeds["audio_codes"][i, : len(x)] = x.audio_rows
        feeds["is_audio"][i, : len(x)] = x.is_audio
    return feeds


def step_feeds(codes: np.ndarray, write_pos: np.ndarray, row: int, end_frame: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds of one decode step: each sequence's last row of codes [B,8], written at write_pos [B]."""
    b = len(codes)
    return {"input_ids": np.zeros((b, 1), np.int32), "audio_codes": np.asarray(codes, np.int32).reshape(b, 1, -1),
            "is_audio": np.ones((b, 1), bool), "write_pos": np.asarray(write_pos, np.int64),
            "new_len": np.ones(b, np.int64), "row_index": np.full(b, row, np.int64),
            "end_frame": np.asarray(end_frame, np.int64)}


def row_caps(prompts: list[Prompt], max_seq: int, hard_cap: int = HARD_CAP_ROWS) -> list[int]:
    caps = []
    for x in prompts:
        room = max_seq - len(x)
        if room < MIN_ROWS:
            raise HiggsError(f"text too long: the prompt takes {len(x)} of the engine's {max_seq} cache positions, "
                             f"leaving room for {max(room, 0)} rows (at least {MIN_ROWS} are needed)")
        caps.append(min(row_cap(x.text_chars, hard_cap), room))
    return caps


def generate(backend: Backend, prompts: list[Prompt], sampling: Sampling = Sampling(),
             hard_cap: int = HARD_CAP_ROWS) -> list[Result]:
    b = len(prompts)
    if not 1 <= b <= backend.max_batch:
        raise HiggsError(f"batch of {b} prompts; this engine takes 1..{backend.max_batch}")
    utterances = [Utterance(cap) for cap in row_caps(prompts, backend.max_seq, hard_cap)]
    rngs = [np.random.default_rng(sampling.seed + i) for i in range(b)]
    end = np.full(b, NO_END, np.int64)

    backend.start(b)
    logits, codes = backend.lm(prefill_feeds(prompts))
    step = step_feeds(np.zeros((b, NUM_CODEBOOKS)), [len(x) for x in prompts], 0, end)
    step["end_frame"] = end  # the loop updates it in place
    row = 0
    while True:
        if not sampling.greedy:
            picked = np.stack([choose_codes(logits[i], sampling, rngs[i]) for i in range(b)])
            codes = delay_mask(picked, np.full(b, row), end)
        for i, u in enumerate(utterances):
            if not u.done:
                u.push(codes[i])
                if u.end_frame is not None:
                    end[i] = u.end_frame
        if all(u.done for u in utterances):
            break
        # Feed this row back (re-masked in case an end was just found); finished sequences keep rewriting
        # their last cache slot so their positions never run past the cache.
        step["audio_codes"][:, 0] = delay_mask(codes, np.full(b, row), end)
        row += 1
        step["row_index"][:] = row
        if row > 1:
            step["write_pos"] += [0 if u.done else 1 for u in utterances]
        logits, codes = backend.lm(step)

    results = []
    for u in utterances:
        frames = u.frames()
        audio = backend.codec(frames.T[None])[0, 0] if len(frames) else np.zeros(0, np.float32)
        results.append(Result(frames, audio, u.stop_reason, len(u.rows)))
    return results
