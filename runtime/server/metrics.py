"""The server's Prometheus metrics (`GET /metrics`): time to first audio, queue depth, busy slots, audio seconds,
outcomes, and where the engine thread's time goes. In a cluster the ingress keeps the first two families (what happens
before a request reaches an engine) and each replica the rest, shown with its replica label (runtime/cluster/)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from higgs_trt.runtime.scheduler import PHASES

TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class Metrics:
    def __init__(self, engine=None):
        """`engine`: the EngineThread whose requests and loop these count; None: the refusals and admission only."""
        r = self.registry = CollectorRegistry()
        self.errors = Counter("higgs_errors", "Requests refused before admission, by error code", ["code"], registry=r)
        self.admission = Histogram("higgs_admission_seconds", "From the request's handler starting to its admission "
                                   "(reading and parsing the body, building the prompt, encoding reference audio)",
                                   buckets=TTFA_BUCKETS, registry=r)
        if engine is None:
            return
        self.ttfa = Histogram("higgs_time_to_first_audio_seconds", "From admission to the first audio chunk (server "
                              "side)", buckets=TTFA_BUCKETS, registry=r)
        self.audio = Counter("higgs_audio_seconds", "Seconds of audio decoded for clients", registry=r)
        self.requests = Counter("higgs_requests", "Admitted requests by outcome (completed, failed, timeout, "
                                "cancelled: the client went away)", ["outcome"], registry=r)
        self.queue_wait = Histogram("higgs_queue_wait_seconds", "From admission to the prefill call that gives the "
                                    "request a slot", buckets=TTFA_BUCKETS, registry=r)

        def scheduler(attribute):
            return lambda: getattr(engine.scheduler, attribute) if engine.scheduler is not None else 0

        Gauge("higgs_queue_depth", "Requests waiting for a slot", registry=r).set_function(scheduler("waiting"))
        Gauge("higgs_busy_slots", "Slots decoding a request", registry=r).set_function(scheduler("busy"))
        Gauge("higgs_slots", "Engine slots", registry=r).set_function(
            lambda: engine.engine.max_batch if engine.engine is not None else 0)
        # where the engine thread's time goes, since start (warm-up included): the phases of the scheduler's loop
        # (decode holds the steps and the waits for them), and how many prefill calls the joins took
        loop = Gauge("higgs_engine_loop_seconds", "Seconds the engine thread spent in each phase of the scheduler's "
                     "loop since start: prefill, decode (steps and waiting for them), codec, other", ["phase"],
                     registry=r)
        for phase in PHASES:
            loop.labels(phase).set_function(
                lambda p=phase: engine.scheduler.seconds[p] if engine.scheduler is not None else 0.0)
        Gauge("higgs_prefill_calls", "Prefill calls since start (each one or more joining requests)",
              registry=r).set_function(scheduler("prefill_calls"))
        Gauge("higgs_codec_calls", "Codec calls since start (each one or more windows of one length)",
              registry=r).set_function(scheduler("codec_calls"))
        Gauge("higgs_codec_windows", "Codec windows decoded since start", registry=r).set_function(
            scheduler("codec_windows"))
