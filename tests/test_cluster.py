"""`serve --cluster` on a private Ray cluster of this machine (issue 52): two replicas of the tiny ORT engine behind
one ingress, started once for the module, beside a single-process server on the same engine as the reference. Ray's
CPU requests total 1.0 (0.5 a replica) of the machine's 2, so a replacement replica is scheduled while the others run.

Asserted: the `openai` client, SSE, flac, a named voice and the WebSocket get byte for byte what one process gives;
sixteen streams at once all complete, spread over both replicas; a voice stays on its replica until that one is busier
than the other by more than the bound, and an uploaded voice is served by both; /metrics carries each replica's
figures under its label; `bench serve` sets the two servers side by side; a replica SIGKILLed under load cuts only its
own streams (503 for those it had not started, an error event for SSE), nothing hangs, /health says degraded and the
replica is back within 60 s; SIGTERM drains, exits 0 and leaves no Ray process. Ray settings the tests change: usage
statistics off, the token from RAY_AUTH_TOKEN instead of ~/.ray/auth_token (token authentication stays on)."""

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from serving import Server, body
from websockets.sync.client import connect

from higgs_trt.runtime.cli import main

KEY = "cluster-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
TEXT = "Hello there, how are you today?"
LONG = ("This one goes on and on for quite a while, so that a client can leave long before it ends, and a timeout can "
        "cut it well before the last of its many rows.")
SPEECH = "/v1/audio/speech"
REPLICA = "x-higgs-replica"


# ---- the command line refuses bad cluster options before anything starts -----------------------------------------

@pytest.mark.parametrize("args, error", [
    (["--replicas", "2"], "Error: --replicas applies with --cluster only"),
    (["--cluster", "--min-replicas", "2"], "Error: --min-replicas applies to autoscaling: give --max-replicas too"),
    (["--cluster", "--min-replicas", "3", "--max-replicas", "2"],
     "Error: --max-replicas must lie in 3..1024 (at least --min-replicas), got 2"),
    (["--cluster", "--replica-cpus", "0"], "Error: --replica-cpus must be a positive number of CPUs, got 0.0"),
])
def test_bad_cluster_options_are_one_error(serve_engine, args, error):
    r = CliRunner().invoke(main, ["serve", "--engine", str(serve_engine), "--port", "0", *args])
    assert r.exit_code == 1 and r.output.strip().splitlines()[-1] == error, r.output


def test_without_the_extra_the_error_names_it(serve_engine):
    block = ("import sys, importlib.abc\nclass Block(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] == 'ray':\n            raise ModuleNotFoundError(name=name)\n"
             "sys.meta_path.insert(0, Block())\nfrom higgs_trt.runtime.cli import main\n"
             f"main(['serve', '--engine', r'{serve_engine}', '--cluster', '--port', '0'])\n")
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        "Error: higgs-trt serve --cluster needs the 'cluster' extra (ray is not installed): "
        "pip install 'higgs-trt[cluster]'"), r.stderr


# ---- the servers ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def voices(tmp_path_factory) -> dict:
    """A voices directory (a recording, encoded at start-up, and a codes voice) and a recording to upload."""
    root = tmp_path_factory.mktemp("cluster-voices")
    t = np.arange(int(1.6 * 16000)) / 16000
    audio = (0.4 * np.sin(2 * np.pi * 180 * t * (1 + 0.3 * np.sin(3 * t)))).astype(np.float32)
    (root / "voices").mkdir()
    soundfile.write(root / "voices" / "sung.wav", audio, 16000)
    np.save(root / "voices" / "coded.npy", np.random.default_rng(3).integers(0, 1024, (20, 8)).astype(np.int32))
    (root / "voices" / "coded.txt").write_text("Some words.")
    soundfile.write(root / "upload.wav", audio[::-1].copy(), 16000)
    return {"root": root, "upload": (root / "upload.wav").read_bytes()}


