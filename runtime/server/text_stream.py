"""WebSocket `/v1/audio/speech/stream`: text in as it is written (an LLM's reply), speech out as soon as each segment's
text is complete, in one voice and one code stream (no seam between segments), in vLLM-Omni's streaming-speech
protocol so its clients work unchanged.

Client → server, JSON text frames:
  {"type": "session.config", …}      the speech request's fields but `input` (model, voice or speakers, ref_audio,
                                      ref_text, ref_codes, response_format pcm|wav, seed, temperature, top_k, top_p,
                                      max_new_tokens); first, and again between utterances
  {"type": "input.text", "text": …}  more of the utterance's text
  {"type": "input.flush"}            speak the text so far now (an extension: the one cut that arrival makes)
  {"type": "input.done"}             the utterance's text is complete
  {"type": "session.close"}          end the connection
Server → client:
  per segment {"type": "audio.start", "utterance_index", "sentence_index", "sentence_text", "format"}, binary frames
  of its audio (pcm: s16le, 24 kHz, mono; wav: a streamed wav header first), {"type": "audio.done", …};
  {"type": "session.done", "utterance_index", "total_sentences", "usage"} once the utterance's audio is out (the
  connection stays open for the next one); {"type": "error", "message", "code"} and a close on any error.
Where segments are cut depends only on the text (runtime/segment.py), so the audio equals that of the same text
sent whole to POST /v1/audio/speech with the same seed. A client that stops reading is cut off once
BUFFER_SECONDS of its audio wait unsent; one that leaves cancels its request at the engine's next step. In a cluster
an utterance's text goes to the replica that speaks it; a replica lost mid-utterance is an error message and a close.
"""

import asyncio
import json
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from higgs_trt.runtime.decoding import SAMPLES_PER_FRAME
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.request import QueueFull
from higgs_trt.runtime.sinks import wav_header
from higgs_trt.runtime.wav import SAMPLE_RATE, pcm16

from .audio_queue import Cut
from .speech_api import STREAMED, ApiError, Speech, parse_speech

log = logging.getLogger("uvicorn.error")

BUFFER_SECONDS = 30.0  # audio a client may leave unread before it is cut off
TEXT_MESSAGE_BYTES = 64 << 10  # an input.text frame; session.config may carry reference audio (the body's cap)
CLOSE_PROTOCOL, CLOSE_TOO_BIG, CLOSE_BUSY, CLOSE_FAILED = 1008, 1009, 1013, 1011


class Refused(Exception):
    def __init__(self, message: str, code: str, close: int = CLOSE_PROTOCOL):
        super().__init__(message)
        self.code, self.close = code, close


class Utterance:
    """One utterance of a session: its job in the engine, and the task that sends its audio."""

    def __init__(self, session: "Session", index: int, job):
        self.session, self.index, self.job = session, index, job
        self.chars, self.done = 0, False
        self.deadline = asyncio.get_running_loop().time() + session.service.timeout
        self.sender = asyncio.ensure_future(self._send())

    @classmethod
    async def start(cls, session: "Session", index: int) -> "Utterance":
        """Its job submitted before any text: the engine speaks each segment as its text completes."""
        service = session.service
        order = service.order(session.speech, session.voice, session.cast, None, service.timeout)
        try:
            job = await service.engine.submit(order, int(BUFFER_SECONDS * SAMPLE_RATE), session.overflow)
        except QueueFull as e:
            raise Refused(f"{e}; retry shortly", "queue_full", CLOSE_BUSY) from None
        except HiggsError as e:
            raise Refused(str(e), "invalid_value") from None
        return cls(session, index, job)

    async def feed(self, text: str = "", flush: bool = False, finish: bool = False) -> None:
        self.chars += len(text)
        if self.chars > self.session.service.limits.max_input_chars:
            raise Refused(f"the utterance's text is over {self.session.service.limits.max_input_chars} characters "
                          "(the server's --max-input-chars)", "input_too_long")
        try:
            await self.job.feed(text, flush, finish)
        except HiggsError as e:
            raise Refused(str(e), "invalid_value") from None
        self.done = self.done or finish

    def cancel(self) -> None:
        self.job.cancel()
        self.sender.cancel()

    async def _send(self) -> None:
        """Each segment's audio between its audio.start and audio.done, then session.done."""
        ws, fmt = self.session.websocket, self.session.speech.response_format
        said = self.job.said
        segment, position, open_ = 0, 0, False

        async def start() -> None:
            nonlocal open_
            await ws.send_json({"type": "audio.start", "utterance_index": self.index, "sentence_index": segment,
                                "sentence_text": said[segment], "format": fmt})
            if fmt == "wav":
                await ws.send_bytes(wav_header(None))
            open_ = True

        async def end() -> None:
            nonlocal open_, segment
            if not open_:
                await start()
            await ws.send_json({"type": "audio.done", "utterance_index": self.index, "sentence_index": segment})
            open_, segment = False, segment + 1

        try:
            async for samples in self.job.chunks(self.deadline):
                bounds = self.job.bounds
                while len(samples):
                    end_of_segment = bounds[segment] * SAMPLES_PER_FRAME if segment < len(bounds) else None
                    take = len(samples) if end_of_segment is None else min(len(samples), end_of_segment - position)
                    if take:
                        if not open_:
                            await start()
                        await ws.send_bytes(pcm16(samples[:take])[0])
                        position, samples = position + take, samples[take:]
                    if end_of_segment is not None and position >= end_of_segment:
                        await end()
            while segment < len(said):  # the last segment, and any that ended without a frame of audio
                await end()
        except Cut as e:
            await self.session.fail(str(e), e.code, CLOSE_FAILED)
            return
        rows, prompt = self.job.total_rows, self.job.prompt_tokens
        usage = {"input_tokens": prompt, "output_tokens": rows, "total_tokens": prompt + rows}
        await ws.send_json({"type": "session.done", "utterance_index": self.index, "total_sentences": len(said),
                            "usage": usage})
        self.session.utterance = None


