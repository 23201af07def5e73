"""The engine seam, and the one thread that owns this process's engine.

The routes (app.py, text_stream.py, voice_routes.py) reach an engine through these calls and nothing else; EngineThread
implements them for one engine in this process, runtime/cluster/ingress.py for engines in Ray Serve replicas:

  ready, failure              a threading.Event set once the engine is loaded and warmed; why it cannot serve, or None
  spec                        the engine's EngineSpec (backend, slots, max_prompt, max_seq): prompts are checked on it
  capacity                    requests the engine takes at once: its queue and its slots
  no_encoder                  why reference audio cannot be encoded here, or None
  encode(audio)               awaitable: reference audio → codes
  submit(order, limit, on_overflow)  awaitable: the order's Job, once the engine took it; raises QueueFull, or a
                              HiggsError when the order's text or voice does not fit the engine
  health()                    awaitable, once ready: /health's (status code, body)
  metrics, exposition()       the registry the routes record into; awaitable: /metrics' text
  start(), stop(), on_failure the app's lifespan; on_failure() is called once the engine cannot serve any more
A Job (LocalJob here) is one request in flight: chunks(deadline), started(deadline), cancel(), feed(text, flush,
finish), and what its answer reports: said, bounds, total_rows, prompt_tokens, input_tokens, submitted_at, replica.

The engine thread opens and warms the engine, encodes reference audio between decode steps, and runs the scheduler's
loop, sleeping on the scheduler's wakeup event when there is nothing to do. Other threads hand it work with call().
"""

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from functools import partial

import numpy as np
from prometheus_client import generate_latest
from starlette.concurrency import run_in_threadpool

from higgs_trt.runtime.audio import encode_reference
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.longform import Reference, Script, plan_text
from higgs_trt.runtime.prompt import build_prompt
from higgs_trt.runtime.request import request_for
from higgs_trt.runtime.scheduler import Scheduler, freeze_heap
from higgs_trt.runtime.wav import NON_FINITE

from .audio_queue import AudioQueue
from .limits import Limits
from .metrics import Metrics
from .voices import Voice, prepare_voices

log = logging.getLogger("uvicorn.error")  # uvicorn's logger for everything but access lines: one log, one format
WARMUP_TEXT = "Hello."
INLINE_PLAN_CHARS = 512  # longer texts are cut into segments in a worker thread


@dataclass(frozen=True)
class EngineSpec:
    """What the routes need to know of an engine: the prompt checks run against max_prompt and max_seq."""

    name: str
    max_batch: int
    max_prompt: int
    max_seq: int

    @classmethod
    def of(cls, engine) -> "EngineSpec":
        return cls(engine.name, engine.max_batch, engine.max_prompt, engine.max_seq)


@dataclass(frozen=True)
class Order:
    """A speech request as an engine takes it (sent whole to a replica in a cluster)."""

    text: str | None  # None: the text streams in (Job.feed)
    voice: Reference
    cast: dict[str, Reference]  # dialogue: speaker tag → voice
    sampling: Sampling
    max_new_tokens: int
    limits: Limits
    seconds: float  # left until the request's deadline
    fixed_rows: bool = False  # benchmarks: exactly max_new_tokens rows
    affinity: str | None = None  # a cluster's: its voice, so that one replica's prefix cache keeps it


class LocalJob:
    """A request in this process's scheduler, as the routes see it."""

    replica = None

    def __init__(self, scheduler: Scheduler, request, script: Script | None, stream: AudioQueue, input_tokens: int):
        self.scheduler, self.request, self.script, self.stream = scheduler, request, script, stream
        self.input_tokens = input_tokens  # the first prompt's
        self.submitted_at = request.submitted_at

    async def started(self, deadline: float) -> None:
        """Its stream runs from submission on: nothing can lose it before its first chunk."""

    def chunks(self, deadline: float):
        return self.stream.chunks(self.request, deadline)

    async def feed(self, text: str = "", flush: bool = False, finish: bool = False) -> None:
        self.scheduler.feed_text(self.request, text, flush, finish)

    def cancel(self) -> None:
        """Stop it, however its body ended (the loop frees its slot at its next step); a no-op once finished."""
        if not self.request.finished:
            self.stream.stopped = self.stream.stopped or "cancelled"
            self.scheduler.cancel(self.request)

    @property
    def said(self) -> list[str]:
        return self.script.said if self.script is not None else []

    @property
    def bounds(self) -> list[int]:
        return self.request.stream.bounds

    @property
    def total_rows(self) -> int:
        return self.request.stream.total_rows

    @property
    def prompt_tokens(self) -> int:
        return self.script.prompt_tokens if self.script is not None else self.input_tokens


