"""The one thread that touches the engine: it opens and warms it, encodes reference audio, and runs the scheduler's
loop, sleeping on the scheduler's wakeup event when there is nothing to do. Other threads hand it work with call()."""

import asyncio
import concurrent.futures
import logging
import queue
import threading

import numpy as np

from higgs_trt.runtime.audio import encode_reference
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.prompt import build_prompt
from higgs_trt.runtime.scheduler import Scheduler, freeze_heap, request_for
from higgs_trt.runtime.wav import NON_FINITE

from .voices import Voice

log = logging.getLogger("uvicorn.error")  # uvicorn's logger for everything but access lines: one log, one format
WARMUP_TEXT = "Hello."


class EngineThread(threading.Thread):
    """Opens the engine, then runs the scheduler loop and the jobs handed to it, all on this one thread."""

    def __init__(self, open_engine, open_encoder, tokenizer, voices: dict[str, Voice], max_queue: int,
                 stream_plan=None):
        super().__init__(name="higgs-engine", daemon=True)
        self.open_engine, self.open_encoder, self.tokenizer, self.voices = open_engine, open_encoder, tokenizer, voices
        self.max_queue = max_queue
        self.stream_plan = stream_plan  # the codec's strides → the chunks' windows (None: exact, 8 frames then 25)
        self.engine = self.scheduler = self.encoder = None
        self.no_encoder: str | None = None  # why reference audio cannot be encoded
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.failure: str | None = None
        self.stopping = False
        self.on_failure = lambda: None

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
        try:
            self.encoder = self.open_encoder()
        except HiggsError as e:
            self.no_encoder = str(e)
        for name, voice in self.voices.items():
            if voice.audio is not None:
                if self.encoder is None:
                    raise HiggsError(f"voice {name!r} is a recording, but: {self.no_encoder}")
                voice.codes, voice.audio = encode_reference(voice.audio, self.encoder), None
            if voice.codes is not None:  # a voice no request could use is refused now, not at each request
                try:
                    request_for(self.engine, build_prompt(self.tokenizer, WARMUP_TEXT, voice.codes, voice.text),
                                Sampling(1.0))
                except HiggsError as e:
                    raise HiggsError(f"voice {name!r} does not fit this engine: {e}") from None
        plan = self.stream_plan(self.engine.codec_strides) if self.stream_plan is not None else None
        self.scheduler = Scheduler(self.engine, plan, max_queue=self.max_queue)
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

    def stop(self) -> None:
        self.stopping = True
        if self.scheduler is not None:
            self.scheduler.wakeup.set()
        self.join(timeout=30)
