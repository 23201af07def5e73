"""Text streamed in (runtime/server/text_stream.py, `run --text -`) against a live server on the tiny ORT engine: the
audio of a text sent in pieces equals that of the same text sent whole, it starts before the text is complete, and
clients that misbehave are cut off with one error while the server goes on."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from serving import Server, body
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

SENTENCES = " ".join(f"Sentence {i} is here." for i in range(12))
ROWS = 16
CONFIG = {"type": "session.config", "response_format": "pcm", "seed": 11, "max_new_tokens": ROWS}


@pytest.fixture(scope="module")
def server(serve_engine, tmp_path_factory):
    s = Server(serve_engine, tmp_path_factory.mktemp("log") / "server.log", "--max-input-chars", 100000)
    yield s
    assert s.stop() == 0, s.output()


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def pieces(text: str, n: int) -> list[str]:
    cuts = np.linspace(0, len(text), n + 1).astype(int)
    return [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def session(server, messages, pause: float = 0.0):
    """Send the messages (pausing between input.text ones), read every event and audio frame; (events, pcm bytes,
    the time of the first audio frame, the time the last message went)."""
    events, audio, first, sent = [], bytearray(), None, None
    with connect(ws_url(server), max_size=None) as ws:
        def write():
            nonlocal sent
            for message in messages:
                ws.send(json.dumps(message))
                if message["type"] == "input.text":
                    time.sleep(pause)
            sent = time.monotonic()

        writer = threading.Thread(target=write)
        writer.start()
        while True:
            frame = ws.recv(timeout=120)
            if isinstance(frame, bytes):
                first = first or time.monotonic()
                audio += frame
                continue
            event = json.loads(frame)
            events.append(event)
            if event["type"] in ("session.done", "error"):
                break
        writer.join()
    return events, bytes(audio), first, sent


def test_text_in_forty_pieces_sounds_like_the_whole_text_and_starts_early(server):
    messages = [CONFIG] + [{"type": "input.text", "text": p} for p in pieces(SENTENCES, 40)] + [{"type": "input.done"}]
    events, audio, first, sent = session(server, messages, pause=0.05)
    whole = httpx.post(server.url + "/v1/audio/speech", json=body(input=SENTENCES, response_format="pcm", seed=11,
                                                                   max_new_tokens=ROWS), timeout=120)
    assert whole.status_code == 200 and audio == whole.content
    assert first < sent, "the first segment's audio came only after the last of the text"
    starts = [e for e in events if e["type"] == "audio.start"]
    assert [e["sentence_text"] for e in starts] == [f"Sentence {i} is here." for i in range(12)]
    assert len([e for e in events if e["type"] == "audio.done"]) == 12
    done = events[-1]
    assert done["type"] == "session.done" and done["total_sentences"] == 12 and done["usage"]["output_tokens"] > 0


def test_flush_speaks_the_text_so_far_and_the_connection_serves_the_next_utterance(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps(CONFIG))
        ws.send(json.dumps({"type": "input.text", "text": "No sentence end here"}))
        ws.send(json.dumps({"type": "input.flush"}))
        event = json.loads(ws.recv(timeout=60))
        assert event == {"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                         "sentence_text": "No sentence end here", "format": "pcm"}
        ws.send(json.dumps({"type": "input.done"}))
        while (event := ws.recv(timeout=60)) and (isinstance(event, bytes) or json.loads(event)["type"] != "session.done"):
            pass
        ws.send(json.dumps({"type": "input.text", "text": "A second one."}))
        ws.send(json.dumps({"type": "input.done"}))
        starts = []
        while True:
            frame = ws.recv(timeout=60)
            if isinstance(frame, str):
                event = json.loads(frame)
                starts += [event] if event["type"] == "audio.start" else []
                if event["type"] == "session.done":
                    break
        assert starts[0]["utterance_index"] == 1 and starts[0]["sentence_text"] == "A second one."


def test_a_client_that_leaves_frees_its_slot(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({**CONFIG, "max_new_tokens": 2048}))
        ws.send(json.dumps({"type": "input.text", "text": SENTENCES * 20}))
        while not isinstance(ws.recv(timeout=60), bytes):  # its audio has started
            pass
    assert server.wait_idle(10)["higgs_busy_slots"] == 0


def test_a_client_that_never_reads_is_cut_off_with_memory_bounded(server):
    cancelled = 'higgs_requests_total{outcome="cancelled"}'
    before, cut_before = server.rss_mb(), server.metrics().get(cancelled, 0)
    with connect(ws_url(server), max_queue=1) as ws:  # the library stops reading once one frame waits
        ws.send(json.dumps({**CONFIG, "max_new_tokens": 2048}))
        ws.send(json.dumps({"type": "input.text", "text": SENTENCES * 40}))
        ws.send(json.dumps({"type": "input.done"}))
        deadline = time.monotonic() + 120
        while (m := server.metrics()).get(cancelled, 0) == cut_before or m["higgs_busy_slots"]:
            assert time.monotonic() < deadline, "the client that never reads was not cut off"
            time.sleep(0.5)
        assert server.rss_mb() - before < 200
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("messages, words, code", [
    (["not json"], "not valid JSON", 1008),
    ([{"type": "hello"}], "unknown message type 'hello'", 1008),
    ([{"type": "input.text", "text": "Hi."}], "before session.config", 1008),
    ([CONFIG, {"type": "input.text", "text": "Hi."}, CONFIG], "session.config during an utterance", 1008),
    ([CONFIG, {"type": "input.text", "text": "Hi."}, {"type": "input.done"}, {"type": "input.text", "text": "x"}],
     "after input.done", 1008),
    ([CONFIG, {"type": "input.text", "text": "x" * 70000}], "over 65536 bytes", 1009),
    ([{"type": "session.config", "input": "Hi."}], "but input", 1008),
    ([{"type": "session.config", "response_format": "mp3"}], "not mp3", 1008),
    ([{"type": "session.config", "voice": "nobody"}], "unknown voice", 1008),
    ([CONFIG, {"type": "input.text", "text": 5}], "must be a string", 1008),
    ([CONFIG, {"type": "input.text", "text": "[S1] Hi."}], "needs a `speakers` mapping", 1008),
])
def test_a_malformed_message_is_one_error_and_a_close(server, messages, words, code):
    with connect(ws_url(server)) as ws:
        for m in messages:
            ws.send(m if isinstance(m, str) else json.dumps(m))
        events = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                frame = ws.recv(timeout=60)
                if isinstance(frame, str):
                    events.append(json.loads(frame))
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and words in errors[0]["message"], events
    assert closed.value.rcvd.code == code
    assert httpx.get(server.url + "/health").status_code == 200


def test_run_reads_stdin_as_it_arrives_and_speaks_like_the_whole_text(serve_engine, tmp_path):
    """`… | higgs-trt run --text - --stream --out -`: text arriving slowly through a pipe gives the samples of the
    same text read from a file."""
    (tmp_path / "text.txt").write_text(SENTENCES)
    common = ["--engine", str(serve_engine), "--seed", "11", "--max-new-tokens", str(ROWS)]
    whole = subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", "run", *common, "--text-file",
                            str(tmp_path / "text.txt"), "--stream", "--out", "-"], capture_output=True)
    assert whole.returncode == 0, whole.stderr.decode()
    proc = subprocess.Popen([sys.executable, "-m", "higgs_trt.runtime.cli", "run", *common, "--text", "-", "--stream",
                             "--out", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for piece in pieces(SENTENCES, 30):
        os.write(proc.stdin.fileno(), piece.encode())
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert out == whole.stdout and len(out) > 12 * 960 * 2
