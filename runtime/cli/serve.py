"""`serve`: OpenAI's speech API over the in-flight scheduler (runtime/server/); `serve --cluster`: the same API over
engine replicas in Ray Serve, one engine per GPU (runtime/cluster/, docs/cluster.md).

The cluster is an option of `serve`, not a command of its own: every option of the API (limits, voices, keys, stream
windows) means the same in both, and the engine a replica opens is the one `serve` would open, from the same recipe.
"""

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import click

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.longform import DEFAULT_HISTORY
from higgs_trt.runtime.prefix_cache import DEFAULT_ENTRIES
from higgs_trt.runtime.server.limits import DEFAULT_MAX_SECONDS, DEFAULT_TIMEOUT, MAX_INPUT_CHARS

from .options import codec_precision_option, engine_source, given, options, precision_option, say, stream_plan, stream_plan_options
from .paths import PATH

CLUSTER_OPTIONS = ("replicas", "min_replicas", "max_replicas", "target_streams", "ray_address", "replica_cpus",
                   "affinity_bound")


@dataclass(frozen=True)
class EngineRecipe:
    """What an engine thread is opened from: serve's options. Picklable, so that a cluster replica, possibly on
    another machine, opens its own engine the way one process does."""

    backend: str
    engine: Path | None
    checkpoint: Path | None
    device: str
    precision: str | None
    codec_precision: str | None
    max_batch: int
    prefix_cache: int
    max_queue: int
    lanes: int | None
    realtime: bool
    windows: tuple  # first_chunk, chunk, context, holdback, first_holdback


def engine_thread(recipe: EngineRecipe, sources, tokenizer, voices: dict):
    """The EngineThread of `recipe` on opened sources (it loads the engine once started)."""
    from higgs_trt.runtime.server.engine_thread import EngineThread

    from .engines import open_encoder, open_engine

    def engine_with_cache():
        model = open_engine(sources, device=recipe.device, max_batch=recipe.max_batch, precision=recipe.precision,
                            codec_precision=recipe.codec_precision, say=say)
        model.prefixes.entries = recipe.prefix_cache
        return model

    return EngineThread(engine_with_cache, lambda: open_encoder(sources, recipe.device), tokenizer, voices,
                        recipe.max_queue, lambda strides: stream_plan(*recipe.windows, strides, warn=True),
                        recipe.lanes, recipe.realtime)


def replica_thread(recipe: EngineRecipe):
    """A cluster replica's EngineThread: the sources opened and checked on the replica's machine (the voices are the
    ingress's)."""
    from .engines import load_tokenizer, open_sources

    sources = open_sources(recipe.backend, recipe.engine, recipe.checkpoint, recipe.precision, None)
    return engine_thread(recipe, sources, load_tokenizer(sources), {})


cluster_options = options(
    click.option("--cluster", is_flag=True,
                 help="Serve through engine replicas in Ray Serve (the `cluster` extra): one engine per GPU, or a CPU "
                      "share each; the same API, routes and limits (docs/cluster.md)."),
    click.option("--replicas", type=int, default=1, show_default=True,
                 help="--cluster: engine replicas (with --max-replicas, the number to start with)."),
    click.option("--min-replicas", type=int,
                 help="--cluster: autoscaling's floor [default: 1]; fewer live replicas make /health `degraded`."),
    click.option("--max-replicas", type=int, help="--cluster: autoscale up to this many replicas (turns autoscaling on)."),
    click.option("--target-streams", type=float,
                 help="--cluster, autoscaling: streams per replica to aim at [default: --max-batch]."),
    click.option("--ray-address",
                 help="--cluster: a running Ray cluster (`ray start --head` prints it; `auto`: the one started on this "
                      "machine) [default: a private cluster of this machine, stopped with the server]."),
    click.option("--replica-cpus", type=float, default=1.0, show_default=True,
                 help="--cluster: CPUs Ray reserves for each replica (a share such as 0.5 on a small CPU machine)."),
    click.option("--affinity-bound", type=int, default=8, show_default=True,
                 help="--cluster: a voice's requests go to its own replica (its prefix cache) unless that replica has "
                      "more than this many streams beyond the least-loaded one's."),
)


@click.command()
@engine_source
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@precision_option
@codec_precision_option
@click.option("--max-batch", type=int, default=64, show_default=True,
              help="Engine slots: requests decoded together (at most what the engine was built for).")
