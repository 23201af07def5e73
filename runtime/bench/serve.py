"""`higgs-trt bench serve`: a running `higgs-trt serve` measured at the client, as its users see it.

Closed-loop clients over HTTP (aiohttp): `concurrency` requests in flight, each finished one replaced by the next, until
`requests` have finished. Each streams pcm (`stream_format: audio`), with its own seed and at most `max_new_tokens`
decode steps. Per level: audio seconds received / wall time (audio-s/s), time to first audio from sending the
request to the first audio byte (p50 / p95 / mean), and underruns (pieces that arrived after the audio before them
would have finished playing, the first excepted), and continuity as SGLang-Omni reports it: the share of requests
whose playback at 1× with a 100 ms client buffer never stalls, and the p95 stall. One warm-up request runs first.
From the server's /metrics, read before and after each level: where its engine thread spent the level (the scheduler
loop's phases), how many prefill calls the joins took, how long requests waited for a slot (submission → the prefill
call that took them: part of their first audio), and at the server their mean admission (the handler's start →
submission: body, parsing, prompt) and first audio after it (submission → the first chunk handed to the event loop):
the rest of the client's figure is HTTP, the event loop and the client.

A cluster (`serve --cluster`) is measured the same way: its /metrics carries each replica's figures under a replica
label, summed here over the replicas. Several servers (`--url` again) are measured level by level, one after another,
and each level ends with every server's throughput and first audio against the first server's.
"""

import asyncio
import re
import time

import aiohttp
import numpy as np

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.scheduler import PHASES
from higgs_trt.runtime.server.speech_api import MODEL_ID
from higgs_trt.runtime.wav import SAMPLE_RATE

from .loop import STALL_BUFFER_S, StreamFigures, playback, underruns

BYTES_PER_SECOND = 2 * SAMPLE_RATE  # pcm: s16le mono
WAIT_REPORT_S = 30.0  # how often a wait for the server's /health says that it goes on


async def _one(session: aiohttp.ClientSession, body: dict) -> tuple[float | None, list, str | None]:
    """(time to first audio, [(arrival, bytes)], error) of one streamed request."""
    arrivals, t0 = [], time.perf_counter()
    async with session.post("/v1/audio/speech", json=body) as response:
        if response.status != 200:
            return None, [], f"{response.status} {(await response.read())[:200]!r}"
        async for piece in response.content.iter_any():
            if piece:
                arrivals.append((time.perf_counter(), len(piece)))
    return (arrivals[0][0] - t0 if arrivals else None), arrivals, None


async def _level(url: str, concurrency: int, requests: int, body, headers: dict) -> tuple[StreamFigures, list[str]]:
    # aiohttp, not httpx: at 64 streams on the H200's host httpx's client added ~200 ms to the mean first audio and
    # took 3.6 s for a level that a bare asyncio client finished in 2.9 s (.device measurement, 2026-12-01)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=600.0),
                                     headers=headers) as session:
        pending = iter(range(requests))
        results = []

        async def client_loop():
            for i in pending:  # one iterator shared by every client: each takes the next request
                results.append(await _one(session, body(i)))

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, requests))))
        wall = time.perf_counter() - t0
    errors = [e for _, _, e in results if e]
    ttfa = [1e3 * t for t, _, e in results if t is not None and not e]
    audio_bytes = sum(n for _, arrivals, _ in results for _, n in arrivals)
    late = sum(underruns(arrivals, BYTES_PER_SECOND) for _, arrivals, _ in results)
    stalls = [playback(arrivals, STALL_BUFFER_S, BYTES_PER_SECOND)[0] for _, arrivals, e in results if arrivals and not e]
    return StreamFigures(concurrency, len(results) - len(errors), audio_bytes / BYTES_PER_SECOND, wall, ttfa or [0.0],
                         late, stalls_s=stalls), errors


LOOP_METRIC = re.compile(r'^higgs_(engine_loop_seconds|prefill_calls|codec_calls|codec_windows|'
                         r'(?:admission|queue_wait|time_to_first_audio)_seconds_(?:sum|count))(?:\{([^}]*)\})? (\S+)$',
                         re.MULTILINE)
PHASE = re.compile(r'phase="(\w+)"')


