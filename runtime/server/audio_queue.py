"""One request's audio on its way from the engine thread to its response body (an HTTP body or a WebSocket)."""

import asyncio

import numpy as np

from higgs_trt.runtime.wav import NON_FINITE, SAMPLE_RATE

from .metrics import Metrics


class Cut(Exception):
    """The request stopped before its audio was complete (timeout, engine failure)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class AudioQueue:
    """The request's callbacks (called on the engine thread) → an asyncio.Queue the response body reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: Metrics, limit: int | None = None, on_overflow=None):
        self.loop, self.metrics = loop, metrics
        self.items: asyncio.Queue = asyncio.Queue()
        # samples queued and not yet taken by the body, at most `limit`: past it (a client that stopped reading)
        # on_overflow() is called once, on the event loop
        self.queued, self.limit, self.on_overflow = 0, limit, on_overflow
        self.stopped: str | None = None  # why the body stopped early: the outcome of a cancelled request
        self.non_finite = False  # a chunk held NaN or infinite samples: the body is cut there, the request failed

    def chunk(self, samples: np.ndarray) -> None:
        if np.isfinite(samples).all():
            self.metrics.audio.inc(len(samples) / SAMPLE_RATE)
            self._put(samples)
        elif not self.non_finite:  # checked here, on the engine thread: the body meets a Cut where the chunk was
            self.non_finite = True
            self._put(Cut(f"the engine decoded {NON_FINITE}", "engine_error"))

    def done(self, request) -> None:
        failed = request.error or self.non_finite
        outcome = "failed" if failed else (self.stopped or "cancelled") if request.cancelled else "completed"
        self.metrics.requests.labels(outcome).inc()
        if request.admitted_at is not None:
            self.metrics.queue_wait.observe(request.admitted_at - request.submitted_at)
        if request.first_audio_at is not None:
            self.metrics.ttfa.observe(request.first_audio_at - request.submitted_at)
        self._put(None)

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._enqueue, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def _enqueue(self, item) -> None:
        self.items.put_nowait(item)
        if isinstance(item, np.ndarray):
            self.queued += len(item)
            if self.limit is not None and self.queued > self.limit and self.on_overflow is not None:
                self.on_overflow()
                self.on_overflow = None

    async def chunks(self, request, deadline: float):
        """The request's audio chunks as they come; Cut if it times out or fails."""
        while True:
            try:
                item = await asyncio.wait_for(self.items.get(), max(deadline - self.loop.time(), 0))
            except asyncio.TimeoutError:
                self.stopped = "timeout"
                raise Cut("the request timed out (the server's --timeout)", "timeout") from None
            if item is None:
                break
            if isinstance(item, Cut):
                raise item
            self.queued -= len(item)
            yield item
        if request.error:
            raise Cut(request.error, "engine_error")
