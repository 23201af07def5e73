"""The lm graph's feeds, and `generate`: prompts in, finished utterances out, through the scheduler.

Every lm call gets the same feed names (the engine directory's graph contract):

  input_ids [B,S] int32, audio_codes [B,S,8] int32, is_audio [B,S] bool, write_pos [B] int64,
  new_len [B] int64, row_index [B] int64, end_frame [B] int64  →  logits [B,8,1026] fp32, codes [B,8] int32

S is the prompt length for a prefill and 1 for a step; the KV caches stay inside the backend.
"""

from dataclasses import dataclass

import numpy as np

from .decoding import HARD_CAP_ROWS, NO_END, NUM_CODEBOOKS, Sampling
from .prompt import Prompt

__all__ = ["NO_END", "Result", "generate", "prefill_feeds", "step_feeds"]


@dataclass
class Result:
    frames: np.ndarray  # [T, 8] int32, 0..1023
    audio: np.ndarray  # [960·T] fp32
    stop_reason: str  # "eoc", "repeat" or "cap"
    rows: int


def prefill_feeds(prompts: list[Prompt], start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
    """Feeds that prefill positions [start, stop) of each prompt (default: all of it), written at cache row `start`
    (the rows before it already in the cache)."""
    parts = [slice(start, len(x) if stop is None else stop) for x in prompts]
    b, p = len(prompts), max(s.stop - s.start for s in parts)
    feeds = {
        "input_ids": np.zeros((b, p), np.int32),
        "audio_codes": np.zeros((b, p, NUM_CODEBOOKS), np.int32),
        "is_audio": np.zeros((b, p), bool),
        "write_pos": np.full(b, start, np.int64),
        "new_len": np.array([s.stop - s.start for s in parts], np.int64),
        "row_index": np.zeros(b, np.int64),
        "end_frame": np.full(b, NO_END, np.int64),
    }
    for i, (x, s) in enumerate(zip(prompts, parts)):
        n = s.stop - s.start
        feeds["input_ids"][i, :n] = x.input_ids[s]
        feeds["audio_codes"][i, :n] = x.audio_rows[s]
        feeds["is_audio"][i, :n] = x.is_audio[s]
    return feeds


def step_feeds(codes: np.ndarray, write_pos, row_index, end_frame) -> dict[str, np.ndarray]:
    """Feeds of one decode step: each row's fed codes [B,8], written at write_pos [B], predicting row_index [B]."""
    b = len(codes)
    return {"input_ids": np.zeros((b, 1), np.int32), "audio_codes": np.asarray(codes, np.int32).reshape(b, 1, -1),
            "is_audio": np.ones((b, 1), bool), "write_pos": np.asarray(write_pos, np.int64),
            "new_len": np.ones(b, np.int64), "row_index": np.broadcast_to(np.asarray(row_index, np.int64), (b,)).copy(),
            "end_frame": np.broadcast_to(np.asarray(end_frame, np.int64), (b,)).copy()}


def generate(engine, prompts: list[Prompt], sampling: Sampling = Sampling(), hard_cap: int = HARD_CAP_ROWS,
             plan=None) -> list[Result]:
    """Decode every prompt to the end (in flight together, as many as the engine has slots); audio is decoded
    through the same exact codec windows as streaming."""
    from .request import request_for
    from .scheduler import Scheduler

    scheduler = Scheduler(engine, plan)
    requests = [scheduler.submit(request_for(engine, p, sampling, hard_cap)) for p in prompts]
    scheduler.run()
    return [Result(r.utterance.frames(), r.audio(), r.utterance.stop_reason, len(r.utterance.rows)) for r in requests]
