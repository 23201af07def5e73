"""`bench`: every benchmark command, each a thin front to runtime/bench/ (figures on stdout, progress on stderr)."""

from functools import partial

import click
import numpy as np

from higgs_trt.runtime import extras
from higgs_trt.runtime.errors import HiggsError

from .options import (codec_precision_option, engine_source, given, max_seq_option, options, say, stream_plan,
                      stream_plan_options)
from .paths import PATH

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog, twice, and then once more."
FP8_OPTIONS = {"bf16": (False,), "fp8": (True,), "both": (False, True)}  # --precision → the GPU benchmarks' fp8 flags


@click.group()
def bench():
    """Benchmarks that print figures: decode loop, streaming, a running server, reference encoding, export memory,
    BF16 vs FP8 builds, kernels."""


def bench_engine(ctx, backend, checkpoint, engine, device, max_seq, max_batch, precision, placeholder_scales,
                 codec_precision):
    """(engine, tokenizer) a benchmark times; --placeholder-scales times FP8 from a checkpoint without calibrating
    (the scales do not change the work, only the numbers)."""
    from .engines import load_tokenizer, open_all, open_sources

    if not placeholder_scales:
        _, model, tokenizer = open_all(backend, engine, checkpoint, device, precision, max_seq, given(ctx),
                                       max_batch=max_batch, codec_precision=codec_precision, say=say)
        return model, tokenizer
    if not checkpoint or engine or precision != "fp8":
        raise HiggsError("--placeholder-scales times FP8 speed from a --checkpoint (with --precision fp8)")
    from higgs_trt.runtime.bench.gpu import placeholder_amax
    from higgs_trt.runtime.gpu.engine import load_gpu_engine
    from higgs_trt.runtime.options import prompt_length

    sources = open_sources("torch", None, checkpoint, precision, max_seq)
    ckpt, max_seq = sources.checkpoint, sources.max_seq
    model = load_gpu_engine(ckpt, max_seq=max_seq, max_batch=max_batch, max_prompt=prompt_length(max_seq),
                            act_amax=placeholder_amax(ckpt.config), codec_fp16=codec_precision != "tf32", say=say)
    return model, load_tokenizer(sources)


loop_options = options(
    engine_source,
    click.option("--precision", type=click.Choice(["bf16", "fp8"])),
    click.option("--placeholder-scales", is_flag=True,
                 help="FP8 speed from a checkpoint with unit activation scales instead of calibrating (timing only)."),
    codec_precision_option,
    click.option("--text", default=DEFAULT_TEXT, show_default=True),
    max_seq_option,
    click.option("--rows", type=int, default=250, show_default=True,
                 help="Rows per request at most (random weights rarely emit EOC: this fixes the length)."),
    click.pass_context,
)


@bench.command("decode")
@loop_options
@click.option("--batches", help="Batch sizes (GPU engine: one figure each; host-driven engines: the largest, prompts "
                                "decoded together).  [default: 1,8,64; host-driven engines: up to their slots]")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs (host-driven engines).")
def bench_decode(ctx, engine, checkpoint, backend, device, precision, placeholder_scales, codec_precision, text,
                 max_seq, rows, batches, repeats):
    """Time the decode loop. GPU engine: ms per step by batch size, host µs per row, audio-s/s, time to first audio,
    peak memory, ratio to the weight-read floor. Host-driven engines: ms per step, host overhead, codec, RTF."""
    from higgs_trt.runtime.decoding import Sampling
    from higgs_trt.runtime.options import sizes, within
    from higgs_trt.runtime.prompt import build_prompt

    batch_sizes = sizes("--batches", "1,8,64" if batches is None else batches, 512)
    within("--repeats", repeats, 1, 1000)
    within("--rows", rows, 8, 2048)
    model, tokenizer = bench_engine(ctx, backend, checkpoint, engine, device, max_seq, max(batch_sizes), precision,
                                    placeholder_scales, codec_precision)
    prompt = build_prompt(tokenizer, text)
    say(f"{model.name} backend, prompt of {len(prompt)} tokens, at most {rows} rows")
    if model.name == "torch-cuda":
        from higgs_trt.runtime.bench.gpu import bench_decode as gpu_decode

        gpu_decode(model, prompt, batch_sizes, rows, say=click.echo)
        return
    from higgs_trt.runtime.bench.loop import run_bench

    batch = max(batch_sizes) if batches is not None else min(max(batch_sizes), model.max_batch)
    within("--batches", batch, 1, model.max_batch, "the engine's slots")
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=0)):
        click.echo(run_bench(model, [prompt] * batch, sampling, repeats, rows).line())


