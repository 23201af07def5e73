"""`higgs-trt serve`'s HTTP side: OpenAI's speech API as Starlette routes over the engine thread.

  POST /v1/audio/speech   a body as speech_api.py reads it → audio, streamed as it is decoded
  WS   /v1/audio/speech/stream  text in as it is written, audio out as each segment is ready (text_stream.py)
  GET  /v1/models         the one model served
  /v1/audio/voices        list, upload, read and delete named voices (voice_routes.py)
  GET  /health            200 once the engine is loaded and warmed; 503 while loading, shutting down, or failed
  GET  /metrics           Prometheus text (metrics.py)
With `serve --api-key`, every route but /health needs the key (auth.py).

The routes reach the engine through the engine seam (engine_thread.py): one engine thread in this process, or Ray
Serve replicas behind `serve --cluster` (runtime/cluster/), the same routes either way. A handler submits its order
and reads the job's audio as it comes. When a response body stops early — the client went away (Starlette cancels the
body), the request timed out, the server is shutting down — its job is cancelled, and the engine frees the slot at its
next step. In a cluster a response carries `X-Higgs-Replica`, the replica that served it, and waits for its first
chunk before it answers, so a replica lost before then is a 503, not a cut body.

Formats. wav and pcm stream chunk by chunk (a streamed wav's RIFF and data sizes are 0xFFFFFFFF); flac, mp3 and opus
are written whole by soundfile once the utterance is complete (a FLAC's STREAMINFO carries the total length and an
MD5 that libsndfile writes at the end, into a seekable file). SSE carries wav or pcm.

Failures after the response has started (a timeout, an engine failure, audio that came out NaN) cannot change its
status: a wav or pcm body is cut (the connection closes before the final chunk, so the client sees an incomplete
response), SSE sends a `speech.audio.error` event. flac, mp3 and opus start only once their file is complete, so
there the same failures are a 504 or a 500.
"""

import asyncio
import base64
import io
import json
import logging
import time
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute

from higgs_trt.runtime.audio import load_reference_audio, reference_audio_from_bytes
from higgs_trt.runtime.longform import Reference
from higgs_trt.runtime.request import QueueFull
from higgs_trt.runtime.sinks import wav_header
from higgs_trt.runtime.wav import SAMPLE_RATE, pcm16

from .audio_queue import Cut
from .auth import BearerAuth
from .engine_thread import Order
from .limits import Limits
from .speech_api import ENCODED, MODEL_ID, ApiError, Speech, field, parse_speech
from .text_stream import speech_stream
from .voice_routes import voice_routes
from .voices import Voice, VoiceStore

log = logging.getLogger("uvicorn.error")

# Bodies up to this size are parsed on the event loop, larger ones (reference audio in base64) in a worker thread:
# the hop to a worker and back costs each request of a wave two turns at the GIL, which dominated admission under load.
INLINE_PARSE_BYTES = 64 << 10
# Requests whose body passed INLINE_PARSE_BYTES (reference audio) being read, decoded and encoded at once; past this a
# new one gets 429. The engine thread encodes them one at a time anyway, so more would only hold memory (~50 MB each).
LARGE_BODIES_AT_ONCE = 8
REPLICA_HEADER = "X-Higgs-Replica"


