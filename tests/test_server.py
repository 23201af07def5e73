"""`higgs-trt serve` on the tiny ORT engine, over loopback: the official `openai` client and httpx against a real
server process. Every response's audio equals the solo scheduler run (and `higgs-trt run`) for the same text, seed
and row cap; every bad request gets a 4xx naming its field; disconnects and timeouts free their slots; SIGTERM drains
and exits 0; a bounded load test (200 requests at concurrency 16, a quarter malformed, a few disconnecting) ends with
zero 5xx, every slot free and the server's memory grown by at most 50 MB."""

import asyncio
import base64
import io
import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import wave
from functools import lru_cache

import httpx
import numpy as np
import openai
import pytest
import soundfile
from click.testing import CliRunner

from higgs_trt.runtime.audio import encode_reference, load_reference_audio
from higgs_trt.runtime.backends.ort import OrtBackend, OrtEncoder
from higgs_trt.runtime.cli import main
from higgs_trt.runtime.manifest import EngineDir
from higgs_trt.runtime.options import sampling
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from higgs_trt.runtime.request import request_for
from higgs_trt.runtime.scheduler import Scheduler
from higgs_trt.runtime.server.speech_api import MODEL_ID
from higgs_trt.runtime.sinks import wav_header
from higgs_trt.runtime.stepper import HostStepper
from higgs_trt.runtime.wav import pcm16
from serving import Server, body, free_port, metric

TEXT = "Hello there, how are you today?"
LONG = ("This one goes on and on for quite a while, so that a client can leave long before it ends, and a timeout can "
        "cut it well before the last of its many rows.")
LONG_SEED = 1  # with it the tiny model speaks LONG to the row cap (most seeds trip the repeated-row guard sooner)
WAV_HEADER = wav_header(None)
SPEECH = "/v1/audio/speech"


# ---- the engine, solo runs, and a server process -----------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_dir(serve_engine):
    return serve_engine


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """A reference recording (16 kHz, resampled by the server) in --ref-dir, and a voices directory with a recorded
    voice and a codes voice."""
    root = tmp_path_factory.mktemp("refs")
    t = np.arange(int(1.6 * 16000)) / 16000
    audio = (0.4 * np.sin(2 * np.pi * 180 * t * (1 + 0.3 * np.sin(3 * t)))).astype(np.float32)
    ref_dir, voices = root / "refs", root / "voices"
    ref_dir.mkdir()
    voices.mkdir()
    soundfile.write(ref_dir / "ref.wav", audio, 16000)
    (ref_dir / "notes.wav").write_bytes(b"not audio at all")
    soundfile.write(voices / "sung.wav", audio, 16000)
    (voices / "sung.txt").write_text("A rising tone.\n")
    codes = np.random.default_rng(3).integers(0, 1024, (20, 8)).astype(np.int32)
    np.save(voices / "coded.npy", codes)
    (voices / "coded.txt").write_text("Some words.")
    return {"ref_dir": ref_dir, "voices": voices, "wav": (ref_dir / "ref.wav").read_bytes(), "codes": codes}


class Solo:
    """The reference: each request decoded alone by the scheduler on an engine of this process."""

    def __init__(self, engine_dir, refs):
        d = EngineDir(engine_dir)
        self.engine = HostStepper(OrtBackend(d))
        self.tok = HiggsTokenizer(engine_dir / "tokenizer.json")
        self.encoded = encode_reference(load_reference_audio(refs["ref_dir"] / "ref.wav"), OrtEncoder(d))
        self.refs = refs

    def codes(self, voice):
        return {"sung": self.encoded, "coded": self.refs["codes"], "audio": self.encoded}.get(voice)

    @lru_cache(maxsize=None)
    def run(self, text, seed=0, cap=2048, voice=None, ref_text=None, temperature=1.0):
        """(pcm16 bytes, prompt tokens, rows) of one request; voice: a --voices name, or 'audio' for ref.wav."""
        prompt = build_prompt(self.tok, text, self.codes(voice), ref_text)
        scheduler = Scheduler(self.engine)
        request = scheduler.submit(request_for(self.engine, prompt, sampling(temperature, 0, 1.0, seed), hard_cap=cap))
        scheduler.run()
        return pcm16(request.audio())[0], len(prompt), len(request.utterance.rows)


@pytest.fixture(scope="module")
def solo(engine_dir, refs):
    return Solo(engine_dir, refs)


@pytest.fixture(scope="module")
def long_request(solo) -> dict:
    """A request that decodes all of its 900 rows (≥ 0.4 s on this engine, at ≥ 0.46 ms a step in ONNX Runtime alone):
    long enough to outlast a disconnect after its first chunk, a 0.1 s timeout, the steps of a test."""
    assert solo.run(LONG, LONG_SEED, 900)[2] == 900
    return body(input=LONG, seed=LONG_SEED, max_new_tokens=900, response_format="pcm")


@pytest.fixture(scope="module")
def server(engine_dir, refs, tmp_path_factory):
    s = Server(engine_dir, tmp_path_factory.mktemp("log") / "server.log", "--voices", refs["voices"], "--ref-dir",
               refs["ref_dir"], "--max-queue", 64)
    yield s
    assert s.stop() == 0, s.output()


# ---- the official openai client ----------------------------------------------------------------------------------