class EngineThread(threading.Thread):
    """Opens the engine, then runs the scheduler loop and the jobs handed to it, all on this one thread."""

    def __init__(self, open_engine, open_encoder, tokenizer, voices: dict[str, Voice], max_queue: int,
                 stream_plan=None, lanes: int | None = None, realtime: bool = False):
        super().__init__(name="higgs-engine", daemon=True)
        self.open_engine, self.open_encoder, self.tokenizer, self.voices = open_engine, open_encoder, tokenizer, voices
        self.max_queue, self.lanes, self.realtime = max_queue, lanes, realtime  # the scheduler's (scheduler.py)
        self.stream_plan = stream_plan  # the codec's strides → the chunks' windows (None: exact, 8 frames then 25)
        self.engine = self.scheduler = self.encoder = self.spec = None
        self.no_encoder: str | None = None  # why reference audio cannot be encoded
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.failure: str | None = None
        self.stopping = False
        self.on_failure = lambda: None
        self.metrics = Metrics(self)

    def run(self) -> None:
        try:
            self._start()
        except HiggsError as e:
            self._fail(str(e))
            return
        except Exception as e:  # anything else a backend raises while loading
            self._fail(f"{type(e).__name__}: {e}", e)
            return
        log.info("engine ready: %s backend, %d slots", self.engine.name, self.engine.max_batch)
        self.ready.set()
        wakeup = self.scheduler.wakeup
        while not self.stopping:
            self._run_jobs()
            try:
                busy = self.scheduler.step()
            except Exception as e:
                self.ready.clear()
                self.scheduler.fail(f"engine failure: {type(e).__name__}: {e}")
                self._fail(f"engine failure: {type(e).__name__}: {e}", e)
                return
            if not busy:
                wakeup.wait()
                wakeup.clear()
        self.scheduler.fail("the server stopped")

    def _start(self) -> None:
        self.engine = self.open_engine()
        self.spec = EngineSpec.of(self.engine)
        try:
            self.encoder = self.open_encoder()
        except HiggsError as e:
            self.no_encoder = str(e)
        encode = partial(encode_reference, encoder=self.encoder) if self.encoder is not None else None
        prepare_voices(self.voices, encode, self.no_encoder, self.spec, self.tokenizer)
        plan = self.stream_plan(self.engine.codec_strides) if self.stream_plan is not None else None
        self.scheduler = Scheduler(self.engine, plan, max_queue=self.max_queue, lanes=self.lanes,
                                   realtime=self.realtime)
        prompt = build_prompt(self.tokenizer, WARMUP_TEXT)
        warm = self.scheduler.submit(request_for(self.engine, prompt, Sampling(1.0), hard_cap=16))
        self.scheduler.run()
        if warm.error:
            raise HiggsError(f"the warm-up request failed: {warm.error}")
        if not np.isfinite(warm.audio()).all():
            raise HiggsError(f"the warm-up request decoded {NON_FINITE}")
        freeze_heap()  # what the warm-up compiled and allocated stays for good, too

    def _fail(self, message: str, error: Exception | None = None) -> None:
        """Not serving: pending jobs fail, and the server is told to exit (the CLI then prints `message`)."""
        if error is not None:  # a bug or a broken engine: the traceback is for whoever debugs it
            log.error("%s", message, exc_info=error)
        self.failure = message
        while not self.jobs.empty():
            self.jobs.get()[0].set_exception(HiggsError(message))
        self.on_failure()

    def call(self, fn, *args) -> asyncio.Future:
        """Run fn(*args) on the engine thread between two steps (awaitable from the event loop)."""
        future = concurrent.futures.Future()
        self.jobs.put((future, fn, args))
        self.scheduler.wakeup.set()
        return asyncio.wrap_future(future)

    def _run_jobs(self) -> None:
        while not self.jobs.empty():
            future, fn, args = self.jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as e:
                    future.set_exception(e)

    # ---- the seam ----------------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.max_queue + self.spec.max_batch

    async def encode(self, audio) -> np.ndarray:
        return await self.call(encode_reference, audio, self.encoder)

    async def submit(self, order: Order, limit: int | None = None, on_overflow=None) -> LocalJob:
        """The order planned (its segments), checked against the engine and queued; `limit` and `on_overflow`: the
        audio a client may leave unread, and what happens past it (AudioQueue)."""
        history = order.limits.history
        if order.text is None:
            prompt, script = None, Script(self.tokenizer, order.voice, order.cast or None, self.spec.max_prompt, history)
        else:
            plan = partial(plan_text, self.tokenizer, order.text, order.voice, order.cast, self.spec.max_prompt, history)
            prompt, script = plan() if len(order.text) <= INLINE_PLAN_CHARS else await run_in_threadpool(plan)
        stream = AudioQueue(asyncio.get_running_loop(), self.metrics, limit, on_overflow)
        request = request_for(self.engine, prompt, order.sampling, hard_cap=order.max_new_tokens, script=script,
                              max_seconds=order.limits.max_seconds, on_chunk=stream.chunk, on_done=stream.done)
        request.fixed_rows = order.fixed_rows
        self.scheduler.submit(request)
        return LocalJob(self.scheduler, request, script, stream, len(prompt) if prompt is not None else 0)

    async def health(self) -> tuple[int, dict]:
        return 200, {"status": "ok", "backend": self.spec.name, "slots": self.spec.max_batch}

    async def exposition(self) -> bytes:
        return generate_latest(self.metrics.registry)

    def stop(self) -> None:
        self.stopping = True
        if self.scheduler is not None:
            self.scheduler.wakeup.set()
        self.join(timeout=30)