def start(engine, voices, tmp_path_factory, name: str, *args) -> Server:
    """A server with its own copy of the voices (uploads go there)."""
    directory = shutil.copytree(voices["root"] / "voices", tmp_path_factory.mktemp(name) / "voices")
    return Server(engine, directory.parent / "server.log", "--voices", directory, "--api-key", KEY,
                  "--max-input-chars", 100000, *args)


@pytest.fixture(scope="module")
def single(serve_engine, voices, tmp_path_factory):
    s = start(serve_engine, voices, tmp_path_factory, "single")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def cluster(serve_engine, voices, tmp_path_factory):
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    try:
        # autoscaling held at two replicas: Serve's autoscaler runs, and keeps the number a killed replica leaves
        s = start(serve_engine, voices, tmp_path_factory, "cluster", "--cluster", "--min-replicas", 2, "--max-replicas",
                  2, "--target-streams", 4, "--replica-cpus", 0.5, "--affinity-bound", 1)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    yield s
    if s.proc.poll() is None:  # the last test stops it itself
        s.stop()
    s.log.close()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, **fields) -> httpx.Response:
    return httpx.post(server.url + SPEECH, json=body(**fields), headers=AUTH, timeout=120)


def sse_events(server, **fields) -> tuple[list, dict]:
    with httpx.stream("POST", server.url + SPEECH, json=body(stream_format="sse", **fields), headers=AUTH,
                      timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")], r.headers


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


# ---- one API ------------------------------------------------------------------------------------------------------

def test_the_openai_client_gets_the_same_bytes_from_the_cluster(single, cluster):
    def answers(server):
        c = client(server)
        wav = c.audio.speech.with_raw_response.create(model="higgs-audio-v3", voice="default", input=TEXT,
                                                      extra_body={"seed": 7})
        with c.audio.speech.with_streaming_response.create(
                model="higgs-audio-v3", voice="coded", input=TEXT, response_format="pcm",
                extra_body={"seed": 11, "max_new_tokens": 120, "temperature": 0.8}) as response:
            pcm = b"".join(response.iter_bytes())
        flac = c.audio.speech.create(model="higgs-audio-v3", voice="sung", input=TEXT, response_format="flac",
                                     extra_body={"seed": 5, "max_new_tokens": 60}).read()
        with pytest.raises(openai.BadRequestError) as refused:
            c.audio.speech.create(model="higgs-audio-v3", voice="alloy", input=TEXT)
        sse, _ = sse_events(server, input=LONG, seed=3, max_new_tokens=80, response_format="wav")
        return wav.content, wav.headers.get(REPLICA), pcm, flac, refused.value.body, sse

    expected, got = answers(single), answers(cluster)
    assert expected[1] is None and got[1] in {r["replica"] for r in health(cluster)["replicas"]}
    assert len(expected[0]) > 24000 and got[0] == expected[0]
    assert len(expected[2]) > 24000 and got[2:] == expected[2:]
    assert expected[-1][-1]["type"] == "speech.audio.done"
    voices = [httpx.get(s.url + "/v1/audio/voices", headers=AUTH).json() for s in (single, cluster)]
    assert voices[0] == voices[1] and voices[0]["voices"] == ["default", "coded", "sung"]
    assert httpx.post(cluster.url + SPEECH, json=body(input=TEXT)).status_code == 401


def test_a_websocket_utterance_sounds_as_it_does_in_one_process(single, cluster):
    def session(server):
        url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        frames = []
        with connect(url, additional_headers=AUTH, max_size=None) as ws:
            ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "seed": 11, "max_new_tokens": 16}))
            for piece in re.findall(r".{1,9}", LONG + " And then one more."):
                ws.send(json.dumps({"type": "input.text", "text": piece}))
            ws.send(json.dumps({"type": "input.done"}))
            while True:
                frame = ws.recv(timeout=120)
                frames.append(frame)
                if isinstance(frame, str) and json.loads(frame)["type"] in ("session.done", "error"):
                    return frames

    expected, got = session(single), session(cluster)
    assert json.loads(expected[-1])["type"] == "session.done" and got == expected