@click.option("--voices", "voices_dir", type=PATH,
              help="Named voices: NAME.wav|.flac|.ogg|.mp3 (a 1–30 s recording) or NAME.npy (codes [T,8]), each with an "
                   "optional NAME.txt transcript; `voice: NAME` picks one ('default' is zero-shot).")
@click.option("--ref-dir", type=PATH,
              help="Requests may name reference audio below this directory (ref_audio: file://PATH); else only uploads.")
@click.option("--max-queue", type=int, default=256, show_default=True,
              help="Requests waiting for a slot; past this, new ones get 429 with Retry-After.")
@click.option("--realtime", is_flag=True,
              help="Refuse (429) a request that would push the streams under real time, by the loop's measured "
                   "seconds per row, instead of slowing every stream.")
@click.option("--lanes", type=click.IntRange(1, 4096),
              help="Slots one decode step takes [default: all]; requests in the others wait, earliest deadline first "
                   "(engines that can move a request between slots: ONNX Runtime).")
@click.option("--timeout", type=float, default=DEFAULT_TIMEOUT, show_default=True,
              help="Seconds a request may take, waiting included; then it is cancelled and its slot freed.")
@click.option("--api-key", envvar="HIGGS_API_KEY",
              help="Every route but /health needs `Authorization: Bearer KEY` (what the openai client sends); also "
                   "from HIGGS_API_KEY. Without one the server is unauthenticated (it says so at start).")
@click.option("--max-input-chars", type=int, default=MAX_INPUT_CHARS, show_default=True,
              help="Longest `input` a request may send (OpenAI's limit by default; raise it for long texts, spoken "
                   "in segments).")
@click.option("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS, show_default=True,
              help="Audio one request may produce, all its segments together.")
@click.option("--history", type=click.IntRange(0, 8), default=DEFAULT_HISTORY, show_default=True,
              help="Long texts: earlier segments of the same voice carried in each segment's prompt, at most.")
@click.option("--prefix-cache", type=click.IntRange(0, 4096), default=DEFAULT_ENTRIES, show_default=True,
              help="Voices whose reference part of the prompt the engine keeps prefilled (0: off).")
@click.option("--fixed-length", is_flag=True,
              help="Benchmarks on random weights only: every request decodes exactly max_new_tokens rows (the stop "
                   "rules, which end random-weight utterances at 32 repeated rows, are off).")
@stream_plan_options
@cluster_options
@click.pass_context
def serve(ctx, engine, checkpoint, backend, device, host, port, precision, codec_precision, max_batch, voices_dir,
          ref_dir, max_queue, realtime, lanes, timeout, api_key, max_input_chars, max_seconds, history, prefix_cache, fixed_length,
          first_chunk, chunk, context, holdback, first_holdback, cluster, replicas, min_replicas, max_replicas,
          target_streams, ray_address, replica_cpus, affinity_bound):
    """Serve OpenAI's POST /v1/audio/speech (plus the voices API, the WebSocket for text streamed in, /v1/models,
    /health, /metrics) on the in-flight scheduler; with --cluster, on engine replicas in Ray Serve."""
    from higgs_trt.runtime import extras
    from higgs_trt.runtime.options import seconds_within, within

    from .engines import check_codec_precision, choose_backend, load_tokenizer, open_sources, torch_on_cpu

    with extras.needed("serve", "higgs-trt serve"):
        from higgs_trt.runtime.server.app import Limits, SpeechService
        from higgs_trt.runtime.server.run import run_server
        from higgs_trt.runtime.server.voices import VoiceStore
    if not host.strip():  # uvicorn would listen on every interface and log http://:PORT
        raise HiggsError("--host is empty; give an address (127.0.0.1, or 0.0.0.0 for every interface)")
    within("--port", port, 0, 65535)
    within("--max-batch", max_batch, 1, 4096)
    within("--max-queue", max_queue, 1, 1_000_000)
    if not (math.isfinite(timeout) and timeout > 0):
        raise HiggsError(f"--timeout must be a positive number of seconds, got {timeout}")
    within("--max-input-chars", max_input_chars, 1, 1 << 20)
    seconds_within("--max-seconds", max_seconds, 1, 86400)
    if api_key is not None and not api_key.strip():
        raise HiggsError("--api-key is empty (HIGGS_API_KEY set to nothing?); give a key, or leave it out")
    if ref_dir is not None and not ref_dir.is_dir():
        raise HiggsError(f"--ref-dir {ref_dir}: not a directory")
    stream_plan(first_chunk, chunk, context, holdback, first_holdback)  # sizes checked before any work
    stray = sorted(f"--{o.replace('_', '-')}" for o in given(ctx) & set(CLUSTER_OPTIONS))
    if stray and not cluster:
        raise HiggsError(f"{stray[0]} applies with --cluster only")
    name = choose_backend(backend, engine, checkpoint, device, given(ctx))
    if lanes is not None and lanes < max_batch and name != "ort":
        raise HiggsError(f"--lanes {lanes} (fewer than --max-batch {max_batch}) needs an engine that can move a request "
                         "between slots: --backend ort")
    sources = open_sources(name, engine, checkpoint, precision, None)
    on_gpu = name == "trt" or name == "torch" and not torch_on_cpu(sources, device, precision)  # its option rules too
    check_codec_precision(sources, device, codec_precision)
    tokenizer = load_tokenizer(sources)
    store = VoiceStore(voices_dir, tokenizer)  # every voice file checked before the server starts
    recipe = EngineRecipe(name, engine, checkpoint, device, precision, codec_precision, max_batch, prefix_cache,
                          max_queue, lanes, realtime, (first_chunk, chunk, context, holdback, first_holdback))
    if cluster:
        engine_seam = cluster_engine(recipe, port, store.voices, tokenizer, timeout, on_gpu, given(ctx), replicas,
                                     min_replicas, max_replicas, target_streams, ray_address, replica_cpus,
                                     affinity_bound)
    else:
        engine_seam = engine_thread(recipe, sources, tokenizer, store.voices)
    limits = Limits(timeout, max_input_chars, max_seconds, history)
    if not api_key:
        say("note: no --api-key: the server is unauthenticated; anyone who can reach it may use it")
    run_server(SpeechService(engine_seam, tokenizer, store, ref_dir, limits, fixed_length=fixed_length,
                             api_key=api_key), host, port)


