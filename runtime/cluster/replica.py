"""One engine replica: a Ray Serve deployment whose every replica owns an engine thread (runtime/server/
engine_thread.py), opened as `serve` opens one in a single process, and serves the ingress's orders on it.

A request is one streaming call, `speak(order)`, whose events are Accepted (or Refused), then Audio per chunk, then
Finished or Stopped. Exceptions never cross the wire as such: a refusal is a value the ingress raises again, so its
message reaches the client as the single-process server would word it. Pinned calls (`feed`, `describe`,
`metric_families`) name their replica in their first argument, which the router (routing.py) honours.
"""

import asyncio
import os
import uuid
from dataclasses import dataclass, field

import numpy as np
import ray
from ray import serve

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.server.audio_queue import Cut
from higgs_trt.runtime.server.engine_thread import EngineSpec, Order


@dataclass(frozen=True)
class Pin:
    """A call for one replica: the router sends it there or nowhere."""

    replica: str


@dataclass(frozen=True)
class ReplicaInfo:
    replica: str
    pid: int
    node: str
    spec: EngineSpec
    max_queue: int
    no_encoder: str | None


@dataclass(frozen=True)
class Refused:
    """What an engine refused, by the exception's class name (QueueFull, TextError, HiggsError, NotReady)."""

    kind: str
    message: str


@dataclass(frozen=True)
class Accepted:
    replica: str
    ticket: str  # names the job in later pinned calls (feed)
    input_tokens: int


@dataclass(frozen=True)
class Audio:
    samples: np.ndarray
    said: list[str] = field(default_factory=list)  # segments begun since the last event
    bounds: list[int] = field(default_factory=list)  # segment ends since the last event


@dataclass(frozen=True)
class Finished:
    total_rows: int
    prompt_tokens: int
    said: list[str]
    bounds: list[int]


@dataclass(frozen=True)
class Stopped:
    """The job's audio stopped early (timeout, engine failure): the ingress raises Cut(message, code)."""

    message: str
    code: str


class EngineReplica:
    """The deployment's class: `open_thread()` builds this replica's EngineThread (the CLI's recipe, run here)."""

    def __init__(self, open_thread):
        """Returns once the engine is loaded and warmed: Serve routes to the replica only then. An engine that fails
        to load fails the replica (the ingress reports the message at start-up; later, Serve retries)."""
        self.id = serve.get_replica_context().replica_id.unique_id
        self.thread = open_thread()
        self.thread.start()
        self.jobs: dict = {}
        while not self.thread.ready.wait(0.5):
            if self.thread.failure:
                raise HiggsError(self.thread.failure)

    def check_health(self) -> None:
        """Serve's periodic check: an engine that failed while serving gets its replica replaced."""
        if self.thread.failure:
            raise HiggsError(self.thread.failure)

    def describe(self, pin: Pin | None = None) -> ReplicaInfo:
        node = ray.get_runtime_context().get_node_id()
        return ReplicaInfo(self.id, os.getpid(), node, self.thread.spec, self.thread.max_queue, self.thread.no_encoder)

    def metric_families(self, pin: Pin) -> list:
        return list(self.thread.metrics.registry.collect())

    async def encode(self, audio) -> np.ndarray | Refused:
        try:
            return await self.thread.encode(audio)
        except HiggsError as e:
            return Refused(type(e).__name__, str(e))

    async def feed(self, pin: Pin, ticket: str, text: str, flush: bool, finish: bool) -> Refused | None:
        job = self.jobs.get(ticket)
        if job is None:
            return Refused("Lost", "the utterance's job is gone from its replica")
        try:
            await job.feed(text, flush, finish)
        except HiggsError as e:
            return Refused(type(e).__name__, str(e))
        return None

    async def speak(self, order: Order):
        if not self.thread.ready.is_set():
            yield Refused("NotReady", f"the engine failed: {self.thread.failure}")
            return
        try:
            job = await self.thread.submit(order)
        except HiggsError as e:
            yield Refused(type(e).__name__, str(e))
            return
        ticket = uuid.uuid4().hex
        self.jobs[ticket] = job
        said = bounds = 0
        try:
            yield Accepted(self.id, ticket, job.input_tokens)
            async for samples in job.chunks(asyncio.get_running_loop().time() + order.seconds):
                yield Audio(samples, job.said[said:], job.bounds[bounds:])
                said, bounds = len(job.said), len(job.bounds)
            yield Finished(job.total_rows, job.prompt_tokens, job.said[said:], job.bounds[bounds:])
        except Cut as e:
            yield Stopped(str(e), e.code)
        finally:  # complete, stopped, or cancelled by the ingress (its client left): the slot is freed
            job.cancel()
            del self.jobs[ticket]