# ---- load and routing ---------------------------------------------------------------------------------------------

async def streams(server, requests: list[dict]) -> list[tuple[int, str | None, bytes]]:
    """Every request at once: (status, replica, body) of each."""
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
        async def one(fields):
            r = await c.post(SPEECH, json=body(**fields))
            return r.status_code, r.headers.get(REPLICA), r.content

        return await asyncio.gather(*(one(fields) for fields in requests))


def test_sixteen_streams_at_once_all_complete_on_both_replicas(single, cluster):
    requests = [{"input": TEXT, "seed": seed, "max_new_tokens": 40, "response_format": "pcm"} for seed in range(16)]
    expected, got = asyncio.run(streams(single, requests)), asyncio.run(streams(cluster, requests))
    assert [status for status, _, _ in got] == [200] * 16
    assert [audio for _, _, audio in got] == [audio for _, _, audio in expected]
    served = [replica for _, replica, _ in got]
    assert len(set(served)) == 2 and min(served.count(r) for r in set(served)) >= 4, served  # fewest streams first


def test_a_voice_stays_on_its_replica_until_that_is_busier_by_more_than_the_bound(single, cluster, voices):
    one_by_one = {voice: {post(cluster, input=TEXT, voice=voice, seed=s, max_new_tokens=20,
                               response_format="pcm").headers[REPLICA] for s in range(4)} for voice in ("coded", "sung")}
    assert all(len(replicas) == 1 for replicas in one_by_one.values()), one_by_one
    # an uploaded voice is the ingress's: its codes travel with each request, to whichever replica serves it
    for server in (single, cluster):
        r = httpx.post(server.url + "/v1/audio/voices", headers=AUTH, data={"name": "uploaded"},
                       files={"audio": ("u.wav", voices["upload"], "audio/wav")})
        assert r.status_code == 201, r.text
    requests = [{"input": LONG, "voice": "uploaded", "seed": s, "max_new_tokens": 200, "response_format": "pcm"}
                for s in range(6)]
    expected, got = asyncio.run(streams(single, requests)), asyncio.run(streams(cluster, requests))
    assert [(status, audio) for status, _, audio in got] == [(200, audio) for _, _, audio in expected]
    served = [replica for _, replica, _ in got]
    home = max(set(served), key=served.count)
    # --affinity-bound 1: the voice's replica takes a stream while it has at most one more than the other
    assert len(set(served)) == 2 and served.count(home) == 4, served


def test_metrics_carry_each_replica_under_its_label(cluster):
    text = httpx.get(cluster.url + "/metrics", headers=AUTH).text
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family appears twice"
    samples = {f.name: f.samples for f in families}
    replicas = {r["replica"] for r in health(cluster)["replicas"]}
    completed = {s.labels["replica"]: s.value for s in samples["higgs_requests"]
                 if s.name == "higgs_requests_total" and s.labels["outcome"] == "completed"}
    assert set(completed) == replicas and all(n > 0 for n in completed.values())
    assert {s.labels["replica"] for s in samples["higgs_busy_slots"]} == replicas
    assert samples["higgs_replicas"][0].value == 2
    refused = [s for s in samples["higgs_errors"] if s.name == "higgs_errors_total"]
    assert refused and all("replica" not in s.labels for s in refused)  # counted at the ingress


def test_bench_serve_sets_one_process_beside_the_cluster(single, cluster):
    r = CliRunner().invoke(main, ["bench", "serve", "--url", single.url, "--url", cluster.url, "--concurrency", "2",
                                  "--requests", "2", "--max-new-tokens", "30", "--wait", "10", "--api-key", KEY])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if "concurrency   2:" in line]
    assert [line.split(", concurrency")[0].split(" (")[1] for line in lines] == ["one process)", "cluster of 2)"]
    assert all("failed" not in line and re.search(r"; \d+ prefill calls", line) for line in lines), r.output
    assert re.search(r"concurrency 2 against .* \(one process\): .* \(cluster of 2\) [\d.]+× audio-s/s", r.output)