@bench.command("stream")
@loop_options
@click.option("--concurrency", default="1,8,64", show_default=True, help="Closed-loop clients, one figure each.")
@click.option("--requests", type=int, default=0, help="Requests per concurrency level [default: 2 × concurrency].")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--stagger", is_flag=True,
              help="Start the clients one after another over one request's rows, so that requests end and join at "
                   "different steps, as served traffic does [default: all at once].")
@click.option("--ref-seconds", type=float, default=0.0, show_default=True,
              help="Voice-clone load: every prompt carries a reference of this many seconds (1 to 30; random codes, "
                   "25 frames a second) with --text as its transcript.")
@click.option("--voice", "voices", is_flag=True,
              help="Per level, side by side: the default voice, then a --ref-seconds voice (10 s unless given) with "
                   "the reference prefix cache off, then on.")
@click.option("--segments", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Long-form: requests speak --text this many times over (one segment each, history carried), "
                   "beside one-segment requests, per level.")
@click.option("--text-rate", type=click.FloatRange(1, 100_000, min_open=False),
              help="Text streamed in: --text × --segments (10 unless given) fed word by word at this many characters "
                   "a second to one request; per segment, its last character → its first audio, beside one-shot "
                   "requests of each segment alone.")
@click.option("--realtime", "rates",
              help="Real-time listeners: Poisson arrivals at these rates (a second, comma-separated), each playing at 1× "
                   "with a --buffer-ms buffer; stall share, p95 stall, first audio, and the largest rate with no stall. "
                   "The scheduler refuses a request that would push the others under real time.")
@click.option("--duration", type=click.FloatRange(1, 3600), default=30.0, show_default=True,
              help="--realtime: seconds of arrivals per rate.")
@click.option("--buffer-ms", type=click.IntRange(0, 10_000), default=100, show_default=True,
              help="--realtime: audio a listener holds before it plays (and again after a stall).")
@click.option("--slots", type=click.IntRange(1, 4096), help="Engine slots [default: the largest --concurrency].")
@click.option("--lanes", type=click.IntRange(1, 4096),
              help="Slots one step decodes [default: all]; requests in the others wait, earliest deadline first "
                   "(engines that can move a request between slots: ONNX Runtime).")
@click.option("--timeline", is_flag=True,
              help="GPU engine: run each level once more under torch's profiler and say where its time went (the "
                   "decode stream's busy time, its idle gaps by the scheduler or engine call running when each began, "
                   "the codec stream's overlap).")
