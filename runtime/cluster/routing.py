"""Which replica serves a request: a Ray Serve request router (one per deployment handle, in the ingress process).

- A call pinned to a replica (replica.Pin: an utterance's text, a replica's metrics) goes there, or waits.
- An order (a speech stream) goes to the replica with the fewest streams, unless it has a voice (its `affinity`, a
  digest of its references): then to that voice's own replica, where its prefix cache already holds the voice, as long
  as that replica has at most `bound` more streams than the least-loaded one.
- A voice's own replica is the first of the live replicas by rendezvous hashing of (voice, replica): no state to keep,
  and a replica lost or added moves only the voices it owned or now owns.
- Anything else (encoding reference audio) goes where Serve's queue-length cache says there is least to do.

Streams are counted here, the moment a replica is chosen for one, until Serve reports it finished: the ingress is the
replicas' only client, so the count is exact, and a burst of requests spreads at once (Serve's cached queue lengths
lag a burst by a round trip). Ray pickles this module by value into every process that routes, so it keeps no module
state of its own; a router enters itself in its process's ingress module (its live replicas are /health's).
"""

import hashlib
from collections import Counter

from ray.serve.request_router import RequestRouter


def rendezvous(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()


class VoiceAffinityRouter(RequestRouter):
    def initialize_state(self, bound: int, app: str) -> None:
        from higgs_trt.runtime.cluster import ingress  # by name, at run time: the module itself, not a pickled copy

        self.bound = bound
        self.streams: dict[str, tuple[str, object]] = {}  # request id → (its replica, its PendingRequest)
        ingress.ROUTERS[app] = self

    def _loads(self) -> Counter:
        loads = Counter()
        for key, (replica, request) in list(self.streams.items()):
            if request.future.cancelled():  # its caller gave up before it was sent
                del self.streams[key]
            else:
                loads[replica] += 1
        return loads

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        """Ranks of replicas, most wanted first: Serve sends to the first that has room."""
        order = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # the ranks cover every replica: then wait a while
        pinned = getattr(order, "replica", None)
        if pinned is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pinned]]
        if not hasattr(order, "affinity") or not candidate_replicas:
            return [candidate_replicas]
        loads = self._loads()
        ranked = sorted(candidate_replicas, key=lambda r: loads[r.replica_id.unique_id])
        if order.affinity is not None:
            home = max(ranked, key=lambda r: rendezvous(order.affinity, r.replica_id.unique_id))
            if loads[home.replica_id.unique_id] <= loads[ranked[0].replica_id.unique_id] + self.bound:
                ranked.remove(home)
                ranked.insert(0, home)
        self.streams[pending_request.metadata.internal_request_id] = (ranked[0].replica_id.unique_id, pending_request)
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        """Where the stream went, if the first choice had no room."""
        key = pending_request.metadata.internal_request_id
        if key in self.streams:
            self.streams[key] = (replica_id.unique_id, pending_request)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.streams.pop(internal_request_id, None)
