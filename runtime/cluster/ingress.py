"""The engine seam (runtime/server/engine_thread.py) over Ray Serve replicas: `serve --cluster` hands this to the same
SpeechService and routes that one process serves with, so the API has one implementation.

Ray lives on a thread of its own from start-up to teardown: the processes of a private cluster are bound to the
thread that started them (Linux's parent-death signal), and /health answers `loading` while it starts: join or start
Ray, deploy the replicas and wait until each has loaded and warmed its engine, learn the engine's limits from one of
them, encode the recorded voices of --voices on a replica; then wait for stop().

Voices live here, in the ingress's store: each order carries its voice's codes, so a voice uploaded at the ingress
reaches every replica with the first request that names it.
"""

import asyncio
import dataclasses
import hashlib
import logging
import threading

import numpy as np
from prometheus_client import Gauge, generate_latest

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.longform import Reference
from higgs_trt.runtime.server.engine_thread import Order
from higgs_trt.runtime.server.metrics import Metrics
from higgs_trt.runtime.server.voices import prepare_voices

from .deploy import ClusterSettings, connect, deploy, restore_sigterm, teardown
from .job import RemoteJob, raised
from .metrics import ReplicaLabelled
from .replica import Pin, Refused, ReplicaInfo

log = logging.getLogger("uvicorn.error")
PINNED_CALL_S = 5.0  # a replica that does not answer /health's or /metrics' call within this is left out of it

# The request router of each app this process deploys, by app (Ray builds it inside the deployment handle, and it
# enters itself here: routing.py).
ROUTERS: dict = {}


def affinity(voice: Reference, cast: dict[str, Reference]) -> str | None:
    """A digest of an order's references (None for zero-shot): the router keeps the orders of one voice (a name, the
    same ref_audio or ref_codes, a dialogue's cast) on the replica whose prefix cache holds it."""
    references = [voice, *(cast[k] for k in sorted(cast))]
    if all(r.codes is None for r in references):
        return None
    digest = hashlib.blake2b(digest_size=16)
    for r in references:
        digest.update(b"-" if r.codes is None else np.ascontiguousarray(r.codes, np.int32).tobytes())
        digest.update(b"\0" + (r.text or "").encode() + b"\0")
    return digest.hexdigest()


