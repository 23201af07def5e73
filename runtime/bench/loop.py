"""Decode-loop benchmark for host-driven engines (ONNX Runtime, TensorRT): time per step inside the engine, and the
loop's own host overhead per row. The GPU engine has its own, device-timed benchmark (runtime/bench/gpu.py)."""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.generate import generate
from higgs_trt.runtime.prompt import Prompt
from higgs_trt.runtime.wav import SAMPLE_RATE

STALL_BUFFER_S = 0.1  # the client buffer of the continuity figure


class TimedEngine:
    """Wraps a host-driven engine (lag 0) and records the wall time of each prefill, step and codec call."""

    def __init__(self, engine):
        self.inner = engine
        self.name, self.max_seq, self.max_batch = engine.name, engine.max_seq, engine.max_batch
        self.max_prompt, self.codec_strides, self.lag = engine.max_prompt, engine.codec_strides, engine.lag
        self.times: dict[str, list[float]] = {"prefill": [], "step": [], "codec": []}

    def _timed(self, kind: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.times[kind].append(time.perf_counter() - t0)
        return out

    def prefill(self, joins):
        return self._timed("prefill", self.inner.prefill, joins)

    def step(self, n, rows=1):
        return self._timed("step", self.inner.step, n, rows)

    def codec(self, codes, keep=None):
        return self._timed("codec", self.inner.codec, codes, keep)

    def rows(self, keep=0):
        return self.inner.rows(keep)

    def reserve(self, slot, positions):
        return self.inner.reserve(slot, positions)

    def release(self, slot):
        self.inner.release(slot)

    def busy(self):
        return self.inner.busy()

    def prepare_codec(self, plan):
        self.inner.prepare_codec(plan)


@dataclass
class Figures:
    mode: str
    rows: int
    prefill_ms: float
    step_ms: float  # median engine time of one decode step
    host_ms: float  # loop time outside engine calls, per row
    codec_ms: float
    audio_s: float
    total_s: float

    def line(self) -> str:
        return (f"{self.mode:<10} {self.rows:>5} rows  prefill {self.prefill_ms:7.2f} ms  step {self.step_ms:7.3f} ms/row  "
                f"host {self.host_ms:6.3f} ms/row  codec {self.codec_ms:7.1f} ms  "
                f"RTF {self.total_s / max(self.audio_s, 1e-9):.3f}")


def run_bench(engine, prompts: list[Prompt], sampling: Sampling, repeats: int = 3, rows: int = 2048) -> Figures:
    timed = TimedEngine(engine)
    generate(timed, prompts, sampling, hard_cap=rows)  # warm-up: first calls allocate and compile
    runs = []
    for _ in range(repeats):
        for v in timed.times.values():
            v.clear()
        t0 = time.perf_counter()
        results = generate(timed, prompts, sampling, hard_cap=rows)
        total = time.perf_counter() - t0
        rows = max(r.rows for r in results)
        engine_s = sum(sum(v) for v in timed.times.values())
        steps = sorted(timed.times["step"])
        runs.append(Figures("greedy" if sampling.greedy else f"T={sampling.temperature:g}", rows,
                            1e3 * sum(timed.times["prefill"]) / len(prompts),
                            1e3 * steps[len(steps) // 2] if steps else 0.0,
                            1e3 * (total - engine_s) / rows, 1e3 * sum(timed.times["codec"]),
                            sum(len(r.audio) for r in results) / SAMPLE_RATE, total))
    return sorted(runs, key=lambda f: f.total_s)[len(runs) // 2]  # the median run


@dataclass
class StreamFigures:
    concurrency: int
    requests: int
    audio_s: float
    wall_s: float
    ttfa_ms: list  # per request
    underruns: int  # chunks that arrived after the audio before them had finished playing (first chunks excepted)
    phases: dict | None = None  # seconds of the scheduler's loop by phase
    queue_wait_ms: float | None = None  # mean time from submission to the prefill call that gave a request its slot
    codec_calls: int = 0
    codec_windows: int = 0
    server_ms: tuple | None = None  # bench serve, at the server: mean admission, then mean submission → first chunk
    label: str = ""  # what the level ran, where a bench runs several kinds side by side
    stalls_s: list | None = None  # per request: seconds a 1× listener with a STALL_BUFFER_S buffer spends stalled

    def continuity(self) -> str:
        """As SGLang-Omni reports it: the share of requests whose playback never stalls, and the p95 stall."""
        stalls = np.array(self.stalls_s or [0.0])
        return (f"continuity {(stalls == 0).mean():.1%} never stalled ({1e3 * STALL_BUFFER_S:.0f} ms buffer), "
                f"p95 stall {1e3 * np.percentile(stalls, 95):.0f} ms")

    def line(self) -> str:
        ttfa = np.array(self.ttfa_ms)
        line = (f"{self.label + ', ' if self.label else ''}concurrency {self.concurrency:>3}: {self.requests:>4} "
                f"requests, {self.audio_s:7.1f} s of audio in {self.wall_s:6.2f} s = "
                f"{self.audio_s / self.wall_s:7.1f} audio-s/s; first audio p50 {np.percentile(ttfa, 50):6.1f} ms, "
                f"p95 {np.percentile(ttfa, 95):6.1f} ms, mean {ttfa.mean():6.1f} ms; underruns {self.underruns}")
        if self.stalls_s is not None:
            line += "; " + self.continuity()
        if self.queue_wait_ms is not None:
            line += f"; queue wait mean {self.queue_wait_ms:.1f} ms"
        if self.server_ms is not None:
            line += (f"; at the server: admission {self.server_ms[0]:.1f} ms, then first audio {self.server_ms[1]:.1f} ms"
                     " (means)")
        if self.phases:
            line += "; loop " + ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.phases.items())
        if self.codec_calls:
            line += f"; {self.codec_calls} codec calls of {self.codec_windows / self.codec_calls:.1f} windows"
        return line


def playback(chunks: list[tuple[float, int]], buffer: float, per_second: int = SAMPLE_RATE) -> tuple[float, float]:
    """(seconds stalled, when playback ends) for a 1× listener given (arrival time, samples or bytes: `per_second` of
    them a second) pieces: it starts playing once `buffer` seconds have arrived (or all of it, if shorter), stalls
    when it reaches the end of what has arrived before the utterance is complete, and plays again once the buffer is
    full again; a stall lasts from the moment it ran dry to then."""
    total = sum(n for _, n in chunks) / per_second
    received = played_at_start = 0.0
    playing_since = ran_dry = None
    stalled = 0.0
    for at, n in chunks:
        if playing_since is not None and playing_since + received - played_at_start < at:
            ran_dry = playing_since + received - played_at_start
            playing_since, played_at_start = None, received
        received += n / per_second
        if playing_since is None and (received - played_at_start >= buffer or received >= total - 1e-9):
            if ran_dry is not None:
                stalled += at - ran_dry
                ran_dry = None
            playing_since = at
    ends = playing_since + received - played_at_start if chunks else 0.0  # the last piece always starts playback
    return stalled, ends


def underruns(arrivals: list[tuple[float, int]], per_second: int = SAMPLE_RATE) -> int:
    """Chunks (arrival time, samples or bytes: `per_second` of them a second) that arrived after the audio sent
    before them had finished playing, the clock starting at the first chunk's arrival."""
    late, played = 0, 0
    for i, (at, n) in enumerate(arrivals):
        if i and at > arrivals[0][0] + played / per_second:
            late += 1
        played += n
    return late


def bench_stream(engine, speech: Callable[[], tuple], concurrency: int, requests: int, rows: int, sampling: Sampling,
                 plan=None, stagger: bool = False, label: str = "", lanes: int | None = None) -> StreamFigures:
    """Closed-loop clients: `concurrency` requests in flight, each finished one replaced by a new one, until
    `requests` have finished. `speech()` gives a request's first prompt and the script of its later segments (None
    for one segment). Every segment decodes exactly `rows` rows (random weights repeat rows and emit EOC at random:
    the stop rules are off here, so every level does the same work). All clients start at once, so their requests
    end and join together; with `stagger` client i starts after about i·rows/concurrency loop steps, so that requests
    end and join at different steps, as served traffic does."""
    from higgs_trt.runtime.request import request_for
    from higgs_trt.runtime.scheduler import Scheduler

    scheduler = Scheduler(engine, plan, lanes=lanes)
    done, arrivals = [], {}
    submitted = [0]

    def submit():
        submitted[0] += 1
        prompt, script = speech()
        request = request_for(engine, prompt, sampling, hard_cap=rows, script=script, on_done=finished)
        request.fixed_rows = True
        request.on_chunk = lambda chunk, r=request: arrivals.setdefault(id(r), []).append((time.perf_counter(), len(chunk)))
        scheduler.submit(request)

    def finished(request):
        done.append(request)
        if submitted[0] < requests:
            submit()

    clients = min(concurrency, requests)
    starts = deque(i * rows // clients if stagger else 0 for i in range(clients))  # loop step of each first request
    t0 = time.perf_counter()
    steps = 0
    while True:
        while starts and starts[0] <= steps:
            starts.popleft()
            submit()
        if not scheduler.step() and not starts:
            break
        steps += 1
    wall = time.perf_counter() - t0
    late = sum(underruns(arrivals.get(id(r), [])) for r in done)
    stalls = [playback(arrivals[id(r)], STALL_BUFFER_S)[0] for r in done if id(r) in arrivals]
    audio = sum(n for r in done for _, n in arrivals.get(id(r), []))
    ttfa = [1e3 * (r.first_audio_at - r.submitted_at) for r in done if r.first_audio_at]
    waits = [1e3 * (r.admitted_at - r.submitted_at) for r in done if r.admitted_at is not None]
    return StreamFigures(concurrency, len(done), audio / SAMPLE_RATE, wall, ttfa, late, dict(scheduler.seconds),
                         float(np.mean(waits)) if waits else None, scheduler.codec_calls, scheduler.codec_windows,
                         label=label, stalls_s=stalls)
