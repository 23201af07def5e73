"""Decode-loop benchmark: time per row inside backend calls, and the loop's own host overhead per row."""

import time
from dataclasses import dataclass

import numpy as np

from .decoding import Sampling
from .generate import Backend, generate
from .prompt import Prompt


class TimedBackend:
    """Wraps a backend and records the wall time of each call (a prefill is the first lm call of a run)."""

    def __init__(self, backend: Backend):
        self.inner = backend
        self.name, self.max_seq, self.max_batch = backend.name, backend.max_seq, backend.max_batch
        self.lm_times: list[float] = []
        self.codec_times: list[float] = []

    def start(self, batch: int) -> None:
        self.inner.start(batch)
        self.lm_times.clear()
        self.codec_times.clear()

    def lm(self, feeds):
        t0 = time.perf_counter()
        out = self.inner.lm(feeds)
        self.lm_times.append(time.perf_counter() - t0)
        return out

    def codec(self, codes):
        t0 = time.perf_counter()
        out = self.inner.codec(codes)
        self.codec_times.append(time.perf_counter() - t0)
        return out


@dataclass
class Figures:
    mode: str
    rows: int
    prefill_ms: float
    step_ms: float  # median backend time of one decode step
    host_ms: float  # loop time outside backend calls, per row
    codec_ms: float
    audio_s: float
    total_s: float

    def line(self) -> str:
        return (f"{self.mode:<10} {self.rows:>5} rows  prefill {self.prefill_ms:7.2f} ms  step {self.step_ms:7.3f} ms/row  "
                f"host {self.host_ms:6.3f} ms/row  codec {self.codec_ms:7.1f} ms  "
                f"RTF {self.total_s / max(self.audio_s, 1e-9):.3f}")


def run_bench(backend: Backend, prompts: list[Prompt], sampling: Sampling, repeats: int = 3) -> Figures:
    timed = TimedBackend(backend)
    generate(timed, prompts, sampling)  # warm-up: first calls allocate and compile
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = generate(timed, prompts, sampling)
        total = time.perf_counter() - t0
        rows = max(r.rows for r in results)
        steps = timed.lm_times[1:]
        host = total - sum(timed.lm_times) - sum(timed.codec_times)
        runs.append(Figures("greedy" if sampling.greedy else f"T={sampling.temperature:g}", rows,
                            1e3 * timed.lm_times[0], 1e3 * float(np.median(steps)) if steps else 0.0,
                            1e3 * host / rows, 1e3 * sum(timed.codec_times),
                            sum(len(r.audio) for r in results) / 24000, total))
    return sorted(runs, key=lambda f: f.total_s)[len(runs) // 2]  # the median run