def cluster_engine(recipe: EngineRecipe, port: int, voices: dict, tokenizer, timeout: float, on_gpu: bool,
                   chosen: set[str], replicas: int, min_replicas: int | None, max_replicas: int | None,
                   target_streams: float | None, ray_address: str | None, replica_cpus: float, affinity_bound: int):
    """The cluster's engine seam, its options checked (`chosen`: those the user gave); nothing starts until the
    server does."""
    from higgs_trt.runtime import extras
    from higgs_trt.runtime.options import within

    with extras.needed("cluster", "higgs-trt serve --cluster"):
        from higgs_trt.runtime.cluster.deploy import EXTRA_CALLS, ClusterSettings
        from higgs_trt.runtime.cluster.ingress import ClusterEngine
    autoscaling = max_replicas is not None
    if autoscaling:
        low = within("--min-replicas", 1 if min_replicas is None else min_replicas, 1, 1024)
        within("--max-replicas", max_replicas, low, 1024, "at least --min-replicas")
        replicas = within("--replicas", replicas if "replicas" in chosen else low, low, max_replicas,
                          "from --min-replicas to --max-replicas")
        target = float(recipe.max_batch if target_streams is None else target_streams)
        if not (math.isfinite(target) and target > 0):
            raise HiggsError(f"--target-streams must be a positive number of streams, got {target_streams}")
    elif min_replicas is not None or target_streams is not None:
        raise HiggsError(f"{'--min-replicas' if min_replicas is not None else '--target-streams'} applies to "
                         "autoscaling: give --max-replicas too")
    else:
        low, target = within("--replicas", replicas, 1, 1024), None
    if not (math.isfinite(replica_cpus) and 0 < replica_cpus <= 1024):
        raise HiggsError(f"--replica-cpus must be a positive number of CPUs, got {replica_cpus}")
    within("--affinity-bound", affinity_bound, 0, 1_000_000)
    if ray_address is not None and not ray_address.strip():
        raise HiggsError("--ray-address is empty; give host:port, `auto`, or leave it out for a private cluster")
    settings = ClusterSettings(replicas, low if autoscaling else None, max_replicas, target, ray_address, replica_cpus,
                               1.0 if on_gpu else 0.0, affinity_bound,
                               recipe.max_batch + recipe.max_queue + EXTRA_CALLS, timeout)
    return ClusterEngine(settings, partial(replica_thread, recipe), f"higgs-trt-{port}", voices, tokenizer, say)
