"""`higgs-trt bench serve`: a running `higgs-trt serve` measured at the client, as its users see it.

Closed-loop clients over HTTP (httpx): `concurrency` requests in flight, each finished one replaced by the next, until
`requests` have finished. Each streams pcm (`stream_format: audio`), with its own seed and at most `max_new_tokens`
decode steps. Per level: audio seconds received / wall time (audio-s/s), time to first audio from sending the
request to the first audio byte (p50 / p95 / mean), and underruns (pieces that arrived after the audio before them
would have finished playing, the first excepted). One warm-up request runs first. From the server's /metrics, read
before and after each level: where its engine thread spent the level (the scheduler loop's phases), how many
prefill calls the joins took, and how long requests waited for a slot (submission → the prefill call that took them:
part of their first audio).
"""

import asyncio
import re
import time

import httpx

from .bench import StreamFigures
from .errors import HiggsError
from .speech_api import MODEL_ID
from .wav import SAMPLE_RATE

BYTES_PER_SECOND = 2 * SAMPLE_RATE  # pcm: s16le mono


async def _one(client: httpx.AsyncClient, body: dict) -> tuple[float | None, list, str | None]:
    """(time to first audio, [(arrival, bytes)], error) of one streamed request."""
    arrivals, t0 = [], time.perf_counter()
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            return None, [], f"{response.status_code} {(await response.aread())[:200]!r}"
        async for piece in response.aiter_raw():
            if piece:
                arrivals.append((time.perf_counter(), len(piece)))
    return (arrivals[0][0] - t0 if arrivals else None), arrivals, None


async def _level(url: str, concurrency: int, requests: int, body) -> tuple[StreamFigures, list[str]]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        pending = iter(range(requests))
        results = []

        async def client_loop():
            for i in pending:  # one iterator shared by every client: each takes the next request
                results.append(await _one(client, body(i)))

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, requests))))
        wall = time.perf_counter() - t0
    errors = [e for _, _, e in results if e]
    ttfa = [1e3 * t for t, _, e in results if t is not None and not e]
    audio_bytes, underruns = 0, 0
    for _, arrivals, _ in results:
        played = 0
        for i, (at, n) in enumerate(arrivals):
            if i and at > arrivals[0][0] + played / BYTES_PER_SECOND:
                underruns += 1
            played += n
        audio_bytes += played
    return StreamFigures(concurrency, len(results) - len(errors), audio_bytes / BYTES_PER_SECOND, wall, ttfa or [0.0],
                         underruns), errors


LOOP_METRIC = re.compile(r'^higgs_(?:engine_loop_seconds\{phase="(\w+)"\}|(prefill_calls|codec_calls|codec_windows|'
                         r'queue_wait_seconds_sum|queue_wait_seconds_count)) (\S+)$', re.MULTILINE)


async def _loop_totals(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's engine-loop seconds by phase, its prefill and codec calls (and windows) and its requests' queue
    wait (sum, count), since it started."""
    text = (await client.get("/metrics")).text
    return {phase or name: float(value) for phase, name, value in LOOP_METRIC.findall(text)}


async def _wait_ready(url: str, wait: float, say) -> None:
    deadline = time.perf_counter() + wait
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        while True:
            try:
                r = await client.get("/health")
                if r.status_code == 200:
                    say(f"server ready: {r.json()}")
                    return
                status = f"{r.status_code} {r.text[:200]}"
            except httpx.TransportError as e:
                status = f"{type(e).__name__}"
            if time.perf_counter() > deadline:
                raise HiggsError(f"{url}/health is not 200 after {wait:g} s (last: {status})")
            await asyncio.sleep(1.0)


def run_bench_serve(url: str, levels: list[int], requests: int, max_new_tokens: int, text: str, voice: str,
                    wait: float, say, echo) -> None:
    def body(seed: int) -> dict:
        return {"model": MODEL_ID, "input": text, "voice": voice, "response_format": "pcm",
                "max_new_tokens": max_new_tokens, "seed": seed}

    async def main():
        await _wait_ready(url, wait, say)
        warm, errors = await _level(url, 1, 1, body)
        if errors:
            raise HiggsError(f"the warm-up request failed: {errors[0]}")
        say(f"warm-up: {warm.audio_s:.2f} s of audio per request ({max_new_tokens} decode steps at most)")
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as metrics:
            for c in levels:
                await _level(url, c, c, body)  # warm-up: the codec meets this level's window shapes first
                before = await _loop_totals(metrics)
                figures, errors = await _level(url, c, requests or 2 * c, body)
                after = await _loop_totals(metrics)
                figures.phases = {phase: after[phase] - before.get(phase, 0.0) for phase in after}
                calls = figures.phases.pop("prefill_calls", None)  # None: a server without these metrics
                waited = figures.phases.pop("queue_wait_seconds_sum", None)
                admitted = figures.phases.pop("queue_wait_seconds_count", 0)
                figures.codec_calls = int(figures.phases.pop("codec_calls", 0))
                figures.codec_windows = int(figures.phases.pop("codec_windows", 0))
                if waited is not None and admitted:
                    figures.queue_wait_ms = 1e3 * waited / admitted
                echo(figures.line() + (f"; {calls:.0f} prefill calls" if calls is not None else "")
                     + (f"; {len(errors)} failed, first: {errors[0]}" if errors else ""))

    asyncio.run(main())
