"""A job that a replica runs, as the routes see it (the Job of runtime/server/engine_thread.py): the replica's events
(replica.py), read as Ray streams them, into the audio queue the response body takes chunks from.

A replica lost before the job's first chunk makes `started()` raise a 503 (the route has not answered yet); after it,
the body meets Cut("…", "replica_lost") where the audio stops: a cut wav or pcm body, an SSE or WebSocket error.
"""

import asyncio
import time

from higgs_trt.runtime.errors import HiggsError, TextError
from higgs_trt.runtime.request import QueueFull
from higgs_trt.runtime.server.audio_queue import Cut
from higgs_trt.runtime.server.speech_api import ApiError

from .replica import Accepted, Audio, Finished, Pin, Refused, Stopped

# The replica cuts a job at its deadline (Stopped, "timeout"); past it by this much, the ingress stops waiting itself.
GRACE_S = 5.0


def raised(refusal: Refused) -> Exception:
    """A replica's refusal as the exception the same refusal raises in one process."""
    if refusal.kind == "NotReady":
        return ApiError(503, refusal.message, None, "not_ready", "server_error", {"Retry-After": "5"})
    return {"QueueFull": QueueFull, "TextError": TextError}.get(refusal.kind, HiggsError)(refusal.message)


def replica_lost(why: str) -> ApiError:
    return ApiError(503, f"the replica serving the request was lost before its audio started ({why}); retry", None,
                    "replica_lost", "server_error", {"Retry-After": "1"})


class RemoteJob:
    def __init__(self, handle, events, limit: int | None = None, on_overflow=None):
        """`events`: the replica's streaming call (a DeploymentResponseGenerator); `handle`: for pinned calls."""
        self.handle, self.events = handle, events
        loop = asyncio.get_running_loop()
        self.items: asyncio.Queue = asyncio.Queue()
        self.queued, self.limit, self.on_overflow = 0, limit, on_overflow  # unsent audio, as AudioQueue counts it
        self.accepted = loop.create_future()  # None, or the exception to raise instead
        self.first = loop.create_future()  # set at the first chunk or the end: the response may start
        self.replica = self.ticket = self.submitted_at = None
        self.lost: str | None = None
        self.audio = False
        self.input_tokens = self.total_rows = self.prompt_tokens = 0
        self.said: list[str] = []
        self.bounds: list[int] = []
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for event in self.events:
                self._take(event)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the replica died (Ray's actor errors), or its call failed: the job is gone
            self._lose(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            if not self.accepted.done():  # a call that ended unanswered
                self.accepted.set_result(replica_lost(self.lost or "no answer"))
            if not self.first.done():
                self.first.set_result(None)

    def _take(self, event) -> None:
        if isinstance(event, Refused):
            self.accepted.set_result(raised(event))
        elif isinstance(event, Accepted):
            self.replica, self.ticket, self.input_tokens = event.replica, event.ticket, event.input_tokens
            self.submitted_at = time.perf_counter()
            self.accepted.set_result(None)
        elif isinstance(event, Audio):
            self.said += event.said
            self.bounds += event.bounds
            self.audio = True
            self._put(event.samples)
        elif isinstance(event, Finished):
            self.total_rows, self.prompt_tokens = event.total_rows, event.prompt_tokens
            self.said += event.said
            self.bounds += event.bounds
            self._put(None)
        elif isinstance(event, Stopped):
            self._put(Cut(event.message, event.code))

    def _lose(self, why: str) -> None:
        self.lost = why
        if self.accepted.done():
            self._put(Cut(f"the replica serving the request was lost: {why}", "replica_lost"))
        else:
            self.accepted.set_result(replica_lost(why))

    def _put(self, item) -> None:
        self.items.put_nowait(item)
        if not self.first.done():
            self.first.set_result(None)
        if item is not None and not isinstance(item, Cut):
            self.queued += len(item)
            if self.limit is not None and self.queued > self.limit and self.on_overflow is not None:
                self.on_overflow()
                self.on_overflow = None

    async def accept(self, seconds: float) -> None:
        """Until a replica took the job: its refusal raised as one process raises it, 503 if none took it in time."""
        try:
            await asyncio.wait_for(asyncio.shield(self.accepted), max(seconds, 0))
        except asyncio.TimeoutError:
            self.cancel()
            raise ApiError(503, "no replica took the request before its deadline (the server's --timeout)", None,
                           "no_replica", "server_error", {"Retry-After": "1"}) from None
        if self.accepted.result() is not None:
            raise self.accepted.result()

    async def started(self, deadline: float) -> None:
        """Until the first chunk (or the end): a replica lost before then is a 503, not a cut body."""
        try:
            await asyncio.wait_for(asyncio.shield(self.first), max(deadline - asyncio.get_running_loop().time(), 0))
        except asyncio.TimeoutError:
            return  # the body times out as one process's does
        if self.lost is not None and not self.audio:
            raise replica_lost(self.lost)

    async def chunks(self, deadline: float):
        loop = asyncio.get_running_loop()
        while True:
            try:
                item = await asyncio.wait_for(self.items.get(), max(deadline + GRACE_S - loop.time(), 0))
            except asyncio.TimeoutError:
                raise Cut("the request timed out (the server's --timeout)", "timeout") from None
            if item is None:
                return
            if isinstance(item, Cut):
                raise item
            self.queued -= len(item)
            yield item

    async def feed(self, text: str = "", flush: bool = False, finish: bool = False) -> None:
        """More text for the replica that speaks the utterance; if that replica is lost, the chunks say so."""
        call = asyncio.ensure_future(self.handle.feed.remote(Pin(self.replica), self.ticket, text, flush, finish))
        await asyncio.wait({call, self.reader}, return_when=asyncio.FIRST_COMPLETED)
        if not call.done():
            call.cancel()
            return
        if call.exception() is not None:  # the replica went while it took the text
            return
        refusal = call.result()
        if refusal is not None and refusal.kind != "Lost":
            raise raised(refusal)

    def cancel(self) -> None:
        """Stop it: Ray cancels the replica's call, whose job is then cancelled there; a no-op once it ended."""
        if not self.reader.done():
            self.events.cancel()
            self.reader.cancel()

    @property
    def finished(self) -> bool:
        return self.reader.done()
