"""The slot contract: the calls the scheduler (runtime/scheduler.py) drives every engine through. The host stepper
(runtime/stepper.py: ONNX Runtime, TensorRT, the torch reference) and the GPU engine (runtime/gpu/engine.py) declare
it by subclassing SlotEngine."""

from typing import Protocol

import numpy as np

from .decoding import Sampling
from .prompt import Prompt
from .streaming import StreamPlan


class Audio(Protocol):
    """A codec call's audio: ready() says, without waiting, whether result() would return at once."""

    def ready(self) -> bool: ...

    def result(self) -> np.ndarray: ...


class Decoded(Audio):
    """Audio a codec call has already produced."""

    def __init__(self, audio: np.ndarray):
        self.audio = audio

    def ready(self) -> bool:
        return True

    def result(self) -> np.ndarray:
        return self.audio


class SlotEngine(Protocol):
    """max_batch slots, each holding one request's KV cache and decode state."""

    name: str
    max_batch: int
    max_seq: int  # cache positions per slot
    max_prompt: int  # the longest prompt one prefill takes
    codec_strides: tuple[int, ...]
    lag: int  # launches whose rows are not read yet when step() returns (0: rows are known at once)

    def prefill(self, joins: list[tuple[int, Prompt, Sampling]]) -> None:
        """Fill each (slot, prompt, sampling) join's slot and choose its row 0; the engine may batch the joins."""

    def step(self, n: int, rows: int = 1) -> int:
        """Decode up to `rows` rows for every live slot below n; returns how many it launched."""

    def rows(self, keep: int = 0) -> list[tuple[int, np.ndarray]]:
        """(slot, its 8 codes) of every launched row not read yet, oldest first, waiting until at most `keep`
        launches are pending; rows of slots released or refilled since their launch are dropped."""

    def reserve(self, slot: int, positions: int) -> bool:
        """Hold cache for `positions` positions (a request's prompt and its row cap) in `slot` before its prefill;
        False if the cache has no room for them now (the request waits). Engines whose slots each hold a whole
        max_seq cache always have room."""

    def release(self, slot: int) -> None:
        """The slot's request is done: its rows are no longer advanced or returned, and its cache is free."""

    def busy(self) -> bool:
        """A launched step still runs (never, for an engine whose steps return when done)."""

    def prepare_codec(self, plan: StreamPlan) -> None:
        """Once per scheduler, before any request: get ready for the plan's codec windows."""

    def codec(self, codes: np.ndarray, keep: tuple[int, int] | None = None) -> Audio:
        """Windows of equal length [W, 8, T] → the audio of frames `keep` of each window [W, 1, samples]."""