class Session:
    """One WebSocket connection: its configuration and its utterances, one after another."""

    def __init__(self, service, websocket: WebSocket):
        self.service, self.websocket = service, websocket
        self.speech: Speech | None = None
        self.voice = self.cast = None
        self.utterance: Utterance | None = None
        self.count = 0
        self.closed = asyncio.Event()

    async def run(self) -> None:
        await self.websocket.accept()
        reader = asyncio.ensure_future(self._read())
        await asyncio.wait({reader, asyncio.ensure_future(self.closed.wait())}, return_when=asyncio.FIRST_COMPLETED)
        reader.cancel()
        if self.utterance is not None:
            self.utterance.cancel()
        if self.websocket.application_state != WebSocketState.DISCONNECTED:
            try:
                await asyncio.wait_for(self.websocket.close(), 1.0)
            except (asyncio.TimeoutError, RuntimeError, OSError, WebSocketDisconnect):
                pass  # the client has gone, or stopped reading

    def overflow(self) -> None:
        """The client stopped reading: BUFFER_SECONDS of its audio wait unsent."""
        log.warning("websocket client not reading: cut off after %g s of unsent audio", BUFFER_SECONDS)
        if self.utterance is not None:
            self.utterance.cancel()
        self.closed.set()

    async def fail(self, message: str, code: str, close: int) -> None:
        if self.utterance is not None:
            self.utterance.cancel()
            self.utterance = None
        try:
            await asyncio.wait_for(self.websocket.send_json({"type": "error", "message": message, "code": code}), 1.0)
            await asyncio.wait_for(self.websocket.close(close), 1.0)
        except (asyncio.TimeoutError, RuntimeError, OSError, WebSocketDisconnect):
            pass
        self.closed.set()

    async def _read(self) -> None:
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self.websocket.receive(), self.service.timeout)
                except asyncio.TimeoutError:
                    raise Refused(f"no message for {self.service.timeout:g} s (the server's --timeout)",
                                  "timeout") from None
                if message["type"] == "websocket.disconnect":
                    break
                await self._handle(message)
                if self.closed.is_set():
                    return
        except Refused as e:
            await self.fail(str(e), e.code, e.close)
            return
        except Exception as e:  # a bug: the client is told, the traceback is for whoever debugs it
            log.error("streaming speech session failed", exc_info=e)
            await self.fail(f"internal error: {type(e).__name__}: {e}", "internal_error", CLOSE_FAILED)
            return
        self.closed.set()

    async def _handle(self, message: dict) -> None:
        raw = message.get("text")
        if raw is None:
            raise Refused("messages are JSON text frames, not binary", "invalid_message")
        try:
            data = json.loads(raw)
        except ValueError:
            raise Refused("a message is not valid JSON", "invalid_json") from None
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "session.config" and len(raw.encode()) > TEXT_MESSAGE_BYTES:
            raise Refused(f"a {kind} message is over {TEXT_MESSAGE_BYTES} bytes", "message_too_large", CLOSE_TOO_BIG)
        if kind == "session.config":
            await self._configure(data)
        elif kind == "session.close":
            self.closed.set()
        elif kind in ("input.text", "input.flush", "input.done"):
            await self._text(kind, data)
        else:
            raise Refused(f"unknown message type {str(kind)[:40]!r} (session.config, input.text, input.flush, "
                          "input.done, session.close)", "unknown_type")

    async def _configure(self, data: dict) -> None:
        if self.utterance is not None:
            raise Refused("session.config during an utterance: send it before the first input.text or after "
                          "session.done", "config_during_utterance")
        fields = {k: v for k, v in data.items() if k != "type"}
        if "input" in fields:
            raise Refused("session.config takes the request's fields but input: send text with input.text",
                          "unknown_parameter")
        fields["input"] = "."  # stands in for the text to come: every other field is checked as a request's
        try:
            speech = parse_speech(json.dumps(fields).encode(), self.service.model, self.service.voices,
                                  self.service.ref_dir)
            if speech.response_format not in STREAMED:
                raise ApiError(400, f"a stream carries {' or '.join(STREAMED)}, not {speech.response_format}",
                               "response_format")
            if speech.sse:
                raise ApiError(400, "a stream sends binary audio frames, not SSE", "stream_format")
            self.voice, self.cast = await self.service.voice(speech)
        except ApiError as e:
            raise Refused(e.message, e.code) from None
        self.speech = speech

    async def _text(self, kind: str, data: dict) -> None:
        if self.speech is None:
            raise Refused(f"{kind} before session.config", "config_first")
        text = data.get("text", "") if kind == "input.text" else ""
        if not isinstance(text, str):
            raise Refused("input.text's text must be a string", "invalid_type")
        if self.utterance is not None and self.utterance.done:
            raise Refused(f"{kind} after input.done: wait for session.done", "text_after_done")
        if self.utterance is None:
            self.utterance = await Utterance.start(self, self.count)
            self.count += 1
        await self.utterance.feed(text, flush=kind == "input.flush", finish=kind == "input.done")


async def speech_stream(service, websocket: WebSocket) -> None:
    """The route's handler; `service`: the server's SpeechService (app.py)."""
    if service.draining or not service.engine.ready.is_set():
        await websocket.close(CLOSE_BUSY)
        return
    await Session(service, websocket).run()