async def _loop_totals(session: aiohttp.ClientSession) -> dict[str, float]:
    """The server's engine-loop seconds by phase, its prefill and codec calls (and windows), and its requests'
    admission, queue wait and first audio at the server (sum, count), since it started; a cluster's summed over its
    replicas."""
    async with session.get("/metrics") as response:
        text = await response.text()
    totals: dict[str, float] = {}
    for name, labels, value in LOOP_METRIC.findall(text):
        phase = PHASE.search(labels or "")
        key = phase[1] if name == "engine_loop_seconds" and phase else name
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals


async def _wait_ready(url: str, wait: float, say) -> dict:
    """Until the server's /health is 200 (its body then), saying every WAIT_REPORT_S that it still waits (a server
    that died at start would otherwise leave the command silent for all of `wait`)."""
    start = time.perf_counter()
    deadline, report = start + wait, start + WAIT_REPORT_S
    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=5.0)) as session:
        while True:
            try:
                async with session.get("/health") as r:
                    if r.status == 200:
                        health = await r.json()
                        say(f"server ready: {health}")
                        return health
                    status = f"{r.status} {(await r.text())[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status = f"{type(e).__name__}"
            now = time.perf_counter()
            if now > deadline:
                raise HiggsError(f"{url}/health is not 200 after {wait:g} s (last: {status})")
            if now > report:
                say(f"still waiting for {url}/health: {now - start:.0f} s of {wait:g} (last: {status})")
                report += WAIT_REPORT_S
            await asyncio.sleep(1.0)


def served_by(url: str, health: dict) -> str:
    """A server's label in the figures: where it is and what serves it."""
    replicas = health.get("replicas")
    what = "one process" if replicas is None else f"cluster of {len(replicas)}"
    return f"{url.split('://', 1)[-1]} ({what})"


def run_bench_serve(urls: list[str], levels: list[int], requests: int, max_new_tokens: int, text: str, voice: str,
                    wait: float, api_key: str | None, say, echo) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(seed: int) -> dict:
        return {"model": MODEL_ID, "input": text, "voice": voice, "response_format": "pcm",
                "max_new_tokens": max_new_tokens, "seed": seed}

    async def measure(url: str, c: int, label: str) -> StreamFigures:
        await _level(url, c, c, body, headers)  # warm-up: the codec meets this level's window shapes first
        async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=30.0), headers=headers) as metrics:
            before = await _loop_totals(metrics)
            figures, errors = await _level(url, c, requests or 2 * c, body, headers)
            after = await _loop_totals(metrics)
        delta = {name: after[name] - before.get(name, 0.0) for name in after}
        figures.label = label
        figures.phases = {phase: delta[phase] for phase in PHASES if phase in delta}
        calls = delta.get("prefill_calls")  # None: a server without these metrics
        figures.codec_calls = int(delta.get("codec_calls", 0))
        figures.codec_windows = int(delta.get("codec_windows", 0))
        mean_ms = {name: 1e3 * delta[f"{name}_seconds_sum"] / delta[f"{name}_seconds_count"]
                   for name in ("admission", "queue_wait", "time_to_first_audio")
                   if delta.get(f"{name}_seconds_count")}
        figures.queue_wait_ms = mean_ms.get("queue_wait")
        if "admission" in mean_ms and "time_to_first_audio" in mean_ms:
            figures.server_ms = (mean_ms["admission"], mean_ms["time_to_first_audio"])
        echo(figures.line() + (f"; {calls:.0f} prefill calls" if calls is not None else "")
             + (f"; {len(errors)} failed, first: {errors[0]}" if errors else ""))
        return figures

    async def main():
        labels = []
        for url in urls:
            health = await _wait_ready(url, wait, say)
            labels.append(served_by(url, health) if len(urls) > 1 else "")  # one server: lines as they always were
            warm, errors = await _level(url, 1, 1, body, headers)
            if errors:
                raise HiggsError(f"the warm-up request to {url} failed: {errors[0]}")
        say(f"warm-up: {warm.audio_s:.2f} s of audio per request ({max_new_tokens} decode steps at most)")
        for c in levels:
            runs = [await measure(url, c, label) for url, label in zip(urls, labels)]
            if len(runs) > 1:
                first = runs[0]
                echo(f"  concurrency {c} against {first.label}: " + ", ".join(
                    f"{run.label} {run.audio_s / run.wall_s / (first.audio_s / first.wall_s):.2f}× audio-s/s, "
                    f"{np.percentile(run.ttfa_ms, 50) / np.percentile(first.ttfa_ms, 50):.2f}× first audio p50"
                    for run in runs[1:]))

    asyncio.run(main())