def test_openai_client_wav_equals_higgs_trt_run(server, engine_dir, tmp_path):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    data = client.audio.speech.create(model=MODEL_ID, voice="default", input=TEXT, extra_body={"seed": 7}).read()
    out = tmp_path / "run.wav"
    r = CliRunner().invoke(main, ["run", "--engine", str(engine_dir), "--text", TEXT, "--seed", "7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    with wave.open(str(out)) as w:
        expected = w.readframes(w.getnframes())
    assert data[:44] == WAV_HEADER  # streamed: RIFF and data sizes 0xFFFFFFFF
    assert len(expected) > 24000 and data[44:] == expected


def test_openai_client_streams_pcm(server, solo):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
            model=MODEL_ID, voice="default", input=TEXT, response_format="pcm",
            extra_body={"seed": 11, "max_new_tokens": 120, "temperature": 0.8}) as response:
        assert response.headers["x-sample-rate"] == "24000" and response.headers["content-type"] == "audio/pcm"
        pieces = list(response.iter_bytes())
    expected = solo.run(TEXT, 11, 120, temperature=0.8)[0]
    assert len(expected) == 2 * 960 * (120 - 7) and b"".join(pieces) == expected


def test_openai_client_errors_are_openai_shaped(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=MODEL_ID, voice="alloy", input=TEXT)
    assert e.value.body["param"] == "voice" and e.value.body["code"] == "voice_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=MODEL_ID, voice="default", input=TEXT, speed=1.5)
    assert e.value.body["param"] == "speed"
    with pytest.raises(openai.NotFoundError) as e:
        client.audio.speech.create(model="tts-1", voice="default", input=TEXT)
    assert e.value.body["param"] == "model"
    assert [m.id for m in client.models.list()] == [MODEL_ID]


# ---- SSE and the other formats (httpx) ---------------------------------------------------------------------------

def sse_events(url: str, payload: dict) -> list[dict]:
    with httpx.stream("POST", url + SPEECH, json=payload, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]


def test_sse_deltas_then_done_with_usage(server, solo):
    events = sse_events(server.url, body(input=TEXT, response_format="pcm", stream_format="sse", seed=5,
                                         max_new_tokens=100))
    *deltas, done = events
    audio, tokens, rows = solo.run(TEXT, 5, 100)
    assert len(deltas) > 1 and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == audio
    assert done == {"type": "speech.audio.done", "usage": {"input_tokens": tokens, "output_tokens": rows,
                                                           "total_tokens": tokens + rows}}
    # vLLM-Omni's `stream: true` alone means SSE; a wav's header rides in the first delta
    *deltas, done = sse_events(server.url, body(input=TEXT, stream=True, seed=5, max_new_tokens=100))
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == WAV_HEADER + audio
    assert done["type"] == "speech.audio.done"


def test_a_server_streams_in_the_chunks_its_options_ask_for(engine_dir, solo, tmp_path):
    """serve --first-chunk 2 --chunk 10: a first delta of 2 frames, then 8 (4× what came before), then 10 at a time,
    and the same audio as the default windows give (exact seams either way)."""
    frame = 960 * 2  # bytes of pcm a frame
    s = Server(engine_dir, tmp_path / "server.log", "--first-chunk", 2, "--chunk", 10)
    try:
        *deltas, done = sse_events(s.url, body(input=TEXT, response_format="pcm", stream_format="sse", seed=5,
                                               max_new_tokens=100))
    finally:
        assert s.stop() == 0, s.output()
    pieces = [base64.b64decode(e["audio"]) for e in deltas]
    assert [len(p) for p in pieces[:2]] == [2 * frame, 8 * frame], [len(p) for p in pieces]
    assert {len(p) for p in pieces[2:-1]} == {10 * frame}, [len(p) for p in pieces]
    # exact seams: the samples of the default windows, to the pcm step (other window lengths round the convolutions'
    # floats differently, ~1e-7, which can move a sample across a 16-bit rounding boundary)
    got, want = (np.frombuffer(b, "<i2").astype(int) for b in (b"".join(pieces), solo.run(TEXT, 5, 100)[0]))
    assert got.shape == want.shape and np.abs(got - want).max() <= 1 and done["type"] == "speech.audio.done"


def test_whole_file_formats(server, solo):
    audio = np.frombuffer(solo.run(TEXT, 2, 80)[0], "<i2")
    r = httpx.post(server.url + SPEECH, json=body(input=TEXT, seed=2, max_new_tokens=80, response_format="flac"))
    assert r.status_code == 200 and r.headers["content-type"] == "audio/flac"
    flac, rate = soundfile.read(io.BytesIO(r.content), dtype="int16")
    assert rate == 24000 and np.array_equal(flac, audio)  # lossless: the very samples wav and pcm carry
    for fmt, media in (("mp3", "audio/mpeg"), ("opus", "audio/ogg")):
        r = httpx.post(server.url + SPEECH, json=body(input=TEXT, seed=2, max_new_tokens=80, response_format=fmt))
        assert r.status_code == 200 and r.headers["content-type"] == media
        decoded, rate = soundfile.read(io.BytesIO(r.content))
        assert rate == 24000 and abs(len(decoded) - len(audio)) < 0.1 * 24000  # lossy, with codec padding


# ---- voices and references ---------------------------------------------------------------------------------------

def test_voices_and_references_equal_their_solo_runs(server, solo, refs):
    def audio(**fields):
        r = httpx.post(server.url + SPEECH, json=body(input=TEXT, seed=4, max_new_tokens=60, response_format="pcm",
                                                      **fields), timeout=60)
        assert r.status_code == 200, r.text
        return r.content

    assert httpx.get(server.url + "/v1/audio/voices").json()["voices"] == ["default", "coded", "sung"]
    assert audio(voice="coded") == solo.run(TEXT, 4, 60, "coded", "Some words.")[0]
    assert audio(voice="sung") == solo.run(TEXT, 4, 60, "sung", "A rising tone.")[0]
    cloned = solo.run(TEXT, 4, 60, "audio", "Hi.")[0]
    b64 = base64.b64encode(refs["wav"]).decode()
    assert audio(ref_audio=b64, ref_text="Hi.") == cloned
    assert audio(ref_audio="data:audio/wav;base64," + b64, ref_text="Hi.") == cloned
    assert audio(ref_audio="file://ref.wav", ref_text="Hi.") == cloned
    assert audio(ref_codes=refs["codes"].tolist(), ref_text="Some words.") == solo.run(TEXT, 4, 60, "coded",
                                                                                       "Some words.")[0]
    assert audio(voice="default") == solo.run(TEXT, 4, 60)[0] != cloned


# ---- bad requests: 4xx naming the field, never 5xx ---------------------------------------------------------------

def _wav_b64(seconds: float) -> str:
    out = io.BytesIO()
    soundfile.write(out, 0.3 * np.sin(np.arange(int(seconds * 24000)) / 7.0), 24000, format="WAV")
    return base64.b64encode(out.getvalue()).decode()


GOOD_CODES = [[1] * 8] * 4
BAD = [  # (body: dict | bytes, status, param)
    ({"input": 5}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": "x" * 4097}, 400, "input"),
    ({"input": "Hi <|tts|> there"}, 400, "input"),
    ({"input": "Hi\x07"}, 400, "input"),
    ({"input": "Hi", "ref_codes": [[0] * 8] * 200}, 400, "ref_codes"),  # a reference longer than the engine's prefill
    ({"input": "Hi", "voice": "alloy"}, 400, "voice"),
    ({"input": "Hi", "voice": 3}, 400, "voice"),
    ({"input": "Hi", "voice": "coded", "ref_codes": GOOD_CODES}, 400, "voice"),
    ({"input": "Hi", "response_format": "aac"}, 400, "response_format"),
    ({"input": "Hi", "stream": True, "response_format": "flac"}, 400, "response_format"),
    ({"input": "Hi", "speed": 1.5}, 400, "speed"),
    ({"input": "Hi", "speed": "fast"}, 400, "speed"),
    ({"input": "Hi", "stream_format": "chunks"}, 400, "stream_format"),
    ({"input": "Hi", "stream": "yes"}, 400, "stream"),
    ({"input": "Hi", "temperature": -1}, 400, "temperature"),
    ({"input": "Hi", "temperature": "hot"}, 400, "temperature"),
    (b'{"input": "Hi", "temperature": NaN}', 400, "temperature"),
    (b'{"input": "Hi", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
    (b'{"input": "Hi", "top_p": 1' + b"0" * 400 + b"}", 400, "top_p"),
    ({"input": "Hi", "top_p": 0}, 400, "top_p"),
    ({"input": "Hi", "top_k": -3}, 400, "top_k"),
    ({"input": "Hi", "top_k": 1.5}, 400, "top_k"),
    ({"input": "Hi", "top_k": 10**12}, 400, "top_k"),
    ({"input": "Hi", "seed": -1}, 400, "seed"),
    ({"input": "Hi", "seed": 2**64}, 400, "seed"),
    ({"input": "Hi", "seed": True}, 400, "seed"),
    ({"input": "Hi", "max_new_tokens": 3}, 400, "max_new_tokens"),
    ({"input": "Hi", "max_new_tokens": "many"}, 400, "max_new_tokens"),
    ({"input": "Hi", "ref_audio": "not base64!"}, 400, "ref_audio"),
    ({"input": "Hi", "ref_audio": base64.b64encode(b"RIFF garbage that is no audio").decode()}, 400, "ref_audio"),
    ({"input": "Hi", "ref_audio": _wav_b64(0.5)}, 400, "ref_audio"),  # shorter than 1 s
    ({"input": "Hi", "ref_audio": _wav_b64(31)}, 400, "ref_audio"),  # longer than 30 s
    ({"input": "Hi", "ref_audio": "data:audio/wav,abc"}, 400, "ref_audio"),
    ({"input": "Hi", "ref_audio": "https://example.com/a.wav"}, 400, "ref_audio"),
    ({"input": "Hi", "ref_audio": "file://../voices/sung.wav"}, 400, "ref_audio"),  # outside --ref-dir
    ({"input": "Hi", "ref_audio": "file://missing.wav"}, 400, "ref_audio"),
    ({"input": "Hi", "ref_audio": 12}, 400, "ref_audio"),
    ({"input": "Hi", "ref_codes": [[1, 2, 3]]}, 400, "ref_codes"),
    ({"input": "Hi", "ref_codes": [[2000] * 8]}, 400, "ref_codes"),
    ({"input": "Hi", "ref_codes": "AAAA"}, 400, "ref_codes"),
    ({"input": "Hi", "ref_codes": [[1, True, 3, 4, 5, 6, 7, 8]]}, 400, "ref_codes"),  # JSON types are not cast
    ({"input": "Hi", "ref_codes": [[1] * 8] * 400}, 400, "ref_codes"),  # longer than the engine's prefill
    ({"input": "Hi", "ref_audio": "file://notes.wav"}, 400, "ref_audio"),
    ({"input": "Hi", "ref_codes": GOOD_CODES, "ref_text": "x" * 4097}, 400, "ref_text"),
    ({"input": "Hi", "ref_text": "x"}, 400, "ref_text"),
    ({"input": "Hi", "ref_codes": GOOD_CODES, "ref_text": "<|ref_audio|>"}, 400, "ref_text"),
    ({"input": "Hi", "instructions": "whisper"}, 400, "instructions"),
    ({"input": "Hi", "model": "tts-1"}, 404, "model"),
    ({"input": "Hi", "bogus": 1}, 400, "bogus"),
    (b"not json", 400, None),
    (b"[" * 100_000, 400, None),  # nesting deeper than the JSON parser recurses
    (b'"just a string"', 400, None),
    (b"\xff\xfe{}", 400, None),
    (b"x" * (16 * 2**20 + 1), 413, None),  # over the body cap
]


def check_bad(status: int, payload: dict, expected_status: int, param) -> None:
    assert status == expected_status, payload
    error = payload["error"]
    assert error["param"] == param and error["message"] and error["type"] and error["code"], payload
    assert " object at 0x" not in error["message"], payload  # no Python repr leaks into what a client reads
    assert "/tmp/" not in error["message"], payload  # nor the server's paths (--ref-dir's files are named below it)


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_requests_get_4xx_naming_the_field(server, case):
    payload, status, param = BAD[case]
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = httpx.post(server.url + SPEECH, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    check_bad(r.status_code, r.json(), status, param)


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
def test_an_utterance_without_audio_is_still_a_file_that_decodes(fmt):
    from higgs_trt.runtime.server.app import encode_file

    audio, rate = soundfile.read(io.BytesIO(encode_file(np.zeros(0, np.float32), fmt)))
    assert rate == 24000 and 1 <= len(audio) <= 960 and np.abs(audio).max() < 1e-3  # lossy codecs: near zero


def test_health_models_metrics(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL_ID
    r = httpx.get(server.url + "/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # a trailing slash is another path, not a redirect built from the client's Host header (behind a TLS proxy
    # that would send the client to plain http, or to whatever host it named)
    r = httpx.post(server.url + SPEECH + "/", json=body(input=TEXT), headers={"Host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers, (r.status_code, r.headers)
    assert r.json()["error"]["message"] == f"POST {SPEECH}/: Not Found"
    m = server.metrics()
    for name in ("higgs_time_to_first_audio_seconds_count", "higgs_queue_depth", "higgs_busy_slots",
                 "higgs_audio_seconds_total"):
        assert name in m
    # the warm-up request went through the loop: one prefill, decode steps
    assert m["higgs_prefill_calls"] >= 1 and m['higgs_engine_loop_seconds{phase="decode"}'] > 0
    assert m["higgs_slots"] == 4
    waited, admitted = m.get("higgs_queue_wait_seconds_count", 0), m.get("higgs_admission_seconds_count", 0)
    assert httpx.post(server.url + SPEECH, json=body(input=TEXT, max_new_tokens=10), timeout=60).status_code == 200
    after = server.metrics()
    assert after["higgs_queue_wait_seconds_count"] == waited + 1  # its wait for a slot
    assert after["higgs_admission_seconds_count"] == admitted + 1  # its parsing and prompt, before that


# ---- disconnects, limits, shutdown -------------------------------------------------------------------------------

def test_a_client_leaving_before_its_whole_file_frees_its_slot(server, long_request):
    """flac / mp3 / opus send nothing until the file is complete; a client that leaves before then cancels too."""
    before = server.metrics()
    content = json.dumps({**long_request, "response_format": "mp3"}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (SPEECH.encode(), len(content), content))
        deadline = time.monotonic() + 10
        while server.metrics()["higgs_busy_slots"] == 0:  # admitted and decoding, then the client leaves
            assert time.monotonic() < deadline
            time.sleep(0.02)
    after = server.wait_idle(timeout=10)
    assert metric(after, 'higgs_requests_total{outcome="cancelled"}') == \
        metric(before, 'higgs_requests_total{outcome="cancelled"}') + 1


def test_a_client_leaving_mid_stream_frees_its_slot(server, long_request):
    before = server.metrics()
    with httpx.stream("POST", server.url + SPEECH, json=long_request, timeout=60) as r:
        first = next(r.iter_raw())
        assert len(first) > 0
    # the request needs ~900 steps; the client left after the first chunk (~18)
    after = server.wait_idle(timeout=10)
    assert metric(after, 'higgs_requests_total{outcome="cancelled"}') == \
        metric(before, 'higgs_requests_total{outcome="cancelled"}') + 1
    assert metric(after, "higgs_audio_seconds_total") - metric(before, "higgs_audio_seconds_total") < 30


def wait_for(s: Server, name: str, value: float) -> None:
    deadline = time.monotonic() + 30
    while metric(s.metrics(), name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {s.metrics()}"
        time.sleep(0.02)


def test_a_full_queue_answers_429_with_retry_after(engine_dir, long_request, tmp_path):
    s = Server(engine_dir, tmp_path / "queue.log", "--max-batch", 1, "--max-queue", 1)
    try:
        # bodies being received: as many as the queue and the slots hold together (1 + 1), a third is refused
        stalled = [_partial_request(s.port, 100, b'{"input"') for _ in range(2)]
        deadline = time.monotonic() + 10
        while (probe := httpx.post(s.url + SPEECH, json={"input": 5})).status_code == 400:  # until both are in
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert probe.status_code == 429 and probe.json()["error"]["message"].startswith("2 requests are being received")
        for conn in stalled:
            conn.close()
        long = long_request
        with httpx.stream("POST", s.url + SPEECH, json=long, timeout=60) as running:
            wait_for(s, "higgs_busy_slots", 1)
            with httpx.stream("POST", s.url + SPEECH, json=long, timeout=60) as waiting:
                wait_for(s, "higgs_queue_depth", 1)
                assert running.status_code == waiting.status_code == 200
                r = httpx.post(s.url + SPEECH, json=long)
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["param"] is None
        m = s.wait_idle()
        assert metric(m, 'higgs_requests_total{outcome="cancelled"}') == 2
        assert metric(m, 'higgs_errors_total{code="queue_full"}') == 2
    finally:
        assert s.stop() == 0, s.output()


def _partial_request(port: int, declared: int, sent: bytes) -> socket.socket:
    """A connection that declares a body of `declared` bytes and sends only `sent` of it, then stalls."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(f"POST {SPEECH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {declared}\r\n\r\n".encode() + sent)
    return conn


def _answer(conn: socket.socket, timeout: float) -> bytes:
    conn.settimeout(timeout)
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def test_the_uvicorn_internals_the_connection_protocol_touches_are_still_there():
    """runtime/server/h11_connection.py subclasses uvicorn's H11Protocol and reads its attributes; pyproject.toml pins
    the uvicorn release it was written against. A release that renames or drops one fails here, not in a server."""
    import inspect

    from uvicorn.protocols.http import h11_impl

    from higgs_trt.runtime.server import h11_connection

    ours = inspect.getsource(h11_connection)
    theirs = inspect.getsource(h11_impl.H11Protocol)
    for member in ("connection_made", "data_received", "timeout_keep_alive_handler"):
        assert f"def {member}(" in theirs and member in ours
    for attribute in ("connections", "cycle", "transport", "loop", "timeout_keep_alive_task", "timeout_keep_alive"):
        assert f"self.{attribute}" in theirs and f"self.{attribute}" in ours, attribute
    assert "self.response_complete" in inspect.getsource(h11_impl.RequestResponseCycle)


def test_a_connection_whose_body_outlasts_an_early_answer_is_closed(server):
    """A 405 (or a 429) answered before a large body has arrived: once it has, the connection idles like any other
    after its response and is closed at uvicorn's keep-alive timeout (5 s), not held open for good."""
    body = b"x" * (4 << 20)
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        started = time.monotonic()
        answer = _answer(conn, 30)  # to the server's close
    assert answer.startswith(b"HTTP/1.1 405 ") and time.monotonic() - started < 20, answer[:200]


def test_clients_that_stall_or_leave_mid_request_are_dropped_quietly(engine_dir, tmp_path):
    """A body that stalls gets 408 at --timeout; headers that stall are cut; a client that leaves mid-body is no
    traceback; reference-audio bodies beyond LARGE_BODIES_AT_ONCE get 429; a drain does not wait for stalled bodies."""
    from higgs_trt.runtime.server.app import LARGE_BODIES_AT_ONCE

    s = Server(engine_dir, tmp_path / "stall.log", "--timeout", 2)
    try:
        stalled = _partial_request(s.port, 1000, b'{"input": ')
        assert _answer(stalled, 6).startswith(b"HTTP/1.1 408 "), s.output()
        headers = socket.create_connection(("127.0.0.1", s.port))
        headers.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        assert _answer(headers, 6) == b""  # closed without an answer, within the deadline
        for _ in range(3):
            _partial_request(s.port, 1000, b'{"input": ').close()  # gone mid-body
        big = b'{"input": "Hi", "ref_audio": "' + b"A" * (100 << 10)
        uploads = [_partial_request(s.port, 10 << 20, big) for _ in range(LARGE_BODIES_AT_ONCE)]
        time.sleep(0.5)
        one_more = _partial_request(s.port, len(big) + 2, big + b'"}')
        assert _answer(one_more, 6).startswith(b"HTTP/1.1 429 "), s.output()
        for conn in uploads:
            conn.close()
        assert httpx.post(s.url + SPEECH, json=body(input=TEXT, max_new_tokens=10), timeout=60).status_code == 200
        stalled = _partial_request(s.port, 1000, b'{"input": ')
        time.sleep(0.3)
        t0 = time.monotonic()
        assert s.stop() == 0, s.output()
        assert time.monotonic() - t0 < 5, "the drain waited for a stalled body"
        stalled.close()
    finally:
        s.stop()
    log = s.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "ClientDisconnect" not in log, log


def test_connections_past_the_open_file_limit_get_503_and_the_server_goes_on(engine_dir, tmp_path):
    """A flood of connections past what the process's open-file limit allows: those past the cap are answered 503
    and closed, the log stays a few lines (asyncio logs each failed accept with a traceback), and the server serves
    once they are gone."""
    s = Server(engine_dir, tmp_path / "flood.log", open_files=256)
    try:
        flood = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(300)]
        # Past 256 − 128 kept for the engine: answered and closed on accept. A burst can still run the process out
        # of descriptors inside one tick (asyncio accepts a whole backlog before any is answered); those wait for
        # asyncio's accept retry a second later, hence the long read timeout (each read ends at the server's close).
        refused = [_answer(conn, 10) for conn in flood[-100:]]
        wrong = [r for r in refused if not (r.startswith(b"HTTP/1.1 503 ") and b"retry shortly" in r)]
        assert not wrong, (len(wrong), wrong[0])
        for conn in flood:
            conn.close()
        assert httpx.post(s.url + SPEECH, json=body(input=TEXT, max_new_tokens=10), timeout=60).status_code == 200
    finally:
        assert s.stop() == 0, s.output()
    log = s.log_path.read_text(errors="replace")
    assert "Traceback" not in log and log.count("\n") < 30, log[:3000]


def test_the_open_file_limit_is_raised_to_the_hard_one():
    code = ("import resource; from higgs_trt.runtime.server.run import raise_open_file_limit as r; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 512)); print(r(), resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["512", "(512,", "512)"], out


def test_a_request_past_its_timeout_is_cut_and_its_slot_freed(engine_dir, long_request, tmp_path):
    s = Server(engine_dir, tmp_path / "timeout.log", "--timeout", 0.1)
    try:
        long = long_request
        with httpx.stream("POST", s.url + SPEECH, json=long, timeout=60) as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):  # an incomplete chunked body: the client can tell
                r.read()
        events = sse_events(s.url, {**long, "stream_format": "sse"})
        assert events[-1]["type"] == "speech.audio.error" and events[-1]["error"]["code"] == "timeout"
        r = httpx.post(s.url + SPEECH, json={**long, "response_format": "flac"}, timeout=60)  # nothing sent yet
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        m = s.wait_idle()
        assert metric(m, 'higgs_requests_total{outcome="timeout"}') == 3
    finally:
        assert s.stop() == 0, s.output()


def test_sigterm_drains_in_flight_requests_then_exits_0(engine_dir, solo, long_request, tmp_path):
    s = Server(engine_dir, tmp_path / "term.log")
    with httpx.stream("POST", s.url + SPEECH, json=long_request, timeout=60) as r:
        stream = r.iter_raw()
        pieces = [next(stream)]
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # the listening socket is closed (or, in the moment before, new requests get 503)
            assert httpx.post(s.url + SPEECH, json=body(input=TEXT)).status_code == 503
        except httpx.TransportError:
            pass
        pieces += list(stream)
    assert b"".join(pieces) == solo.run(LONG, LONG_SEED, 900)[0]  # finished in full
    assert s.proc.wait(30) == 0, s.output()
    s.stop()


def test_health_is_503_until_warm_and_while_shutting_down(engine_dir):
    """In process (Starlette's TestClient), the real engine behind a gate that holds its loading back."""
    import threading

    from starlette.testclient import TestClient

    from higgs_trt.runtime.cli.engines import load_tokenizer, open_encoder, open_engine, open_sources
    from higgs_trt.runtime.server.app import SpeechService, create_app
    from higgs_trt.runtime.server.limits import Limits
    from higgs_trt.runtime.server.engine_thread import EngineThread
    from higgs_trt.runtime.server.voices import VoiceStore

    sources = open_sources("ort", engine_dir, None, None, None)
    tokenizer, gate = load_tokenizer(sources), threading.Event()
    store = VoiceStore(None, tokenizer)
    voices = store.voices
    thread = EngineThread(lambda: gate.wait() and open_engine(sources, max_batch=2), lambda: open_encoder(sources),
                          tokenizer, voices, 8)
    service = SpeechService(thread, tokenizer, store, None, Limits(timeout=60.0))
    with TestClient(create_app(service)) as client:
        assert client.get("/health").json() == {"status": "loading"}
        r = client.post(SPEECH, json=body(input=TEXT))
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        gate.set()
        assert thread.ready.wait(120)
        assert client.get("/health").status_code == 200
        assert client.post(SPEECH, json=body(input=TEXT, max_new_tokens=20, response_format="pcm")).status_code == 200
        service.draining = True  # what SIGTERM sets
        assert client.get("/health").json() == {"status": "shutting down"}
        r = client.post(SPEECH, json=body(input=TEXT))
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_an_engine_that_decodes_nan_is_refused_at_warm_up(engine_dir, tmp_path):
    from higgs_trt.runtime.manifest import MANIFEST, _seal, file_digest

    broken = shutil.copytree(engine_dir, tmp_path / "broken")
    (broken / "weights.bin").write_bytes(b"\xff" * (broken / "weights.bin").stat().st_size)  # every weight NaN
    manifest = json.loads((broken / MANIFEST).read_text())
    manifest["files"]["weights.bin"] = file_digest(broken / "weights.bin")
    manifest["manifest_sha256"] = _seal(manifest)  # resealed, as a tool that wrote it would
    (broken / MANIFEST).write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", "serve", "--engine", broken, "--port", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("Error:")] == [
        "Error: the warm-up request decoded NaN or infinite samples: the engine's weights are broken"], r.stderr


def test_a_voice_too_long_for_the_engine_is_refused_at_start(engine_dir, tmp_path):
    voices = tmp_path / "voices"
    voices.mkdir()
    np.save(voices / "long.npy", np.ones((400, 8), np.int32))  # the engine's prefill takes 160 tokens
    r = subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", "serve", "--engine", engine_dir, "--voices",
                        voices, "--port", "0"], capture_output=True, text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr
    assert errors[0].startswith("Error: voice 'long' does not fit this engine: text and reference audio too long: "
                                "the prompt takes"), r.stderr


def test_audio_that_turns_nan_while_serving_fails_its_request_only(engine_dir):
    """NaN audio after the warm-up (weights that break on some inputs only) ends that request as an engine failure: an
    SSE stream gets speech.audio.error, the outcome counts as failed, no traceback, and the next request is served.
    In process, with the real engine's codec output replaced by NaN for one request: broken weights themselves are
    refused at the warm-up (above), so this is the one way to reach the path."""
    from starlette.testclient import TestClient

    from higgs_trt.runtime.cli.engines import load_tokenizer, open_encoder, open_engine, open_sources
    from higgs_trt.runtime.server.app import SpeechService, create_app
    from higgs_trt.runtime.server.limits import Limits
    from higgs_trt.runtime.server.engine_thread import EngineThread
    from higgs_trt.runtime.server.voices import VoiceStore

    sources = open_sources("ort", engine_dir, None, None, None)
    tokenizer = load_tokenizer(sources)
    store = VoiceStore(None, tokenizer)
    voices = store.voices
    thread = EngineThread(lambda: open_engine(sources, max_batch=2), lambda: open_encoder(sources), tokenizer, voices, 8)
    service = SpeechService(thread, tokenizer, store, None, Limits(timeout=60.0))
    with TestClient(create_app(service)) as client:
        assert thread.ready.wait(120)
        backend = thread.engine.backend
        codec = backend.codec
        backend.codec = lambda codes: np.full_like(codec(codes), np.nan)
        with client.stream("POST", SPEECH, json=body(input=TEXT, max_new_tokens=20, stream_format="sse")) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert events == [{"type": "speech.audio.error", "error": {
            "message": "the engine decoded NaN or infinite samples: the engine's weights are broken",
            "type": "server_error", "param": None, "code": "engine_error"}}]
        backend.codec = codec
        assert client.post(SPEECH, json=body(input=TEXT, max_new_tokens=20, response_format="pcm")).status_code == 200
        metrics = client.get("/metrics").text
    assert 'higgs_requests_total{outcome="failed"} 1.0' in metrics
    assert 'higgs_requests_total{outcome="completed"} 1.0' in metrics


# ---- the command line ----------------------------------------------------------------------------------------------

def test_bench_serve_prints_figures_per_level(server):
    r = CliRunner().invoke(main, ["bench", "serve", "--url", server.url, "--concurrency", "1,2", "--requests", "3",
                                  "--max-new-tokens", "30", "--wait", "10"])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if line.startswith("concurrency")]
    assert len(lines) == 2 and all("3 requests" in line and "failed" not in line for line in lines), r.output
    assert all(float(re.search(r"= +([\d.]+) audio-s/s", line)[1]) > 0 for line in lines)
    # the server's engine loop over the level, from its /metrics: decode time, at least one prefill and codec call
    assert all(float(re.search(r"loop prefill [\d.]+ s, decode ([\d.]+) s", line)[1]) > 0 for line in lines), r.output
    assert all(int(re.search(r"; (\d+) prefill calls", line)[1]) >= 1 for line in lines), r.output
    assert all(int(re.search(r"; (\d+) codec calls of [\d.]+ windows", line)[1]) >= 1 for line in lines), r.output
    assert all(re.search(r"; queue wait mean [\d.]+ ms", line) for line in lines), r.output
    for line in lines:  # admission and first audio at the server are parts of what the client sees
        client = float(re.search(r"p95 +[\d.]+ ms, mean +([\d.]+) ms", line)[1])
        admission, server = map(float, re.search(r"; at the server: admission ([\d.]+) ms, then first audio ([\d.]+) ms",
                                                  line).groups())
        assert admission > 0 and server > 0 and admission + server <= client, line


def _bench_serve_without_a_server(wait: str):
    """`bench serve` against a port that refuses connections (bound, never listening): its result and URL."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        return CliRunner().invoke(main, ["bench", "serve", "--url", url, "--wait", wait]), url


def test_bench_serve_without_a_server_is_one_error_line():
    r, _ = _bench_serve_without_a_server("1")
    assert r.exit_code == 1 and r.output.startswith("Error: ") and "is not 200 after 1 s" in r.output, r.output
    assert r.output.count("\n") == 1 and "Traceback" not in r.output


def test_bench_serve_says_that_it_still_waits_for_a_server(monkeypatch):
    monkeypatch.setattr("higgs_trt.runtime.bench.serve.WAIT_REPORT_S", 0.5)
    r, url = _bench_serve_without_a_server("3")
    lines = r.output.splitlines()  # polled each second: reports at 1 and 2 s, the error at 3
    assert r.exit_code == 1 and lines[-1].startswith("Error: ") and "is not 200 after 3 s" in lines[-1], r.output
    assert len(lines) >= 3 and all(line.startswith(f"still waiting for {url}/health: ")
                                   and line.endswith("s of 3 (last: ClientConnectorError)") for line in lines[:-1])


def test_serve_refuses_bad_options_with_one_error_line(engine_dir, tiny_ckpt, tmp_path):
    bad_voices = tmp_path / "voices"
    bad_voices.mkdir()
    (bad_voices / "lonely.txt").write_text("a transcript without a reference")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--engine", str(tmp_path / "missing")], "missing"),
            (["--engine", str(engine_dir), "--voices", str(bad_voices)], "needs exactly one reference"),
            (["--engine", str(engine_dir), "--ref-dir", str(tmp_path / "nowhere")], "--ref-dir"),
            (["--engine", str(engine_dir), "--timeout", "0"], "--timeout"),
            (["--engine", str(engine_dir), "--max-batch", "0"], "--max-batch"),
            (["--engine", str(engine_dir), "--precision", "fp8"], "holds bf16 engines"),
            (["--checkpoint", str(tiny_ckpt), "--backend", "torch", "--device", "cpu", "--precision", "fp8"],
             "does not apply"),
            (["--engine", str(engine_dir), "--backend", "torch", "--device", "cpu"], "needs --checkpoint"),
            (["--engine", str(engine_dir), "--codec-precision", "tf32"], "--codec-precision applies to the GPU engine"),
            (["--checkpoint", str(tiny_ckpt), "--backend", "torch", "--device", "cpu", "--codec-precision", "fp16"],
             "the CPU reference decodes audio in fp32"),
            (["--engine", str(engine_dir), "--first-chunk", "0"], "--first-chunk must be at least 1 frame, got 0"),
            (["--engine", str(engine_dir), "--context", "500"], "(--context 500 + chunk 25 + --holdback 10) exceeds the codec's 128-frame limit"),
            (["--engine", str(engine_dir), "--port", str(port)], "cannot listen"),
            (["--engine", str(engine_dir), "--host", ""], "--host is empty"),  # listened on every interface
            (["--checkpoint", str(tiny_ckpt), "--backend", "torch", "--device", "cpu", "--lanes", "1"],
             "needs an engine that can move a request between slots"),
        ]
        for args, words in cases:
            r = CliRunner().invoke(main, ["serve", *args])
            assert r.exit_code == 1 and "Traceback" not in r.output, (args, r.output)
            assert r.output.strip().splitlines()[-1].startswith("Error:") and words in r.output, (args, r.output)
            assert "listening on" not in r.output, (args, r.output)  # refused before the server starts


def test_an_engine_that_fails_to_load_ends_the_server_with_its_error(engine_dir, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU, where the GPU engine cannot load")
    r = subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", "serve", "--engine", str(engine_dir),
                        "--backend", "torch", "--device", "cuda", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "Error: --device cuda needs torch built with CUDA and an NVIDIA GPU"


# ---- load ----------------------------------------------------------------------------------------------------------

VALID = [  # (fields, solo key): short requests of every kind
    (dict(input=TEXT, seed=1, max_new_tokens=40, response_format="pcm"), (TEXT, 1, 40)),
    (dict(input=LONG, seed=2, max_new_tokens=56, response_format="wav"), (LONG, 2, 56)),
    (dict(input="Wait, what? No way!", seed=3, max_new_tokens=30, stream_format="sse", response_format="pcm"),
     ("Wait, what? No way!", 3, 30)),
    (dict(input="Numbers: one, two, three.", seed=4, max_new_tokens=48, response_format="flac"),
     ("Numbers: one, two, three.", 4, 48)),
    (dict(input=TEXT, seed=5, max_new_tokens=36, response_format="pcm", voice="coded"),
     (TEXT, 5, 36, "coded", "Some words.")),
    (dict(input="She sells sea shells.", seed=6, max_new_tokens=44, response_format="pcm", temperature=0.0),
     ("She sells sea shells.", 6, 44, None, None, 0.0)),
]
DISCONNECTS = 4


async def _send(client, kind, i):
    """(kind, index, status, body or error payload)."""
    if kind == "disconnect":
        async with client.stream("POST", SPEECH, json=body(input=LONG, seed=LONG_SEED, max_new_tokens=900,
                                                           response_format="pcm")) as r:
            async for piece in r.aiter_raw():
                if piece:
                    break
            return kind, i, r.status_code, None
    if kind == "valid":
        fields = VALID[i][0]
        async with client.stream("POST", SPEECH, json=body(**fields)) as r:
            data = await r.aread()
        if r.status_code == 200 and fields.get("stream_format") == "sse":
            events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]
            assert events[-1]["type"] == "speech.audio.done", events[-1]
            data = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
        elif r.status_code == 200 and fields["response_format"] == "wav":
            assert data[:44] == WAV_HEADER
            data = data[44:]
        elif r.status_code == 200 and fields["response_format"] == "flac":
            data = soundfile.read(io.BytesIO(data), dtype="int16")[0].tobytes()
        return kind, i, r.status_code, data
    payload = BAD[i][0]
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = await client.post(SPEECH, content=content, headers={"Content-Type": "application/json"})
    return kind, i, r.status_code, r.json()


async def _load(url, jobs, concurrency):
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        todo = iter(jobs)

        async def worker():
            for kind, i in todo:
                results.append(await _send(client, kind, i))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def test_load_200_requests_at_concurrency_16(engine_dir, refs, solo, long_request, tmp_path):
    expected = {i: solo.run(*key)[0] for i, (_, key) in enumerate(VALID)}
    s = Server(engine_dir, tmp_path / "load.log", "--voices", refs["voices"], "--max-queue", 64)
    try:
        # settle: one of each valid kind and one oversize body, so the allocations they make once are not "growth"
        asyncio.run(_load(s.url, [("valid", i) for i in range(len(VALID))] + [("bad", len(BAD) - 1)], 4))
        s.wait_idle()
        before_mb, before = s.rss_mb(), s.metrics()

        rng = random.Random(0)
        bad = [("bad", i) for i in range(len(BAD))]  # every kind of the one-by-one test once
        valid = [("valid", i % len(VALID)) for i in range(200 - len(BAD) - DISCONNECTS)]
        jobs = bad + valid + [("disconnect", i) for i in range(DISCONNECTS)]
        rng.shuffle(jobs)
        t0 = time.perf_counter()
        results = asyncio.run(_load(s.url, jobs, 16))
        seconds = time.perf_counter() - t0
        after = s.wait_idle()
        after_mb = s.rss_mb()
    finally:
        assert s.stop() == 0, s.output()

    assert len(results) == 200
    assert not [r for r in results if r[2] >= 500], "5xx responses"
    for kind, i, status, data in results:
        if kind == "valid":
            assert status == 200 and data == expected[i], (i, status)
        elif kind == "bad":
            check_bad(status, data, BAD[i][1], BAD[i][2])
        else:
            assert status == 200
    count = {k: sum(r[0] == k for r in results) for k in ("valid", "bad", "disconnect")}
    assert count == {"valid": 200 - len(BAD) - DISCONNECTS, "bad": len(BAD), "disconnect": DISCONNECTS}
    delta = {k: metric(after, k) - metric(before, k) for k in after}
    assert delta['higgs_requests_total{outcome="completed"}'] == count["valid"]
    assert delta['higgs_requests_total{outcome="cancelled"}'] == DISCONNECTS
    assert after["higgs_busy_slots"] == 0 and after["higgs_queue_depth"] == 0
    growth = after_mb - before_mb
    print(f"load: 200 requests ({count['valid']} valid, all bit-exact with their solo runs; {len(BAD)} malformed; "
          f"{DISCONNECTS} disconnects) at concurrency 16 in {seconds:.1f} s; server RSS {before_mb:.1f} → {after_mb:.1f} MB ({growth:+.1f} MB)")
    assert growth <= 50
