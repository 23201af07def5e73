"""`bench stream --realtime`: listeners arriving at random (a Poisson process) at a given rate, each playing its audio
at 1× once it holds a buffer of it; how often and how long they stall, and how soon they hear the first audio.

A listener starts playing when `buffer` seconds of audio have arrived (or the whole utterance, if shorter). It stalls
when playback reaches the end of what has arrived before the utterance is complete, and plays again once the buffer
is full again; the stall lasts from the moment it ran dry to then (loop.playback). Listeners is the time-average of the
requests from submission to the end of their playback: the concurrent real-time streams. Mean streams is the
time-average of the requests holding a slot (admission to their last audio), fewer where decoding runs ahead of 1×."""

import time
from dataclasses import dataclass

import numpy as np

from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.wav import SAMPLE_RATE

from .loop import playback


@dataclass
class RealtimeFigures:
    rate: float  # arrivals per second
    requests: int
    refused: int  # refused at admission (the scheduler's real-time rule)
    audio_s: float
    stalled_s: list  # per request
    ttfa_ms: list
    mean_streams: float  # requests holding a slot, time-averaged
    listeners: float  # listeners from their request to the end of their playback, time-averaged
    kv_mib: float | None = None  # cache each request holds (engines that page their cache)

    def line(self) -> str:
        stalled = np.array(self.stalled_s or [0.0])
        ttfa = np.array(self.ttfa_ms or [0.0])
        return (f"{self.rate:g} arrivals/s: {self.requests} requests ({self.refused} refused), mean listeners "
                f"{self.listeners:.1f}, in slots {self.mean_streams:.1f}"
                + (f" holding {self.kv_mib:.0f} MiB of cache each" if self.kv_mib is not None else "") + "; stall share "
                f"{stalled.sum() / max(self.audio_s, 1e-9):.2%}, stalled requests "
                f"{int((stalled > 0).sum())}, p95 stall {1e3 * np.percentile(stalled, 95):.0f} ms; first audio p50 "
                f"{np.percentile(ttfa, 50):.1f} ms, p95 {np.percentile(ttfa, 95):.1f} ms")


def bench_realtime(scheduler, engine, prompt, rate: float, duration: float, rows: int, buffer: float,
                   seed: int = 0) -> RealtimeFigures:
    """Arrivals at `rate` a second for `duration` seconds (seeded), each a request of exactly `rows` rows."""
    from higgs_trt.runtime.request import QueueFull, request_for, segment_rows

    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, size=max(1, int(rate * duration * 2) + 10)))
    arrivals = list(arrivals[arrivals < duration])
    done, chunks, refused = [], {}, 0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        while arrivals and arrivals[0] <= now:
            arrivals.pop(0)
            request = request_for(engine, prompt, Sampling(1.0, seed=len(done) + refused), hard_cap=rows,
                                  on_done=done.append)
            request.fixed_rows = True
            request.on_chunk = lambda c, r=request: chunks.setdefault(id(r), []).append((time.perf_counter(), len(c)))
            try:
                scheduler.submit(request)
            except QueueFull:
                refused += 1
        if not scheduler.step():
            if not arrivals:
                break
            time.sleep(max(0.0, arrivals[0] - (time.perf_counter() - t0)))
    wall = time.perf_counter() - t0
    lived = sum(r.finished_at - r.admitted_at for r in done if r.admitted_at is not None)
    audio = sum(n for r in done for _, n in chunks.get(id(r), [])) / SAMPLE_RATE
    heard = {id(r): playback(chunks[id(r)], buffer) for r in done if id(r) in chunks}
    span = max([wall] + [ends - t0 for _, ends in heard.values()])
    listened = sum(heard[id(r)][1] - r.submitted_at for r in done if id(r) in heard)
    return RealtimeFigures(rate, len(done), refused, audio, [stalled for stalled, _ in heard.values()],
                           [1e3 * (r.first_audio_at - r.submitted_at) for r in done if r.first_audio_at],
                           lived / wall, listened / span,
                           cache_mib(engine, len(prompt) + segment_rows(engine, prompt, rows)))


def cache_mib(engine, positions: int) -> float | None:
    """MiB of KV cache a request reserving `positions` (its prompt and row cap: Scheduler._admit) holds: whole pages
    where the engine pages its cache (the GPU engine), else None (the other engines give every slot max_seq)."""
    kv = getattr(engine, "kv", None)
    if kv is None:
        return None
    return kv.pages_for(positions) * kv.pool.nbytes / kv.pages / (1 << 20)
