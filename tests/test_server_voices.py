"""The server's long texts, dialogue, voices as a resource and API key, against a live `higgs-trt serve` on the tiny ORT
engine: a long text equals `higgs-trt run --text-file` sample for sample, voices round-trip through the API and the
files a restart reads, and every bad input is one clear error that stores nothing."""

import io
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import soundfile
from serving import Server, body

from higgs_trt.runtime.server.speech_api import MODEL_ID

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
SENTENCES = " ".join(f"Sentence {i} is here." for i in range(32))
ROWS = 16  # max_new_tokens: rows per segment


@pytest.fixture(scope="module")
def recording() -> bytes:
    t = np.arange(int(1.5 * 24000)) / 24000
    audio = (0.3 * np.sin(2 * np.pi * 150 * t * (1 + 0.2 * np.sin(2 * t)))).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, audio, 24000, format="WAV")
    return out.getvalue()


@pytest.fixture(scope="module")
def voices(tmp_path_factory):
    directory = tmp_path_factory.mktemp("voices")
    np.save(directory / "alice.npy", np.random.default_rng(5).integers(0, 1024, (15, 8)).astype(np.int32))
    (directory / "alice.txt").write_text("Alice here.")
    return directory


@pytest.fixture(scope="module")
def server(serve_engine, voices, tmp_path_factory):
    s = Server(serve_engine, tmp_path_factory.mktemp("log") / "server.log", "--voices", voices, "--api-key", KEY,
               "--max-input-chars", 20000, "--history", 1)
    yield s
    assert s.stop() == 0, s.output()


def speech(server, timeout=120, **fields) -> httpx.Response:
    return httpx.post(server.url + "/v1/audio/speech", json=body(**fields), headers=AUTH, timeout=timeout)


def run_cli(engine, tmp_path, *args) -> bytes:
    out = tmp_path / "run.wav"
    r = subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", "run", "--engine", str(engine), "--out", str(out),
                        *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out.read_bytes()


def samples(wav: bytes) -> np.ndarray:
    return soundfile.read(io.BytesIO(wav), dtype="int16")[0]


