"""`higgs-trt serve`: OpenAI's speech API over the in-flight scheduler (runtime/scheduler.py).

  POST /v1/audio/speech   a body as runtime/speech_api.py reads it → audio, streamed as it is decoded
  GET  /v1/models         the one model served;  GET /v1/audio/voices: `default` and --voices DIR's names
  GET  /health            200 once the engine is loaded and warmed; 503 while loading, shutting down, or failed
  GET  /metrics           Prometheus text: time to first audio, queue depth, busy slots, audio seconds, outcomes

Threads. uvicorn's event loop runs the HTTP side. One engine thread owns everything that touches the engine: it
opens and warms it, encodes reference audio, and runs `scheduler.step()`, sleeping on the scheduler's wakeup event
when there is nothing to do. A handler submits its request (thread-safe) and gets the audio through an asyncio.Queue
that the engine thread feeds with `call_soon_threadsafe`. When a response body stops early — the client went away
(Starlette cancels the body), the request timed out, the server is shutting down — its request is cancelled, and the
loop frees the slot at its next step.

Formats. wav and pcm stream chunk by chunk (a streamed wav's RIFF and data sizes are 0xFFFFFFFF); flac, mp3 and opus
are written whole by soundfile once the utterance is complete (a FLAC's STREAMINFO carries the total length and an
MD5 that libsndfile writes at the end, into a seekable file). SSE carries wav or pcm.

Failures after the response has started (a timeout, an engine failure, audio that came out NaN) cannot change its
status: a wav or pcm body is cut (the connection closes before the final chunk, so the client sees an incomplete
response), SSE sends a `speech.audio.error` event. flac, mp3 and opus start only once their file is complete, so
there the same failures are a 504 or a 500. SIGTERM: new requests get 503, those in flight finish (each within
--timeout), exit 0.
"""

import asyncio
import base64
import concurrent.futures
import io
import json
import logging
import queue
import re
import resource
import signal
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .audio import ReferenceAudio, encode_reference, load_reference_audio, reference_audio_from_bytes
from .decoding import Sampling
from .errors import HiggsError
from .prompt import build_prompt, check_text, load_reference_codes
from .scheduler import PHASES, QueueFull, Scheduler, freeze_heap, request_for
from .sinks import wav_header
from .speech_api import ENCODED, MODEL_ID, ApiError, Speech, field, parse_speech
from .wav import NON_FINITE, SAMPLE_RATE, pcm16

log = logging.getLogger("uvicorn.error")  # uvicorn's logger for everything but access lines: one log, one format

MAX_BODY_BYTES = 16 << 20  # a 30 s reference as base64 fits (48 kHz stereo float32: 15.4 MB)
# Bodies up to this size are parsed on the event loop; larger ones (reference audio in base64) in a worker thread. The
# hop to a worker and back cost each request of a wave its turn at the GIL twice: mean admission 9.4-12.3 ms against
# 0.2-0.3 ms inline (tiny ORT engine, 64 clients at once, this repository's 2-core CI machine); on the H200 host a
# 64-stream wave's admission fell from ~29 ms to 0.2-0.5 ms.
INLINE_PARSE_BYTES = 64 << 10
# Requests whose body passed INLINE_PARSE_BYTES (reference audio) being read, decoded and encoded at once; past this a
# new one gets 429. The engine thread encodes them one at a time anyway, so more would only hold memory (~50 MB each).
LARGE_BODIES_AT_ONCE = 8
# A new connection must complete its request line and headers within this, or --timeout if shorter (uvicorn times
# out idle keep-alive connections, but not a client that stalls before its first request: it would hold a
# descriptor for ever).
HEADER_SECONDS = 10.0
# Every connection is a file descriptor. Past (the open-file limit − this) connections, a new one is answered 503 and
# closed at once, so a flood of clients cannot take the descriptors the engine, the logs and reference files need;
# this many also covers one event-loop tick's accepts.
DESCRIPTORS_KEPT = 128
WARMUP_TEXT = "Hello."
# The engine thread lets go of the GIL at every kernel launch, graph replay and event wait and must win it back from
# the event loop's thread each time, which under the interpreter's default switch interval (5 ms) can hold it that
# long. H200 host, BF16, `bench serve` over loopback, a fresh server each: 8 streams 39.6 -> 92.8 audio-s/s, mean
# first audio 1216 -> 125 ms; 64 streams 332.5 -> 383.5 audio-s/s, 418 -> 355 ms (0.1 ms: 406.7, 308 ms; one run).
SWITCH_INTERVAL = 0.0005
TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