@stream_plan_options
def bench_stream(ctx, engine, checkpoint, backend, device, precision, placeholder_scales, codec_precision, text,
                 max_seq, rows, concurrency, requests, temperature, stagger, ref_seconds, voices, segments, text_rate,
                 rates, duration, buffer_ms, slots, lanes, timeline, first_chunk, chunk, context, holdback,
                 first_holdback):
    """Streaming under load: audio-s/s, time to first audio p50/p95, underruns, per concurrency level (exact chunk
    seams unless the window options say otherwise). --voice, --segments and --text-rate put the figures a feature
    must match beside the plain request's, measured in the same run."""
    from higgs_trt.runtime.audio import MAX_SECONDS, MIN_SECONDS
    from higgs_trt.runtime.bench.loop import bench_stream as run_stream
    from higgs_trt.runtime.longform import Reference, plan_text
    from higgs_trt.runtime.options import sampling, sizes, within

    levels = sizes("--concurrency", concurrency, 4096)
    within("--rows", rows, 8, 2048)
    within("--requests", requests, 0, 100_000)
    settings = sampling(temperature, 0, 1.0, 0)
    ref_seconds = ref_seconds or (10.0 if voices else 0.0)
    if not (ref_seconds == 0 or MIN_SECONDS <= ref_seconds <= MAX_SECONDS):
        raise HiggsError(f"--ref-seconds must be 0 (no reference) or lie in {MIN_SECONDS:g}..{MAX_SECONDS:g} (as "
                         f"--ref-audio's), got {ref_seconds}")
    if sum((voices, segments > 1 and not text_rate, text_rate is not None, rates is not None)) > 1:
        raise HiggsError("--voice, --segments, --text-rate and --realtime are separate benchmarks: give one at a time")
    arrival_rates = [float(r) for r in rates.split(",")] if rates else []
    if any(not 0 < r <= 10_000 for r in arrival_rates):
        raise HiggsError(f"--realtime takes arrival rates in (0, 10000] a second, got {rates}")
    stream_plan(first_chunk, chunk, context, holdback, first_holdback)  # sizes checked before any work
    if timeline and (backend or ("ort" if engine else "torch")) != "torch":
        raise HiggsError("--timeline profiles the GPU engine: --backend torch on a GPU")
    model, tokenizer = bench_engine(ctx, backend, checkpoint, engine, device, max_seq, slots or max(levels),
                                    precision, placeholder_scales, codec_precision)
    if timeline and model.name != "torch-cuda":
        raise HiggsError("--timeline profiles the GPU engine: --backend torch on a GPU (none here)")
    plan = stream_plan(first_chunk, chunk, context, holdback, first_holdback, model.codec_strides, warn=True)
    voice = reference_voice(text, ref_seconds)
    if arrival_rates:
        realtime_levels(model, plan, lanes, plan_text(tokenizer, text, voice, None, model.max_prompt)[0],
                        arrival_rates, duration, rows, buffer_ms / 1e3)
        return
    if text_rate is not None:
        from higgs_trt.runtime.bench.text_rate import bench_text_rate

        pieces = segments if segments > 1 else 10
        say(f"{model.name} backend, {pieces} × {text!r} streamed in at {text_rate:g} chars/s, {rows} rows per segment")
        click.echo(bench_text_rate(model, tokenizer, " ".join([text] * pieces), voice, text_rate, rows, settings,
                                   plan).line())
        return

    def speech(words: str, voice: Reference):
        return lambda: plan_text(tokenizer, words, voice, None, model.max_prompt)

    kinds = [("", speech(text, voice), None)]
    if voices:
        prefixes = model.prefixes
        kinds = [("default voice", speech(text, Reference()), None),
                 (f"{ref_seconds:g} s voice, cache off", speech(text, voice), 0),
                 (f"{ref_seconds:g} s voice, cache on", speech(text, voice), max(prefixes.entries, 1))]
        if not getattr(model, "cacheable", True):
            say(f"note: the {model.name} backend keeps no prefix cache: 'cache on' runs as 'cache off'")
    elif segments > 1:
        _, script = plan_text(tokenizer, " ".join([text] * segments), voice, None, model.max_prompt)
        count = 1 + len(script.pending) if script else 1
        kinds = [("1 segment", speech(text, voice), None),
                 (f"{count} segments", speech(" ".join([text] * segments), voice), None)]
    prompt, _ = kinds[-1][1]()
    say(f"{model.name} backend, {model.max_batch} slots, prompt of {len(prompt)} tokens"
        + (f" ({ref_seconds:g} s reference)" if ref_seconds else "") + f", {rows} rows per segment, "
        f"first chunk {plan.first} frames, then {plan.chunk}{'; clients staggered' if stagger else ''}")
    for c in levels:
        firsts = []
        for label, make, entries in kinds:
            if entries is not None:
                model.prefixes.entries = entries
            run_stream(model, make, c, c, rows, settings, plan, stagger, lanes=lanes)  # warm-up: windows, prefixes
            level = partial(run_stream, model, make, c, requests or 2 * c, rows, settings, plan, stagger, label, lanes)
            figures = level()
            click.echo(figures.line())
            firsts.append(np.percentile(figures.ttfa_ms, 50))
            if timeline:
                from higgs_trt.runtime.bench.profile import profile_level

                click.echo(f"  (profiled: {profile_level(level, model, say=click.echo).line()})")
        if len(kinds) > 1:
            click.echo("  first audio p50 against the " + kinds[0][0] + ": "
                       + ", ".join(f"{label} {first / firsts[0]:.2f}×" for (label, _, _), first
                                   in zip(kinds[1:], firsts[1:])))


