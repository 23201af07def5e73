"""The slot contract (runtime/slots.py) over an engine graph that is called from the host (ONNX Runtime, TensorRT, the
torch reference). The GPU engine (runtime/gpu/engine.py) keeps each slot's decode state on the device; this class
keeps it on the host for a backend that offers one graph call,

  lm(feeds, slot=None) → (logits [B,8,1026], codes [B,8])

where `slot=i` runs a batch-1 call on slot i's cache (a prefill, one join at a time) and `slot=None` runs the first B
slots (a step). Each row is chosen here by the shared rules: the graph's greedy codes, or runtime/sampling.py's seeded
sampling under the delay mask; then the end frame (decoding.find_end) and the row fed back, masked with that end.
"""

import math

import numpy as np

from .decoding import NO_END, NUM_CODEBOOKS, Sampling, delay_mask, find_end
from .generate import prefill_feeds, step_feeds
from .prefix_cache import DEFAULT_ENTRIES, PrefixCache
from .prompt import Prompt
from .sampling import choose_row
from .slots import Decoded, SlotEngine


class HostStepper(SlotEngine):
    lag = 0  # rows are known when step() returns

    def __init__(self, backend, prefix_entries: int = DEFAULT_ENTRIES):
        self.backend = backend
        self.prefixes = PrefixCache(prefix_entries)
        self.cacheable = hasattr(backend, "read_cache")  # a backend whose caches the host can copy (not TensorRT's)
        self.swappable = hasattr(backend, "swap_cache")  # can move a request between slots (the scheduler's lanes)
        self.name, self.max_batch, self.max_seq = backend.name, backend.max_batch, backend.max_seq
        self.max_prompt, self.codec_strides = backend.max_prompt, backend.codec_strides
        self.hop = math.prod(self.codec_strides)  # samples per frame, as the codec decodes them
        b = self.max_batch
        self.write_pos = np.zeros(b, np.int64)  # where the next fed row is written
        self.row = np.zeros(b, np.int64)  # the row the next call chooses
        self.end = np.full(b, NO_END, np.int64)
        self.fed = np.zeros((b, NUM_CODEBOOKS), np.int32)
        self.sampling: list[Sampling | None] = [None] * b
        self.live = [False] * b
        self.out: list[tuple[int, np.ndarray]] = []

    def prefill(self, joins: list[tuple[int, Prompt, Sampling]]) -> None:
        for slot, prompt, sampling in joins:
            self._prefill(slot, prompt, sampling)

    def _prefill(self, slot: int, prompt: Prompt, sampling: Sampling) -> None:
        """A prompt with a reference part is prefilled in two calls, the reference part first, whether or not its
        keys and values come from the prefix cache: the same calls either way, so the cache never changes a number."""
        start = prompt.prefix
        if start:
            kept = self.prefixes.get(prompt.prefix_key) if self.cacheable else None
            if kept is not None:
                self.backend.write_cache(slot, kept)
            else:
                self.backend.lm(prefill_feeds([prompt], 0, start), slot=slot)
                if self.cacheable:
                    self.prefixes.put(prompt.prefix_key, self.backend.read_cache(slot, start))
        logits, codes = self.backend.lm(prefill_feeds([prompt], start), slot=slot)
        self.write_pos[slot], self.row[slot], self.end[slot] = len(prompt), 0, NO_END
        self.sampling[slot], self.live[slot] = sampling, True
        self._choose(slot, logits[0], codes[0])

    def step(self, n: int, rows: int = 1) -> int:
        """One row for the live slots below n (a host-driven engine gains nothing from more rows per call); returns
        the rows decoded: 1."""
        feeds = step_feeds(self.fed[:n], self.write_pos[:n], self.row[:n], self.end[:n])
        logits, codes = self.backend.lm(feeds)
        for slot in range(n):
            if self.live[slot]:
                self.write_pos[slot] = min(self.write_pos[slot] + 1, self.max_seq - 1)
                self._choose(slot, logits[slot], codes[slot])
        return 1

    def _choose(self, slot: int, logits: np.ndarray, graph_codes: np.ndarray) -> None:
        s, row, end = self.sampling[slot], int(self.row[slot]), self.end[slot]
        if s.greedy:
            codes = np.array(graph_codes, np.int32)  # the graph's argmax under the same delay mask
        else:
            picked = choose_row(logits, s.temperature, s.top_k, s.top_p, s.seed, row)
            codes = delay_mask(picked[None], np.array([row]), np.array([end]))[0]
        self.end[slot] = find_end(codes, row, end)
        self.fed[slot] = delay_mask(codes[None], np.array([row]), self.end[slot:slot + 1])[0]
        self.row[slot] += 1
        self.out.append((slot, codes))

    def rows(self, keep: int = 0) -> list[tuple[int, np.ndarray]]:
        out, self.out = self.out, []
        return out

    def reserve(self, slot: int, positions: int) -> bool:
        return True  # every slot holds a whole max_seq cache

    def swap(self, a: int, b: int) -> None:
        """Exchange the requests of two slots, caches and decode state (neither has a row unread)."""
        self.backend.swap_cache(a, b)
        for state in (self.write_pos, self.row, self.end, self.fed):
            state[[a, b]] = state[[b, a]]
        self.sampling[a], self.sampling[b] = self.sampling[b], self.sampling[a]
        self.live[a], self.live[b] = self.live[b], self.live[a]

    def release(self, slot: int) -> None:
        self.live[slot] = False

    def busy(self) -> bool:
        return False

    def prepare_codec(self, plan) -> None:
        """Nothing to prepare: the codec graph takes any window length."""

    def codec(self, codes: np.ndarray, keep: tuple[int, int] | None = None) -> "Decoded":
        audio = self.backend.codec(codes)
        return Decoded(audio if keep is None else audio[..., keep[0] * self.hop:keep[1] * self.hop])

