"""A `higgs-trt serve` process for the tests, and the helpers that talk to it."""

import re
import resource
import signal
import socket
import subprocess
import sys
import time
from functools import partial

import httpx

from higgs_trt.runtime.server.speech_api import MODEL_ID


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, engine_dir, log_path, *args, open_files: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        limit = None if open_files is None else partial(resource.setrlimit, resource.RLIMIT_NOFILE, (open_files,) * 2)
        self.proc = subprocess.Popen([sys.executable, "-m", "higgs_trt.runtime.cli", "serve", "--engine",
                                      str(engine_dir), "--port", str(self.port), *map(str, args)],
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=limit)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server not ready:\n{self.output()}"
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        return {m[1]: float(m[2]) for m in re.finditer(r"^(higgs_\S+) (\S+)$", text, re.MULTILINE)
                if not m[1].endswith("_created")}

    def rss_mb(self) -> float:
        status = open(f"/proc/{self.proc.pid}/status").read()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024

    def wait_idle(self, timeout=30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["higgs_busy_slots"] == 0 and m["higgs_queue_depth"] == 0:
                return m
            assert time.monotonic() < deadline, f"slots still busy: {m}"
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def metric(m: dict, name: str) -> float:
    return m.get(name, 0.0)


def body(**fields) -> dict:
    return {"model": MODEL_ID, **fields}
