"""Ray and Serve around the engine replicas: joining or starting the cluster, the deployment's options, and the
teardown that leaves nothing behind (docs/cluster.md has the settings a deployment keeps and why)."""

import logging
import re
import signal
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from higgs_trt.runtime.errors import HiggsError

from .replica import EngineReplica
from .routing import VoiceAffinityRouter

# Serve's per-request access lines off; its warnings (a replica that crashed, one being replaced) still reach stderr.
SERVE_LOGGING = {"enable_access_log": False, "log_level": "WARNING"}
HEALTH_CHECK_S = 2.0  # a replica whose engine failed is replaced within about this
# Ongoing calls a replica takes beyond its slots and queue: text streams awaiting text (they hold neither) and pinned
# calls (metrics, an utterance's text). Past slots + queue, a replica refuses speech itself (429), as one process does.
EXTRA_CALLS = 64
# Serve gives up a deployment none of whose replicas ever started after this many failed constructors (later, it
# retries a replica for ever): an engine that does not load is not loaded again, minutes each on a GPU.
START_ATTEMPTS = 1
REPLICA_ERROR = re.compile(rf"^{re.escape(HiggsError.__module__)}\.HiggsError: (.*)$", re.MULTILINE)


@dataclass(frozen=True)
class ClusterSettings:
    replicas: int = 1  # the number of replicas; with autoscaling, the number to start with
    min_replicas: int | None = None  # autoscaling between these two, when max_replicas is given
    max_replicas: int | None = None
    target_streams: float | None = None  # autoscaling: streams per replica to aim at (Ray's target_ongoing_requests)
    address: str | None = None  # a running Ray cluster (`ray start`); None: a private one on this machine
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0  # 1 on a GPU: one engine per GPU
    affinity_bound: int = 8
    max_ongoing: int = 1024  # the ongoing calls one replica takes (its slots, queue and EXTRA_CALLS)
    drain_s: float = 300.0  # a replica being scaled down finishes its streams within this (the request timeout)

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def minimum(self) -> int:
        """Fewer live replicas than this is `degraded` at /health."""
        return self.min_replicas if self.autoscaling else self.replicas


def connect(settings: ClusterSettings) -> None:
    """Join the cluster at `address`, or start a private one here: no dashboard (nothing to expose), Ray's own
    driver logging at errors only (the serve command says what it does)."""
    if settings.address:
        ray.init(address=settings.address, logging_level=logging.ERROR)
    else:  # "local": a new cluster even when `ray start` left one running on this machine
        ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(proxy_location="Disabled", logging_config=SERVE_LOGGING)  # the ingress is ours: no Serve HTTP proxy


def restore_sigterm() -> None:
    """Ray's core worker, once connected, installs a crash handler for SIGTERM in this process that prints a stack dump
    before passing the signal on: the server's own handler (a drain) is put back in its place. Main thread only."""
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))


def application(settings: ClusterSettings, open_thread, app: str):
    """The engine deployment, bound to `open_thread` (a picklable recipe for each replica's EngineThread)."""
    router = RequestRouterConfig(request_router_class=VoiceAffinityRouter,
                                 request_router_kwargs={"bound": settings.affinity_bound, "app": app})
    options = {"ray_actor_options": {"num_cpus": settings.replica_cpus, "num_gpus": settings.replica_gpus},
               "max_ongoing_requests": settings.max_ongoing, "request_router_config": router,
               "health_check_period_s": HEALTH_CHECK_S, "graceful_shutdown_timeout_s": settings.drain_s,
               "max_constructor_retry_count": START_ATTEMPTS}
    if settings.autoscaling:
        options["autoscaling_config"] = {"min_replicas": settings.min_replicas, "max_replicas": settings.max_replicas,
                                         "initial_replicas": settings.replicas,
                                         "target_ongoing_requests": settings.target_streams}
    else:
        options["num_replicas"] = settings.replicas
    return serve.deployment(EngineReplica, **options).bind(open_thread)


def deploy(settings: ClusterSettings, open_thread, app: str):
    """Deploy (or replace) the app and wait until every replica's engine is loaded and warmed: its handle. An engine
    that fails to load ends it with the engine's own message, as in one process (Serve keeps a replica's traceback as
    text in the deployment's status)."""
    try:
        return serve.run(application(settings, open_thread, app), name=app, route_prefix=None,
                         logging_config=SERVE_LOGGING)
    except RuntimeError:
        messages = [d.message for d in serve.status().applications[app].deployments.values()]
        why = [m for message in messages for m in REPLICA_ERROR.findall(message)]
        if why:
            raise HiggsError(why[-1]) from None
        raise


def teardown(settings: ClusterSettings, app: str) -> None:
    """A private cluster goes entirely (Ray stops every process it started); in a shared one the app goes, the
    cluster stays."""
    if ray.is_initialized():
        if settings.address:
            serve.delete(app)
        ray.shutdown()