def realtime_levels(model, plan, lanes, prompt, rates, duration, rows, buffer) -> None:
    from higgs_trt.runtime.bench.realtime import bench_realtime
    from higgs_trt.runtime.scheduler import Scheduler

    say(f"{model.name} backend, {model.max_batch} slots ({lanes or model.max_batch} decoded a step), {rows} rows a "
        f"request, {duration:g} s of arrivals a rate, listeners buffer {1e3 * buffer:g} ms")
    scheduler = Scheduler(model, plan, lanes=lanes, realtime=True)
    bench_realtime(scheduler, model, prompt, max(rates), 1.0, rows, buffer)  # warm-up: windows, step times measured
    clean = []
    for rate in rates:
        figures = bench_realtime(scheduler, model, prompt, rate, duration, rows, buffer)
        click.echo(figures.line())
        if not any(figures.stalled_s):
            clean.append((rate, figures.listeners))
    if clean:
        rate, streams = max(clean)
        click.echo(f"largest rate with no stall: {rate:g} arrivals/s, {streams:.1f} real-time listeners on average")
    else:
        click.echo("every rate stalled some listener")


def reference_voice(text: str, seconds: float):
    """A voice of `seconds` of random codes (25 frames a second) with `text` as its transcript; 0: the default."""
    from higgs_trt.runtime.decoding import CODEBOOK_SIZE, FRAMES_PER_SECOND, NUM_CODEBOOKS
    from higgs_trt.runtime.longform import Reference

    if not seconds:
        return Reference()
    frames = round(FRAMES_PER_SECOND * seconds)
    codes = np.random.default_rng(0).integers(0, CODEBOOK_SIZE, (frames, NUM_CODEBOOKS), dtype=np.int32)
    return Reference(codes, text)


@bench.command("serve")
@click.option("--url", "urls", multiple=True, default=["http://127.0.0.1:8000"], show_default=True,
              help="A running `higgs-trt serve` (or `serve --cluster`); again for more servers, measured side by side "
                   "level by level, each against the first.")
@click.option("--concurrency", default="1,8,64", show_default=True, help="Closed-loop clients, one figure each.")
@click.option("--requests", type=int, default=0, help="Requests per concurrency level [default: 2 × concurrency].")
@click.option("--max-new-tokens", type=int, default=250, show_default=True,
              help="Decode steps per request at most (random weights rarely end an utterance: this fixes the length).")
@click.option("--text", default=DEFAULT_TEXT, show_default=True)
@click.option("--voice", default="default", show_default=True)
@click.option("--wait", type=float, default=600.0, show_default=True,
              help="Seconds (0 to 86400) to wait for the server's /health to turn 200 before measuring (saying every "
                   "30 s that it still waits).")