class ClusterEngine:
    def __init__(self, settings: ClusterSettings, open_thread, app: str, voices: dict, tokenizer, say):
        """`open_thread`: a picklable recipe for a replica's EngineThread; `app`: the Serve application's name."""
        self.settings, self.open_thread, self.app, self.voices, self.tokenizer = settings, open_thread, app, voices, tokenizer
        self.say = say
        self.ready = threading.Event()
        self.failure: str | None = None
        self.on_failure = lambda: None
        self.spec = self.no_encoder = self.handle = None
        self.max_queue = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.described: dict[str, ReplicaInfo] = {}
        self.stopping = threading.Event()
        self.owner = threading.Thread(target=self._run, name="higgs-cluster", daemon=True)
        self.metrics = Metrics()  # the ingress's own: refusals and admission; the rest is counted on the replicas
        Gauge("higgs_replicas", "Live engine replicas", registry=self.metrics.registry).set_function(
            lambda: len(self.replicas()))

    def start(self) -> None:
        """From the app's lifespan, on the event loop's (main) thread."""
        self.loop = asyncio.get_running_loop()
        self.owner.start()

    def _run(self) -> None:
        try:
            if self._start():
                self.stopping.wait()
        finally:
            teardown(self.settings, self.app)

    def _start(self) -> bool:
        s = self.settings
        try:
            self.say(f"joining the Ray cluster at {s.address}…" if s.address else "starting a private Ray cluster…")
            connect(s)
            self.loop.call_soon_threadsafe(restore_sigterm)
            if self.stopping.is_set():  # SIGTERM while Ray started: nothing to deploy
                return False
            self.say(f"deploying {s.replicas} engine replica(s) ({s.replica_cpus:g} CPU, {s.replica_gpus:g} GPU "
                     "each); each loads and warms its engine…")
            self.handle = deploy(s, self.open_thread, self.app)
            info = self.handle.describe.remote().result()
            self.spec, self.max_queue, self.no_encoder = info.spec, info.max_queue, info.no_encoder
            encode = self._encode_now if self.no_encoder is None else None
            prepare_voices(self.voices, encode, self.no_encoder, self.spec, self.tokenizer)
        except Exception as e:  # Ray's and Serve's errors as much as ours: the server ends with this line
            if not self.stopping.is_set():
                self._fail(str(e) if isinstance(e, HiggsError) else f"the cluster did not start: "
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", e)
            return False
        self.say(f"cluster ready: {len(self.replicas())} replica(s) of the {self.spec.name} backend, "
                 f"{self.spec.max_batch} slots each")
        self.ready.set()
        return True

    def _fail(self, message: str, error: Exception) -> None:
        if not isinstance(error, HiggsError):
            log.error("%s", message, exc_info=error)
        self.failure = message
        self.on_failure()

    def _encode_now(self, audio):
        codes = self.handle.encode.remote(audio).result()
        if isinstance(codes, Refused):
            raise raised(codes)
        return codes

    # ---- the seam ----------------------------------------------------------------------------------------------------

    def replicas(self) -> list[str]:
        """The live replicas, as the router sees them (Serve's view, less those it saw die)."""
        router = ROUTERS.get(self.app)
        return sorted(r.unique_id for r in router.curr_replicas.copy()) if router is not None else []

    @property
    def capacity(self) -> int:
        return max(len(self.replicas()), 1) * (self.max_queue + self.spec.max_batch)

    async def encode(self, audio):
        codes = await self.handle.encode.remote(audio)
        if isinstance(codes, Refused):
            raise raised(codes)
        return codes

    async def submit(self, order: Order, limit: int | None = None, on_overflow=None) -> RemoteJob:
        order = dataclasses.replace(order, affinity=affinity(order.voice, order.cast))
        job = RemoteJob(self.handle, self.handle.options(stream=True).speak.remote(order), limit, on_overflow)
        await job.accept(order.seconds)
        return job

    async def _pinned(self, method: str, replica: str):
        """A call to one replica; None if it does not answer within PINNED_CALL_S (or is gone)."""
        try:
            return await asyncio.wait_for(getattr(self.handle, method).remote(Pin(replica)), PINNED_CALL_S)
        except Exception as e:  # gone, or too slow: /health and /metrics go on without it
            log.warning("replica %s did not answer %s: %s", replica, method, type(e).__name__)
            return None

    async def health(self) -> tuple[int, dict]:
        """`ok` with at least the minimum of replicas alive, else `degraded` (200 while any serves, else 503)."""
        live = self.replicas()
        self.described = {r: info for r, info in self.described.items() if r in live}
        for replica in live:
            if replica not in self.described:
                info = await self._pinned("describe", replica)
                if info is not None:
                    self.described[replica] = info
        replicas = [{"replica": r, "pid": i.pid, "node": i.node} for r in live if (i := self.described.get(r))]
        minimum = self.settings.minimum
        return (200 if live else 503), {"status": "ok" if len(live) >= minimum else "degraded",
                                        "backend": self.spec.name, "slots": self.spec.max_batch * len(live),
                                        "replicas": replicas, "min_replicas": minimum}

    async def exposition(self) -> bytes:
        live = self.replicas()
        families = await asyncio.gather(*(self._pinned("metric_families", r) for r in live))
        return generate_latest(ReplicaLabelled(self.metrics.registry,
                                               {r: f for r, f in zip(live, families) if f is not None}))

    def stop(self) -> None:
        """After the server drained: the replicas go and, for a private cluster, Ray itself."""
        self.stopping.set()
        self.owner.join(timeout=60)