# ---- the API key -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["none", "wrong", "not-bearer"])
def test_every_route_but_health_needs_the_key(server, headers):
    for method, path in (("POST", "/v1/audio/speech"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("GET", "/v1/audio/voices"), ("DELETE", "/v1/audio/voices/alice")):
        r = httpx.request(method, server.url + path, headers=headers, json=body(input="Hi."))
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/health").status_code == 200
    assert "alice" in httpx.get(server.url + "/v1/audio/voices", headers=AUTH).json()["voices"]


def test_the_openai_client_sends_the_key_and_a_wrong_one_is_refused(server):
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.audio.speech.create(model=MODEL_ID, voice="default", input="Hi there.").read()[:4] == b"RIFF"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.audio.speech.create(model=MODEL_ID, voice="default", input="Hi there.")


# ---- long texts and dialogue ----------------------------------------------------------------------------------------

def test_a_long_text_is_spoken_as_run_speaks_it(server, serve_engine, tmp_path):
    """32 segments over HTTP and from `run --text-file`: the same samples (the stream's audio has no seam:
    tests/test_longform.py)."""
    r = speech(server, input=SENTENCES, seed=3, max_new_tokens=ROWS)
    assert r.status_code == 200, r.text
    (tmp_path / "text.txt").write_text(SENTENCES)
    local = run_cli(serve_engine, tmp_path, "--text-file", tmp_path / "text.txt", "--seed", 3, "--history", 1,
                    "--max-new-tokens", ROWS)
    assert np.array_equal(samples(r.content), samples(local))
    assert len(samples(r.content)) > 32 * 960


def test_dialogue_gives_each_turn_its_voice(server, serve_engine, voices, tmp_path):
    text = "[S1] Hello there. How are you? [S2] Fine, thanks."
    r = speech(server, input=text, speakers={"S1": "alice", "S2": "default"}, seed=5, max_new_tokens=ROWS)
    assert r.status_code == 200, r.text
    local = run_cli(serve_engine, tmp_path, "--text", text, "--voices", voices, "--speaker", "S1=alice",
                    "--speaker", "S2=default", "--seed", 5, "--history", 1, "--max-new-tokens", ROWS)
    assert np.array_equal(samples(r.content), samples(local))


@pytest.mark.parametrize("fields, param, words", [
    ({"input": "[S1] Hi."}, "input", "needs a `speakers` mapping"),
    ({"input": "[S1] Hi. [S2] Yo.", "speakers": {"S1": "alice"}}, "input", "[S2] is not mapped"),
    ({"input": "Hi. [S1] Yo.", "speakers": {"S1": "alice"}}, "input", "text before the first speaker tag"),
    ({"input": "[S1] Hi.", "speakers": {"S1": "nobody"}}, "speakers", "no voice 'nobody'"),
    ({"input": "[S1] Hi.", "speakers": {"Alice": "alice"}}, "speakers", "named S1 to S99"),
    ({"input": "[S1] Hi.", "speakers": {}}, "speakers", "maps tags to voice names"),
    ({"input": "[S1] Hi.", "speakers": {"S1": "alice"}, "voice": "alice"}, "speakers", "leave voice"),
    ({"input": "x" * 20001}, "input", "at most 20000"),
])
def test_bad_dialogue_and_text_are_one_error_naming_the_field(server, fields, param, words):
    r = speech(server, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"], \
        r.text


@pytest.mark.parametrize("text", ["word" * 900, "[S1]   [S2] Only the second speaks."],
                         ids=["one-long-word", "an-empty-turn"])
def test_odd_but_valid_texts_are_spoken(server, text):
    fields = {"speakers": {"S1": "alice", "S2": "default"}} if "[S1]" in text else {}
    r = speech(server, input=text, max_new_tokens=ROWS, **fields)
    assert r.status_code == 200 and r.content[:4] == b"RIFF", r.text


# ---- voices as a resource ------------------------------------------------------------------------------------------

def upload(server, files=None, data=None, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + "/v1/audio/voices", files=files, data=data, headers=headers, timeout=60)


def test_a_voice_round_trips_create_list_use_delete(server, voices, recording):
    r = upload(server, files={"audio": ("me.wav", recording, "audio/wav")},
               data={"name": "carol", "transcript": "Carol speaking."})
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "carol" and r.json()["transcript"] == "Carol speaking." and r.json()["seconds"] > 1
    assert (voices / "carol.npz").is_file() and not list(voices.glob(".carol*"))
    listed = httpx.get(server.url + "/v1/audio/voices", headers=AUTH).json()
    assert "carol" in listed["voices"] and any(v["name"] == "carol" for v in listed["data"])
    assert httpx.get(server.url + "/v1/audio/voices/carol", headers=AUTH).json()["stored"] == ["carol.npz"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.audio.speech.create(model=MODEL_ID, voice="carol", input="Hello.").read()[:4] == b"RIFF"
    assert upload(server, files={"audio": ("me.wav", recording, "audio/wav")}, data={"name": "carol"}).status_code \
        == 409
    r = upload(server, files={"audio": ("me.wav", recording, "audio/wav")}, data={"name": "carol", "replace": "true"})
    assert r.status_code == 201 and r.json()["transcript"] is None
    assert httpx.delete(server.url + "/v1/audio/voices/carol", headers=AUTH).json() == {"deleted": "carol"}
    assert not (voices / "carol.npz").exists()
    assert httpx.get(server.url + "/v1/audio/voices/carol", headers=AUTH).status_code == 404
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model=MODEL_ID, voice="carol", input="Hello.")


def test_an_uploaded_voice_is_read_back_at_the_next_start(serve_engine, voices, recording, tmp_path):
    """What the API stores is what a restart loads: the same codes and transcript."""
    first = Server(serve_engine, tmp_path / "a.log", "--voices", voices, "--api-key", KEY)
    try:
        made = upload(first, files={"audio": ("d.wav", recording, "audio/wav")},
                      data={"name": "dave", "transcript": "Dave."}).json()
    finally:
        assert first.stop() == 0
    second = Server(serve_engine, tmp_path / "b.log", "--voices", voices, "--api-key", KEY)
    try:
        assert httpx.get(second.url + "/v1/audio/voices/dave", headers=AUTH).json() == made
        assert httpx.delete(second.url + "/v1/audio/voices/dave", headers=AUTH).status_code == 200
    finally:
        assert second.stop() == 0


@pytest.mark.parametrize("case, status, words", [
    ("no name", 400, "name is required"),
    ("bad name", 400, "a voice name is"),
    ("default", 400, "a voice name is"),
    ("exists", 409, "exists; send replace=true"),
    ("no audio", 400, "audio is required"),
    ("not audio", 400, "audio"),
    ("too short", 400, "needs at least 1 s"),
    ("unknown field", 400, "unknown field 'colour'"),
    ("not multipart", 400, "multipart/form-data"),
    ("bad replace", 400, "replace must be true or false"),
    ("bad transcript", 400, "<|eoc|>"),
    ("oversized", 413, "at most"),
])
def test_a_bad_upload_is_one_error_and_stores_nothing(server, voices, recording, case, status, words):
    before = sorted(p.name for p in voices.iterdir())
    wav = ("v.wav", recording, "audio/wav")
    requests = {
        "no name": dict(files={"audio": wav}),
        "bad name": dict(files={"audio": wav}, data={"name": "a b"}),
        "default": dict(files={"audio": wav}, data={"name": "default"}),
        "exists": dict(files={"audio": wav}, data={"name": "alice"}),
        "no audio": dict(files={"name": (None, "eve")}),
        "not audio": dict(files={"audio": ("v.wav", b"RIFF nonsense", "audio/wav")}, data={"name": "eve"}),
        "too short": dict(files={"audio": ("v.wav", recording[:44 + 24000], "audio/wav")}, data={"name": "eve"}),
        "unknown field": dict(files={"audio": wav}, data={"name": "eve", "colour": "red"}),
        "not multipart": dict(data=None, files=None),
        "bad replace": dict(files={"audio": wav}, data={"name": "eve", "replace": "yes"}),
        "bad transcript": dict(files={"audio": wav}, data={"name": "eve", "transcript": "x <|eoc|>"}),
        "oversized": dict(files={"audio": ("v.wav", b"\0" * (17 << 20), "audio/wav")}, data={"name": "eve"}),
    }
    r = upload(server, **requests[case])
    assert r.status_code == status and words in r.json()["error"]["message"], (case, r.status_code, r.text)
    assert sorted(p.name for p in voices.iterdir()) == before
    assert "eve" not in httpx.get(server.url + "/v1/audio/voices", headers=AUTH).json()["voices"]


def test_deleting_a_voice_that_is_not_there_is_404(server):
    for name in ("nobody", "default"):
        r = httpx.delete(server.url + f"/v1/audio/voices/{name}", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"