@click.option("--api-key", envvar="HIGGS_API_KEY", help="The servers' --api-key (also from HIGGS_API_KEY).")
def bench_serve(urls, concurrency, requests, max_new_tokens, text, voice, wait, api_key):
    """A running server measured at the client: streamed pcm over HTTP, audio-s/s and time to first audio p50/p95
    per concurrency level (from sending the request to the first audio byte), underruns; several servers (a single
    process, clusters of 1 and 2 replicas) side by side."""
    from higgs_trt.runtime.options import seconds_within, server_url, sizes, within
    from higgs_trt.runtime.prompt import check_text

    urls = [server_url("--url", url) for url in urls]
    levels = sizes("--concurrency", concurrency, 4096)
    within("--requests", requests, 0, 100_000)
    within("--max-new-tokens", max_new_tokens, 8, 2048)
    seconds_within("--wait", wait, 0, 86400)
    check_text(text, "--text")  # here, not as 400s from the server after the wait for it
    with extras.needed("serve", "bench serve"):
        from higgs_trt.runtime.bench.serve import run_bench_serve
    run_bench_serve(urls, levels, requests, max_new_tokens, text, voice, wait, api_key, say=say, echo=click.echo)


@bench.command("encode")
@engine_source
@click.option("--seconds", type=float, default=10.0, show_default=True, help="Reference length (1 to 30).")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True, help="Timed encodes (median shown).")
@click.pass_context
def bench_encode(ctx, engine, checkpoint, backend, device, seconds, repeats):
    """Time encoding a reference: reading + resampling a 44.1 kHz stereo wav, then the codec encoder alone."""
    from higgs_trt.runtime.audio import MAX_SECONDS, MIN_SECONDS
    from higgs_trt.runtime.options import seconds_within

    from .engines import choose_backend, open_encoder, open_sources

    seconds_within("--seconds", seconds, MIN_SECONDS, MAX_SECONDS)
    name = choose_backend(backend, engine, checkpoint, device, given(ctx))
    encoder = open_encoder(open_sources(name, engine, checkpoint, None, None), device)
    with extras.needed("audio", "bench encode"):
        from higgs_trt.runtime.bench.encode import run_encode_bench

        click.echo(run_encode_bench(encoder, seconds, repeats))


@bench.command("build")
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--target", help="TensorRT-RTX target (e.g. sm89); default: TensorRT for the local GPU.")
@click.option("--max-seq", type=int, default=1024, show_default=True)
@click.option("--workdir", type=PATH, help="Keep the engine directories here.")
def bench_build(checkpoint, target, max_seq, workdir):
    """Build BF16 and FP8 engines side by side: plan sizes, their ratio, build times, FP8 gate figures."""
    from .build import open_checkpoint

    ckpt = open_checkpoint(checkpoint, "bench build")
    from higgs_trt.runtime.bench.build import bf16_against_fp8

    bf16_against_fp8(ckpt, target, max_seq, workdir, click.echo)


@bench.command("export")
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--max-seq", type=int, default=2048, show_default=True)
def bench_export(checkpoint, max_seq):
    """Peak memory of `export` (a child process) as a multiple of the checkpoint's size on disk."""
    from higgs_trt.runtime.bench.build import export_memory

    export_memory(checkpoint, max_seq, click.echo)


@bench.command("checkpoint")
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--repeats", type=click.IntRange(1, 100), default=3, show_default=True)
def bench_checkpoint(checkpoint, repeats):
    """What the non-finite weight check costs: seconds per GiB of float tensors (every run after the first reads
    from the page cache; the first may read from disk)."""
    with extras.needed("builder", "bench checkpoint"):
        from higgs_trt.runtime.bench.build import finite_check
    finite_check(checkpoint, repeats, click.echo)


@bench.command("kernels")
def bench_kernels():
    """Plugin kernels vs the torch eager ops they replace, and vs the device's copy bandwidth (needs a GPU)."""
    with extras.needed("gpu", "bench kernels"):
        from higgs_trt.runtime.bench.kernels import run as run_kernel_bench
    extras.require_cuda("bench kernels")
    for line in run_kernel_bench():
        click.echo(line)