# ---- voices ----------------------------------------------------------------------------------------------------

VOICE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


@dataclass
class Voice:
    codes: np.ndarray | None = None  # reference codes [T, 8]; None for `default` (zero-shot)
    text: str | None = None  # transcript of the reference
    audio: ReferenceAudio | None = None  # a recording, encoded into `codes` when the engine starts


def load_voices(directory: Path | None, tokenizer) -> dict[str, Voice]:
    """`default`, and one voice per NAME in `directory`: NAME.wav|.flac|.ogg|.mp3 (a 1–30 s recording) or NAME.npy
    (codes [T,8], as `encode-audio` writes them), with an optional NAME.txt transcript. Anything else is refused."""
    voices = {"default": Voice()}
    if directory is None:
        return voices
    if not directory.is_dir():
        raise HiggsError(f"--voices {directory}: not a directory")
    files: dict[str, list[Path]] = {}
    for path in sorted(directory.iterdir()):
        if path.name.startswith("."):
            continue
        if not path.is_file() or path.suffix.lower() not in (*AUDIO_SUFFIXES, ".npy", ".txt"):
            raise HiggsError(f"{path}: not a voice file (NAME{'|'.join(AUDIO_SUFFIXES)} or NAME.npy, and an optional "
                             "NAME.txt transcript)")
        if not VOICE_NAME.fullmatch(path.stem) or path.stem == "default":
            raise HiggsError(f"{path}: a voice name is 1–64 letters, digits, '_' or '-', and not 'default'")
        files.setdefault(path.stem, []).append(path)
    for name, paths in files.items():
        refs = [p for p in paths if p.suffix.lower() != ".txt"]
        if len(refs) != 1:
            raise HiggsError(f"{directory}: voice {name!r} needs exactly one reference (a recording or codes .npy), "
                             f"found {len(refs)}")
        voice = Voice()
        if refs[0].suffix.lower() == ".npy":
            voice.codes = load_reference_codes(refs[0])
        else:
            voice.audio = load_reference_audio(refs[0])
        transcript = next((p for p in paths if p.suffix.lower() == ".txt"), None)
        if transcript is not None:
            try:
                text = transcript.read_text(encoding="utf-8").strip()
            except UnicodeDecodeError:
                raise HiggsError(f"{transcript}: not UTF-8 text") from None
            tokenizer.encode(check_text(text, str(transcript)), str(transcript))
            voice.text = text
        voices[name] = voice
    return voices


# ---- the engine thread -----------------------------------------------------------------------------------------

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


# ---- metrics ---------------------------------------------------------------------------------------------------

class Metrics:
    def __init__(self, engine: EngineThread):
        r = self.registry = CollectorRegistry()
        self.ttfa = Histogram("higgs_time_to_first_audio_seconds", "From admission to the first audio chunk (server "
                              "side)", buckets=TTFA_BUCKETS, registry=r)
        self.audio = Counter("higgs_audio_seconds", "Seconds of audio decoded for clients", registry=r)
        self.requests = Counter("higgs_requests", "Admitted requests by outcome (completed, failed, timeout, "
                                "cancelled: the client went away)", ["outcome"], registry=r)
        self.errors = Counter("higgs_errors", "Requests refused before admission, by error code", ["code"], registry=r)
        self.queue_wait = Histogram("higgs_queue_wait_seconds", "From admission to the prefill call that gives the "
                                    "request a slot", buckets=TTFA_BUCKETS, registry=r)
        self.admission = Histogram("higgs_admission_seconds", "From the request's handler starting to its admission "
                                   "(reading and parsing the body, building the prompt, encoding reference audio)",
                                   buckets=TTFA_BUCKETS, registry=r)

        def scheduler(attribute):
            return lambda: getattr(engine.scheduler, attribute) if engine.scheduler is not None else 0

        Gauge("higgs_queue_depth", "Requests waiting for a slot", registry=r).set_function(scheduler("waiting"))
        Gauge("higgs_busy_slots", "Slots decoding a request", registry=r).set_function(scheduler("busy"))
        Gauge("higgs_slots", "Engine slots", registry=r).set_function(
            lambda: engine.engine.max_batch if engine.engine is not None else 0)
        # where the engine thread's time goes, since start (warm-up included): the phases of the scheduler's loop
        # (decode holds the steps and the waits for them), and how many prefill calls the joins took
        loop = Gauge("higgs_engine_loop_seconds", "Seconds the engine thread spent in each phase of the scheduler's "
                     "loop since start: prefill, decode (steps and waiting for them), codec, other", ["phase"],
                     registry=r)
        for phase in PHASES:
            loop.labels(phase).set_function(
                lambda p=phase: engine.scheduler.seconds[p] if engine.scheduler is not None else 0.0)
        Gauge("higgs_prefill_calls", "Prefill calls since start (each one or more joining requests)",
              registry=r).set_function(scheduler("prefill_calls"))
        Gauge("higgs_codec_calls", "Codec calls since start (each one or more windows of one length)",
              registry=r).set_function(scheduler("codec_calls"))
        Gauge("higgs_codec_windows", "Codec windows decoded since start", registry=r).set_function(
            scheduler("codec_windows"))