class SpeechService:
    def __init__(self, engine, tokenizer, store: VoiceStore, ref_dir: Path | None, limits: Limits = Limits(),
                 model: str = MODEL_ID, fixed_length: bool = False, api_key: str | None = None):
        """`engine`: the engine seam (engine_thread.py), an EngineThread or a cluster's ClusterEngine."""
        self.engine, self.tokenizer, self.store, self.ref_dir = engine, tokenizer, store, ref_dir
        self.fixed_length = fixed_length  # benchmarks: every request decodes exactly max_new_tokens rows
        self.limits, self.model, self.api_key = limits, model, api_key
        self.timeout, self.max_body = limits.timeout, limits.max_body
        self.metrics = engine.metrics
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
        status, body = await self.engine.health()
        return JSONResponse(body, status)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "higgs-trt"}]})

    @property
    def voices(self) -> dict[str, Voice]:
        return self.store.voices

    async def metrics_text(self, request: Request) -> Response:
        return Response(await self.engine.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def speech(self, request: Request) -> Response:
        arrived, started = asyncio.get_running_loop().time(), time.perf_counter()
        deadline = arrived + self.timeout
        try:
            job, speech = await self._admit(request, deadline)
        except ApiError as e:
            self.metrics.errors.labels(e.code).inc()
            return JSONResponse(e.body(), e.status, headers=e.headers)
        except ClientDisconnect:  # it left while sending its request: nobody to answer
            self.metrics.errors.labels("client_gone").inc()
            return Response(status_code=400)
        self.metrics.admission.observe(job.submitted_at - started)
        served = {REPLICA_HEADER: job.replica} if job.replica is not None else {}
        if speech.sse:
            return AudioResponse(self._sse(job, speech, deadline), job.cancel, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **served})
        if speech.response_format in ENCODED:
            return await self._whole_file(request, job, speech, deadline, served)
        raw = {"X-Sample-Rate": str(SAMPLE_RATE), "X-Channels": "1", "X-Bit-Depth": "16", **served}
        media = "audio/wav" if speech.response_format == "wav" else "audio/pcm"
        return AudioResponse(self._audio(job, speech, deadline), job.cancel, media_type=media, headers=raw)

    async def _admit(self, request: Request, deadline: float):
        """Parse, check, submit to the engine (which plans the text's segments): every refusal is an ApiError."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, "shutting_down", "server_error")
        if not self.engine.ready.is_set():
            why = f"the engine failed: {self.engine.failure}" if self.engine.failure else "the engine is loading"
            raise ApiError(503, why, None, "not_ready", "server_error", {"Retry-After": "5"})
        if self.admitting >= self.engine.capacity:  # what the queue and slots take
            raise busy(f"{self.admitting} requests are being received")
        self.admitting += 1
        large = False
        try:
            body, large = await self._body(request, deadline)
            parse = partial(parse_speech, body, self.model, self.voices, self.ref_dir, self.limits.max_input_chars)
            speech = parse() if len(body) <= INLINE_PARSE_BYTES else await run_in_threadpool(parse)
            del body, parse  # up to 16 MB, not needed while its reference audio is decoded and encoded
            voice, cast = await self.voice(speech)
            with field("input"):
                self.tokenizer.encode(speech.text, "input")  # its errors name the field; build_prompt's say "text"
            order = self.order(speech, voice, cast, speech.text, deadline - asyncio.get_running_loop().time())
            with field(self.blamed(speech)):  # a prompt too long for the engine: its reference is named, if it has one
                try:
                    job = await self.engine.submit(order)
                except QueueFull as e:
                    raise busy(str(e)) from None
        finally:
            self.admitting -= 1
            self.large_bodies -= large
        await job.started(deadline)
        return job, speech

    def order(self, speech: Speech, voice: Reference, cast: dict[str, Reference], text: str | None,
              seconds: float) -> Order:
        """The engine's order for a request (text None: it streams in)."""
        return Order(text, voice, cast, speech.sampling, speech.max_new_tokens, self.limits, seconds,
                     self.fixed_length)

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

    @staticmethod
    def blamed(speech: Speech) -> str:
        """The field a prompt too long for the engine is blamed on: its reference, if it has one."""
        return ("voice" if speech.voice != "default" else "ref_audio" if speech.ref_audio is not None
                else "ref_codes" if speech.ref_codes is not None else "speakers" if speech.speakers else "input")

    async def voice(self, speech: Speech) -> tuple[Reference, dict[str, Reference]]:
        """The request's voice (a named one, or its reference audio encoded on the engine thread, or its codes) and
        its speakers' voices, every text checked."""
        voice = self.voices[speech.voice]
        codes, text = (voice.codes, voice.text) if speech.voice != "default" else (speech.ref_codes, speech.ref_text)
        if speech.ref_audio is not None:
            if self.engine.no_encoder is not None:
                raise ApiError(400, f"ref_audio cannot be encoded here: {self.engine.no_encoder}", "ref_audio",
                               "unsupported_parameter")
            if isinstance(speech.ref_audio, Path):  # errors name it below --ref-dir: the server's paths stay its own
                name = speech.ref_audio.relative_to(self.ref_dir.resolve())
                read = partial(load_reference_audio, what=f"ref_audio file://{name}")
            else:
                read = partial(reference_audio_from_bytes, what="ref_audio")
            with field("ref_audio"):
                audio = await run_in_threadpool(read, speech.ref_audio)
                codes = await self.engine.encode(audio)
        if speech.ref_text is not None:
            with field("ref_text"):
                self.tokenizer.encode(speech.ref_text, "ref_text")
        cast = {key: Reference(self.voices[name].codes, self.voices[name].text)
                for key, name in (speech.speakers or {}).items()}
        return Reference(codes, text), cast

    # ---- response bodies (AudioResponse cancels the job when one stops early) ----

    async def _audio(self, job, speech: Speech, deadline: float):
        if speech.response_format == "wav":
            yield wav_header(None)
        async for samples in job.chunks(deadline):
            yield pcm16(samples)[0]

    async def _whole_file(self, request: Request, job, speech: Speech, deadline: float, headers: dict):
        """flac / mp3 / opus: nothing goes out before the file is complete, so a timeout or an engine failure is still
        an error status; a client that leaves cancels its request, as a streamed body's does."""
        async def collect() -> np.ndarray:
            chunks = [samples async for samples in job.chunks(deadline)]
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
            status = CUT_STATUS.get(e.code, 500)
            return JSONResponse(ApiError(status, str(e), None, e.code, "server_error").body(), status, headers=headers)
        finally:
            decoding.cancel()
            leaving.cancel()
            job.cancel()
        data = await run_in_threadpool(encode_file, audio, speech.response_format)
        return Response(data, media_type=ENCODED[speech.response_format][2], headers=headers)

    async def _sse(self, job, speech: Speech, deadline: float):
        def event(data: dict) -> bytes:
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        def delta(data: bytes) -> bytes:
            return event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

        header = wav_header(None) if speech.response_format == "wav" else b""
        try:
            async for samples in job.chunks(deadline):
                yield delta(header + pcm16(samples)[0])
                header = b""
        except Cut as e:
            yield event({"type": "speech.audio.error",
                         "error": {"message": str(e), "type": "server_error", "param": None, "code": e.code}})
            return
        if header:  # no audio at all: a wav is still a wav
            yield delta(header)
        rows, prompt = job.total_rows, job.input_tokens
        yield event({"type": "speech.audio.done",
                     "usage": {"input_tokens": prompt, "output_tokens": rows, "total_tokens": prompt + rows}})


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
              WebSocketRoute("/v1/audio/speech/stream", partial(speech_stream, service)),
              Route("/v1/models", service.models), *voice_routes(service),
              Route("/health", service.health), Route("/metrics", service.metrics_text)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.router.redirect_slashes = False  # its 307 is built from the client's Host header, and says http behind TLS
    return BearerAuth(app, service.api_key) if service.api_key else app


# A whole file's status when its audio stopped early: a timeout, a replica lost (cluster), else an engine failure.
CUT_STATUS = {"timeout": 504, "replica_lost": 503}


def busy(why: str) -> ApiError:
    """429: no room for the request now (Retry-After: 1)."""
    return ApiError(429, f"{why}; retry shortly", None, "queue_full", "rate_limit_error", {"Retry-After": "1"})