# ---- faults -------------------------------------------------------------------------------------------------------

def test_a_replica_killed_under_load_cuts_only_its_streams_and_comes_back(single, cluster):
    reference = post(single, input=LONG, seed=1, max_new_tokens=300, response_format="pcm").content
    before = {r["replica"]: r["pid"] for r in health(cluster)["replicas"]}
    victim = min(before)
    results, started = [], threading.Event()

    def stream(i: int):
        sse = i % 6 == 0
        fields = body(input=LONG, seed=1, max_new_tokens=300, response_format="pcm", **({"stream": True} if sse else {}))
        received, replica = b"", None
        try:
            with httpx.stream("POST", cluster.url + SPEECH, json=fields, headers=AUTH, timeout=60) as r:
                replica = r.headers.get(REPLICA)
                for piece in r.iter_bytes():
                    received += piece
                    if replica == victim:
                        started.set()
            results.append((r.status_code, replica, sse, received, None))
        except httpx.HTTPError as e:
            results.append((None, replica, sse, received, type(e).__name__))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    assert started.wait(60)
    os.kill(before[victim], signal.SIGKILL)
    statuses = []
    for t in threads:
        t.join(90)
        assert not t.is_alive(), "a request hangs"
        statuses.append(health(cluster)["status"])
    assert post(cluster, input=TEXT, seed=2, max_new_tokens=20, response_format="pcm").status_code == 200

    survivor = [r for r in results if r[1] is not None and r[1] != victim]
    assert survivor and all(r[0] == 200 and (r[2] or r[3] == reference) for r in survivor)
    cut = [r for r in results if r[1] == victim]
    assert cut, "the victim served none of the streams"
    for status, _, sse, received, error in cut:
        if sse:
            last = json.loads(received.decode().strip().split("\n\n")[-1][6:])
            assert last["type"] == "speech.audio.error" and last["error"]["code"] == "replica_lost", last
        else:
            assert error == "RemoteProtocolError" and 0 < len(received) < len(reference)
    unstarted = [r for r in results if r[1] is None]  # queued on the victim: answered before any audio
    assert all(r[0] == 503 and json.loads(r[3])["error"]["code"] == "replica_lost" for r in unstarted)

    deadline = time.monotonic() + 60
    while (h := health(cluster))["status"] != "ok" or len(h["replicas"]) < 2:
        statuses.append(h["status"])
        assert time.monotonic() < deadline, f"the replica is not back: {h}"
        time.sleep(0.2)
    assert "degraded" in statuses
    assert victim not in {r["replica"] for r in h["replicas"]} and before[victim] not in {r["pid"] for r in h["replicas"]}
    served = {replica for _, replica, _ in asyncio.run(streams(cluster, [
        {"input": LONG, "seed": s, "max_new_tokens": 60, "response_format": "pcm"} for s in range(4)]))}
    assert served == {r["replica"] for r in h["replicas"]}  # the new replica serves


def descendants(pid: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found - {pid}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_drains_exits_0_and_leaves_no_ray_process(single, cluster):
    """Last: it stops the cluster."""
    ray = descendants(cluster.proc.pid)
    assert any("raylet" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") for p in ray if alive(p))
    reference = post(single, input=LONG, seed=1, max_new_tokens=300, response_format="pcm").content
    with httpx.stream("POST", cluster.url + SPEECH, json=body(input=LONG, seed=1, max_new_tokens=300,
                                                              response_format="pcm"), headers=AUTH, timeout=60) as r:
        pieces = r.iter_bytes()
        received = next(pieces)
        cluster.proc.send_signal(signal.SIGTERM)
        received += b"".join(pieces)
    assert received == reference  # finished in full
    assert cluster.proc.wait(60) == 0, cluster.output()
    deadline = time.monotonic() + 15
    while left := [p for p in ray if alive(p)]:
        assert time.monotonic() < deadline, f"Ray processes left: {left}"
        time.sleep(0.2)
    assert "Traceback" not in cluster.output()