@bench.command("linear")
@click.option("--budget", type=float, default=300.0, show_default=True, help="Seconds to spend trying tile shapes.")
@click.option("--precision", type=click.Choice(["bf16", "fp8", "both"]), default="both", show_default=True,
              help="Which weights' tile shapes to time (the audio head is bf16 in both).")
@click.option("--tiles", type=click.Choice(["narrow", "wide", "persistent", "ranges", "prefill", "tma", "step", "all"]),
              default="all", show_default=True,
              help="narrow: the tiles of up to 16 rows (they fix each shape's K ranges and MMA); wide: the tiles of "
                   "17 to 64 rows, within those; persistent: the narrow tiles with fewer programs than units; "
                   "ranges: wgmma narrow and wide tiles together, K in 1 to 8 ranges; prefill: the tiles of every "
                   "prefill pass (their own K ranges and MMA); tma: today's tiles with loads by TMA against "
                   "loads by each thread (reports only; not part of all); step: the wide tiles chosen by the B=64 "
                   "decode step's time, neighbours and waits included, and when the next kernel launches (36 "
                   "layers; not part of all).")
@click.option("--write", is_flag=True,
              help="Save the resulting table as this GPU model's file in runtime/gpu/tiles/, which every engine on "
                   "such a GPU then reads at start-up.")
def bench_linear(budget, precision, tiles, write):
    """The GPU engine's linear kernel at Higgs v3's weight shapes: tile shapes timed at M = 1 to 64, and 2048 for
    prefill tiles (needs a GPU). With --tiles all the budget is split between the sweeps, each starting from the
    previous one's winners."""
    with extras.needed("gpu", "bench linear"):
        from higgs_trt.runtime.bench import tiles as sweeps
        from higgs_trt.runtime.bench.tiles_in_step import sweep_wide_in_step
        from higgs_trt.runtime.config import HIGGS_V3
        from higgs_trt.runtime.gpu.tiles import write_table
    extras.require_cuda("bench linear")
    fp8_options = FP8_OPTIONS[precision]
    named = {"narrow": ("narrow tiles (M = 1 to 16)", sweeps.sweep_linear),
             "wide": ("wide tiles (M = 17 to 64)", sweeps.sweep_wide),
             "persistent": ("persistent programs (M = 1 to 16)", sweeps.sweep_persistent),
             "ranges": ("K ranges, wgmma (M = 1 to 64)", sweeps.sweep_ranges),
             "prefill": ("prefill tiles (M = 2048 and 64)", sweeps.sweep_prefill),
             "tma": ("today's tiles, loads by TMA against loads by each thread", sweeps.compare_tma),
             "step": ("wide tiles by the B=64 decode step's time", sweep_wide_in_step)}
    chosen = [name for name in named if name not in ("tma", "step")] if tiles == "all" else [tiles]
    for name in chosen:
        title, sweep = named[name]
        click.echo(title)
        sweep(HIGGS_V3, budget / len(chosen), fp8_options, say=click.echo)
    if write:
        say(f"wrote {write_table(sweeps.table(), 'cuda')}")


@bench.command("attention")
def bench_attention():
    """The GPU engine's decode attention at Higgs v3's heads: chunk, key block, pipeline stages, warps and loads (per
    thread or TMA) timed at B = 1, 8, 64 and 300, 1000 cached positions (needs a GPU)."""
    with extras.needed("gpu", "bench attention"):
        from higgs_trt.runtime.bench.attention import sweep_attention
        from higgs_trt.runtime.config import HIGGS_V3
    extras.require_cuda("bench attention")
    sweep_attention(HIGGS_V3, say=click.echo)


@bench.command("codec")
@click.option("--checkpoint", type=PATH, required=True,
              help="Checkpoint whose codec to time (`tiny-checkpoint --size real`: random weights at Higgs' dimensions).")