# ---- one request's audio, from the engine thread to the response body ------------------------------------------

class Cut(Exception):
    """The request stopped before its audio was complete (timeout, engine failure)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class AudioQueue:
    """The request's callbacks (called on the engine thread) → an asyncio.Queue the response body reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: Metrics):
        self.loop, self.metrics = loop, metrics
        self.items: asyncio.Queue = asyncio.Queue()
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
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

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
            yield item
        if request.error:
            raise Cut(request.error, "engine_error")


# ---- the service -----------------------------------------------------------------------------------------------

class SpeechService:
    def __init__(self, engine: EngineThread, tokenizer, voices: dict[str, Voice], ref_dir: Path | None,
                 timeout: float, max_body: int = MAX_BODY_BYTES, model: str = MODEL_ID, fixed_length: bool = False):
        self.engine, self.tokenizer, self.voices, self.ref_dir = engine, tokenizer, voices, ref_dir
        self.fixed_length = fixed_length  # benchmarks: every request decodes exactly max_new_tokens rows
        self.timeout, self.max_body, self.model = timeout, max_body, model
        self.metrics = Metrics(engine)
        self.created = int(time.time())
        self.draining = False
        self.admitting = 0  # requests between arrival and submission (reading, parsing, encoding reference audio)
        self.large_bodies = 0

    # ---- routes ----

    async def health(self, request: Request) -> Response:
        if self.engine.failure:
            return JSONResponse({"status": "failed", "error": self.engine.failure}, 503)
        if self.draining:
            return JSONResponse({"status": "shutting down"}, 503)
        if not self.engine.ready.is_set():
            return JSONResponse({"status": "loading"}, 503)
        return JSONResponse({"status": "ok", "backend": self.engine.engine.name, "slots": self.engine.engine.max_batch})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "higgs-trt"}]})

    async def voice_names(self, request: Request) -> Response:
        return JSONResponse({"voices": list(self.voices)})

    async def metrics_text(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def speech(self, request: Request) -> Response:
        arrived, started = asyncio.get_running_loop().time(), time.perf_counter()
        try:
            job, stream, speech, input_tokens = await self._admit(request, arrived + self.timeout)
        except ApiError as e:
            self.metrics.errors.labels(e.code).inc()
            return JSONResponse(e.body(), e.status, headers=e.headers)
        except ClientDisconnect:  # it left while sending its request: nobody to answer
            self.metrics.errors.labels("client_gone").inc()
            return Response(status_code=400)
        self.metrics.admission.observe(job.submitted_at - started)
        deadline = arrived + self.timeout
        stop = partial(self._stop, job, stream)
        if speech.sse:
            return AudioResponse(self._sse(stream, job, speech, deadline, input_tokens), stop,
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        if speech.response_format in ENCODED:
            return await self._whole_file(request, stream, job, speech, deadline)
        raw = {"X-Sample-Rate": str(SAMPLE_RATE), "X-Channels": "1", "X-Bit-Depth": "16"}
        media = "audio/wav" if speech.response_format == "wav" else "audio/pcm"
        return AudioResponse(self._audio(stream, job, speech, deadline), stop, media_type=media, headers=raw)

    async def _admit(self, request: Request, deadline: float):
        """Parse, check, build the prompt, submit: every refusal is an ApiError."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, "shutting_down", "server_error")
        if not self.engine.ready.is_set():
            why = f"the engine failed: {self.engine.failure}" if self.engine.failure else "the engine is loading"
            raise ApiError(503, why, None, "not_ready", "server_error", {"Retry-After": "5"})
        if self.admitting >= self.engine.max_queue + self.engine.engine.max_batch:  # what the queue and slots take
            raise busy(f"{self.admitting} requests are being received")
        self.admitting += 1
        large = False
        try:
            body, large = await self._body(request, deadline)
            if len(body) <= INLINE_PARSE_BYTES:
                speech = parse_speech(body, self.model, self.voices, self.ref_dir)
            else:
                speech = await run_in_threadpool(parse_speech, body, self.model, self.voices, self.ref_dir)
            del body  # up to 16 MB, not needed while its reference audio is decoded and encoded
            prompt = await self._prompt(speech)
        finally:
            self.admitting -= 1
            self.large_bodies -= large
        stream = AudioQueue(asyncio.get_running_loop(), self.metrics)
        reference = ("voice" if speech.voice != "default" else "ref_audio" if speech.ref_audio is not None
                     else "ref_codes" if speech.ref_codes is not None else None)
        with field(reference or "input"):  # a prompt too long for the engine: its reference is named, if it has one
            job = request_for(self.engine.engine, prompt, speech.sampling, hard_cap=speech.max_new_tokens,
                              on_chunk=stream.chunk, on_done=stream.done)
        job.fixed_rows = self.fixed_length
        try:
            self.engine.scheduler.submit(job)
        except QueueFull as e:
            raise busy(str(e)) from None
        return job, stream, speech, len(prompt)

    async def _body(self, request: Request, deadline: float) -> tuple[bytes, bool]:
        """`_read_body`, refused when the body has not arrived by the request's deadline or the server starts
        draining (a client that stalls mid-body must not hold its connection, nor a shutdown, past them)."""
        reading = asyncio.ensure_future(self._read_body(request))
        loop = asyncio.get_running_loop()
        try:
            while not reading.done():
                wait = min(deadline - loop.time(), 1.0)  # a drain is noticed within a second
                if self.draining:
                    raise ApiError(503, "the server is shutting down", None, "shutting_down", "server_error")
                if wait <= 0:
                    raise ApiError(408, f"the request body did not arrive within {self.timeout:g} s (the server's "
                                   "--timeout)", None, "request_timeout")
                await asyncio.wait({reading}, timeout=wait)
            return reading.result()
        finally:
            reading.cancel()  # a no-op once it is done

    async def _read_body(self, request: Request) -> tuple[bytes, bool]:
        """The whole body and whether it took one of the LARGE_BODIES_AT_ONCE places (the caller gives it back).
        Refused past the size cap or the places, read to its end all the same, so the client gets the answer, not a
        reset."""
        parts, size, large, refused = [], 0, False, None
        try:
            async for part in request.stream():
                size += len(part)
                if size > INLINE_PARSE_BYTES and not large and refused is None:
                    if self.large_bodies < LARGE_BODIES_AT_ONCE:
                        large = True
                        self.large_bodies += 1
                    else:
                        refused = busy(f"{LARGE_BODIES_AT_ONCE} requests with reference audio are being received")
                if size <= self.max_body and refused is None:
                    parts.append(part)
                else:
                    parts.clear()
            if size > self.max_body:
                raise ApiError(413, f"the request body is {size} bytes; at most {self.max_body}", None,
                               "request_too_large")
            if refused is not None:
                raise refused
        except BaseException:
            self.large_bodies -= large
            raise
        return b"".join(parts), large

    async def _prompt(self, speech: Speech):
        voice = self.voices[speech.voice]
        codes, text = (voice.codes, voice.text) if speech.voice != "default" else (speech.ref_codes, speech.ref_text)
        if speech.ref_audio is not None:
            if self.engine.encoder is None:
                raise ApiError(400, f"ref_audio cannot be encoded here: {self.engine.no_encoder}", "ref_audio",
                               "unsupported_parameter")
            if isinstance(speech.ref_audio, Path):  # errors name it below --ref-dir: the server's paths stay its own
                name = speech.ref_audio.relative_to(self.ref_dir.resolve())
                read = partial(load_reference_audio, what=f"ref_audio file://{name}")
            else:
                read = partial(reference_audio_from_bytes, what="ref_audio")
            with field("ref_audio"):
                audio = await run_in_threadpool(read, speech.ref_audio)
                codes = await self.engine.call(encode_reference, audio, self.engine.encoder)
        if speech.ref_text is not None:
            with field("ref_text"):
                self.tokenizer.encode(speech.ref_text, "ref_text")
        with field("input"):
            self.tokenizer.encode(speech.text, "input")  # its errors name the field; build_prompt's say "text"
            return build_prompt(self.tokenizer, speech.text, codes, text)

    # ---- response bodies (AudioResponse cancels the request when one stops early) ----

    def _stop(self, job, stream: AudioQueue) -> None:
        if not job.finished:
            stream.stopped = stream.stopped or "cancelled"
            self.engine.scheduler.cancel(job)

    async def _audio(self, stream: AudioQueue, job, speech: Speech, deadline: float):
        if speech.response_format == "wav":
            yield wav_header(None)
        async for samples in stream.chunks(job, deadline):
            yield pcm16(samples)[0]

    async def _whole_file(self, request: Request, stream: AudioQueue, job, speech: Speech, deadline: float):
        """flac / mp3 / opus: nothing goes out before the file is complete, so a timeout or an engine failure is still
        an error status; a client that leaves cancels its request, as a streamed body's does."""
        async def collect() -> np.ndarray:
            chunks = [samples async for samples in stream.chunks(job, deadline)]
            return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)

        async def disconnect() -> None:  # the body is read: the next message is the client leaving
            while (await request.receive())["type"] != "http.disconnect":
                pass

        decoding, leaving = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnect())
        try:
            await asyncio.wait({decoding, leaving}, return_when=asyncio.FIRST_COMPLETED)
            if not decoding.done():
                return Response(status_code=400)  # nobody to answer
            audio = decoding.result()
        except Cut as e:
            error = ApiError(504 if e.code == "timeout" else 500, str(e), None, e.code, "server_error")
            return JSONResponse(error.body(), error.status)
        finally:
            decoding.cancel()
            leaving.cancel()
            self._stop(job, stream)
        data = await run_in_threadpool(encode_file, audio, speech.response_format)
        return Response(data, media_type=ENCODED[speech.response_format][2])

    async def _sse(self, stream: AudioQueue, job, speech: Speech, deadline: float, input_tokens: int):
        def event(data: dict) -> bytes:
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        def delta(data: bytes) -> bytes:
            return event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

        header = wav_header(None) if speech.response_format == "wav" else b""
        try:
            async for samples in stream.chunks(job, deadline):
                yield delta(header + pcm16(samples)[0])
                header = b""
        except Cut as e:
            yield event({"type": "speech.audio.error",
                         "error": {"message": str(e), "type": "server_error", "param": None, "code": e.code}})
            return
        if header:  # no audio at all: a wav is still a wav
            yield delta(header)
        rows = len(job.utterance.rows)
        yield event({"type": "speech.audio.done",
                     "usage": {"input_tokens": input_tokens, "output_tokens": rows, "total_tokens": input_tokens + rows}})