@click.option("--windows", default="1,8,64", show_default=True, help="Windows per call, comma-separated (1 to 256).")
def bench_codec(checkpoint, windows):
    """The GPU engine's codec call (CUDA graphs) per window shape of the stream plan and window count: TF32 against
    fp16 convolutions, ms per call and error against exact fp32 (needs a GPU)."""
    from higgs_trt.runtime.options import sizes

    counts = sizes("--windows", windows, 256)
    with extras.needed("gpu", "bench codec"):
        from higgs_trt.builder.checkpoint import Checkpoint
        from higgs_trt.runtime.bench.gpu import bench_codec as run_codec_bench
    extras.require_cuda("bench codec")
    run_codec_bench(Checkpoint(checkpoint), tuple(counts), say=click.echo)


@bench.command("profile")
@click.option("--precision", type=click.Choice(["bf16", "fp8", "both"]), default="both", show_default=True)
@click.option("--batches", default="1,64", show_default=True, help="Batch sizes, comma-separated (1 to 64).")
@click.option("--context", type=click.IntRange(1, 2047), default=300, show_default=True,
              help="Cached positions of every slot (the keys attention reads).")
@click.option("--leave-out", is_flag=True,
              help="Instead: the step's time as the engine runs it (CUDA graph, programmatic dependent launch) with "
                   "the norms, attention, the GEMMs, or norms and attention left out: what each costs in the chain.")
def bench_profile(precision, batches, context, leave_out):
    """One decode step of the GPU engine kernel by kernel (torch's profiler, no programmatic dependent launch):
    µs a layer per kernel, its share of the step, each GEMM's weight read rate. Random weights at Higgs v3's
    dimensions (needs a GPU)."""
    from higgs_trt.runtime.options import sizes

    batch_sizes = sizes("--batches", batches, 64)
    with extras.needed("gpu", "bench profile"):
        from higgs_trt.runtime.bench.profile import chain_costs, profile_step
        from higgs_trt.runtime.config import HIGGS_V3
    extras.require_cuda("bench profile")
    run = chain_costs if leave_out else profile_step
    run(HIGGS_V3, tuple(batch_sizes), FP8_OPTIONS[precision], context, say=click.echo)


@bench.command("weight-stream")
@click.option("--precision", type=click.Choice(["bf16", "fp8", "both"]), default="both", show_default=True)
@click.option("--rings", default="32,48,64,96,128", show_default=True,
              help="Shared memory each kernel block streams its weights through, KB, comma-separated (16 to 192).")
@click.option("--blocks", default="1,2", show_default=True,
              help="GEMV blocks per multiprocessor, comma-separated (1 to 4).")
@click.option("--check", is_flag=True, help="Only check each GEMV's sums against the host's (no timing).")
@click.option("--nvcc", default="nvcc", show_default=True, help="The CUDA compiler (a name on PATH, or a path).")
def bench_weight_stream(precision, rings, blocks, check, nvcc):
    """A B=1 decode step's weight stream as 144 hand-written CUDA kernels in one graph (36 layers x q|k|v, o,
    gate|up, down at Higgs v3's shapes, random weights): kernels that only read their matrix, and GEMVs that stream
    their rows through a shared-memory ring of bulk copies, each launched in turn without programmatic dependent
    launch, with it and every load after the wait for the previous kernel, with the weights loaded before that wait,
    and with no wait. ms per step against the floor at the copy rate. A measurement of kernel boundaries and of a
    design the engine's Triton kernels cannot express, not the engine (needs nvcc and a GPU of compute capability
    9.0 or later)."""
    from higgs_trt.runtime.bench.build import weight_stream
    from higgs_trt.runtime.options import sizes

    ring_sizes = sizes("--rings", rings, 192)
    block_counts = sizes("--blocks", blocks, 4)
    if min(ring_sizes) < 16:
        raise HiggsError("--rings: each ring must hold at least 16 KB")
    weight_stream(nvcc, precision, ring_sizes, block_counts, check, say)