class AudioResponse(StreamingResponse):
    """A streamed body that calls `stop` however it ends: complete, client gone (Starlette cancels the body the
    moment the disconnect arrives), timed out, failed, server shutting down — even before its first byte."""

    def __init__(self, body, stop, **kwargs):
        super().__init__(body, **kwargs)
        self.stop = stop

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except Cut as e:  # returning without the final chunk: uvicorn closes the connection, the body stays incomplete
            log.warning("response cut: %s", e)
        finally:
            self.stop()


def encode_file(audio: np.ndarray, fmt: str) -> bytes:
    """A whole flac / mp3 / opus file of the 16-bit samples (the same samples wav and pcm carry). An utterance without
    audio (ended at its first rows) is one silent sample: libsndfile writes no decodable empty flac, mp3 or opus."""
    import soundfile

    kind, subtype, _ = ENCODED[fmt]
    audio = audio if len(audio) else np.zeros(1, np.float32)
    out = io.BytesIO()
    soundfile.write(out, np.frombuffer(pcm16(audio)[0], "<i2"), SAMPLE_RATE, format=kind, subtype=subtype)
    return out.getvalue()


# ---- the app and its server ------------------------------------------------------------------------------------

def create_app(service: SpeechService) -> Starlette:
    @asynccontextmanager
    async def lifespan(app):
        service.engine.start()
        try:
            yield
        finally:
            service.engine.stop()

    async def http_error(request: Request, e: HTTPException) -> Response:  # 404, 405 in OpenAI's shape
        error = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", None,
                         "not_found" if e.status_code == 404 else "invalid_request")
        return JSONResponse(error.body(), e.status_code, headers=e.headers)

    routes = [Route("/v1/audio/speech", service.speech, methods=["POST"]),
              Route("/v1/models", service.models), Route("/v1/audio/voices", service.voice_names),
              Route("/health", service.health), Route("/metrics", service.metrics_text)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.router.redirect_slashes = False  # its 307 is built from the client's Host header, and says http behind TLS
    return app


def busy(why: str) -> ApiError:
    """429: no room for the request now (Retry-After: 1)."""
    return ApiError(429, f"{why}; retry shortly", None, "queue_full", "rate_limit_error", {"Retry-After": "1"})


def raise_open_file_limit() -> int:
    """The soft limit on open files raised to the hard one (each connection takes one), at most 2**20; the limit
    in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError):
            pass
    return want if soft == resource.RLIM_INFINITY else soft


def connection_protocol(header_seconds: float, max_connections: int):
    """uvicorn's h11 protocol, (a) closing a connection whose first request line and headers have not arrived within
    `header_seconds` (uvicorn's own timeout covers only idle keep-alive connections), (b) answering 503 and closing
    any connection past `max_connections` open at once, (c) keeping the keep-alive timeout for a connection whose
    request body arrives after its answer."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    error = ApiError(503, f"the server has {max_connections} connections open; retry shortly", None,
                     "too_many_connections", "server_error")
    content = json.dumps(error.body()).encode()
    overloaded = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(content), content))

    class Connection(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(overloaded)
                transport.close()
                return
            self.loop.call_later(header_seconds, self._drop_before_first_request)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # uvicorn arms its keep-alive timeout when a response completes and cancels it at every read: the rest of
            # a body that arrives after an early answer (a 405, a 429) left the connection idle with no timeout at all
            if (self.cycle is not None and self.cycle.response_complete and self.timeout_keep_alive_task is None
                    and not self.transport.is_closing()):
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

        def _drop_before_first_request(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return Connection


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, limit: int) -> None:
    """Out of descriptors anyway (a burst of connections inside one tick), asyncio logs each failed accept with a
    traceback, thousands a second while it lasts: one warning line every 10 s instead."""
    last = -float("inf")

    def handler(loop, context: dict) -> None:
        nonlocal last
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
        elif loop.time() - last >= 10:
            last = loop.time()
            log.warning("cannot accept connections: %s (open-file limit %d); retrying every second",
                        context.get("exception"), limit)

    loop.set_exception_handler(handler)


def serve(service: SpeechService, host: str, port: int) -> None:
    """Serve until SIGTERM / SIGINT (then drain and return) or an engine failure (HiggsError)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            quiet_accept_errors(asyncio.get_running_loop(), limit)
            await super().startup(sockets)

        def handle_exit(self, sig, frame):
            service.draining = True  # new requests get 503 until the listening socket is closed
            super().handle_exit(sig, frame)

    # Bound here, before anything loads, so a taken port is one clear error (uvicorn would log it and exit).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise HiggsError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    limit = raise_open_file_limit()
    protocol = connection_protocol(min(HEADER_SECONDS, service.timeout), max(limit - DESCRIPTORS_KEPT, limit // 2))
    # In-flight requests end by their own --timeout; the grace period only adds time for the last bytes to go out.
    config = uvicorn.Config(create_app(service), http=protocol, timeout_graceful_shutdown=service.timeout + 5,
                            log_level="info")
    log.info("listening on http://%s:%d (/health turns 200 once the engine is loaded and warmed)", host,
             sock.getsockname()[1])
    server = Server(config)
    service.engine.on_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn raises the signal again after its graceful shutdown, under the handler it found: make that one a no-op,
    # so a drained SIGTERM ends with exit code 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        server.run(sockets=[sock])
    finally:
        sys.setswitchinterval(interval)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if service.engine.failure:
        raise HiggsError(service.engine.failure)
