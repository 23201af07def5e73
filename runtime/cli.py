"""`higgs-trt`: the command line. Stage commands import their heavy dependencies only when they run."""

import io
import time
from functools import partial
from pathlib import Path

import click
import numpy as np

from .click_types import FILE_OUT, PATH, NonEmptyPath
from .errors import HiggsError
from .options import prompt_length
from .outputs import remember_interrupts

MAX_SEQ_HELP = "KV-cache length (torch backend from a checkpoint) [default: 2048, or the model's positions if fewer]."
PRECISION_HELP = ("With --engine: refuse an engine of another precision. With --checkpoint on a GPU (torch): bf16 "
                  "(default), or fp8 with scales calibrated at start-up on the built-in prompt set.")
codec_precision_option = click.option(
    "--codec-precision", type=click.Choice(["fp16", "tf32"]),
    help="The GPU engine's codec convolutions: fp16 (default; fp32 sums, ~1.5× faster calls at 64 windows) or tf32 "
         "(what the model notes recommend for the real codec: its transposed convolutions in low precision).")


class Cli(click.Group):
    """Turns HiggsError into a one-line `Error: ...` and exit code 1, never a traceback."""

    def invoke(self, ctx):
        remember_interrupts()
        try:
            return super().invoke(ctx)
        except HiggsError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:  # a file the checks passed that vanished or changed while the command ran
            if e.filename is None:
                raise
            raise click.ClickException(f"{e.filename}: {e.strerror or e}") from None


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="higgs-trt")
def main():
    """Higgs Audio v3 text-to-speech on TensorRT: export, build, run and compare."""


def say(msg: str) -> None:
    click.echo(msg, err=True)


def npy_writer(array: np.ndarray):
    """write_file's writer of `array` as an .npy file. Through a buffer: np.save into a file writes small arrays
    with C stdio and misses its failed flush, so a full disk left a truncated file reported as written."""
    def write(tmp: Path) -> None:
        buffer = io.BytesIO()
        np.save(buffer, array)
        tmp.write_bytes(buffer.getbuffer())

    return write


def given(ctx: click.Context) -> set[str]:
    """The options the user set (on the command line or through the environment), not left at their defaults."""
    return {k for k in ctx.params if ctx.get_parameter_source(k) not in (None, click.core.ParameterSource.DEFAULT)}


def _engine(ctx: click.Context, backend, engine, checkpoint, device, precision, max_seq, max_batch: int = 1,
            codec_precision: str | None = None):
    """(sources, the slot engine, tokenizer) for the benchmarks (runtime/engines.py)."""
    from .engines import choose_backend, load_tokenizer, open_engine, open_sources

    name = choose_backend(backend, engine, checkpoint, device, given(ctx))
    sources = open_sources(name, engine, checkpoint, precision, max_seq)
    tokenizer = load_tokenizer(sources)
    model = open_engine(sources, device=device, max_batch=max_batch, precision=precision,
                        codec_precision=codec_precision, say=say)
    return sources, model, tokenizer


def check_outputs(out: Path | None, codes_out: Path | None, inputs) -> None:
    from .outputs import output_file

    targets = [output_file(path, inputs) for path in (out, codes_out) if path is not None]
    if len(set(targets)) < len(targets):
        raise HiggsError(f"--out and --codes-out name the same file ({out})")


def _reference_codes(path: Path, sources, device: str):
    """Reference codes [T, 8] from an audio file, and a line saying what was done."""
    from .audio import encode_reference, load_reference_audio
    from .engines import open_encoder

    audio = load_reference_audio(path)  # every check before any model is loaded
    t0 = time.perf_counter()
    encoder = open_encoder(sources, device)
    codes = encode_reference(audio, encoder)
    return codes, (f"encoded {audio.seconds:.2f} s of reference audio ({audio.source_rate} Hz) → {len(codes)} frames "
                   f"with the {encoder.name} encoder in {time.perf_counter() - t0:.1f} s")


def stream_plan_options(command):
    """The codec windows' sizes: `run`, `serve` and `bench stream`."""
    for option in reversed([
        click.option("--first-chunk", type=int, default=8, show_default=True,
                     help="Frames (40 ms each) in the first chunk; fewer start the audio sooner, seams still exact."),
        click.option("--chunk", type=int, default=25, show_default=True,
                     help="Frames in each later chunk; after a smaller first chunk they grow to it, each at most 4× "
                          "the audio sent before it (2, 8, 25)."),
        click.option("--context", type=int,
                     help="Frames decoded before each chunk [default: the codec's receptive field]."),
        click.option("--holdback", type=int,
                     help="Frames decoded after each chunk [default: the codec's receptive field]."),
        click.option("--first-holdback", type=int, help="Low latency: a smaller holdback for the first chunk only "
                     "(its last samples are then not exact)."),
    ]):
        command = option(command)
    return command


@main.command()
@click.option("--text", required=True, help="Text to speak (inline style tags like <|emotion:elation|> allowed).")
@click.option("--out", "out", type=NonEmptyPath(allow_dash=True, file_output=True), required=True,
              help="Output wav (24 kHz mono); with --stream, '-' writes raw PCM (s16le, 24 kHz, mono) to stdout.")
@click.option("--engine", type=PATH, help="Engine directory made by `higgs-trt export`.")
@click.option("--checkpoint", type=PATH,
              help="Checkpoint directory (torch backend); with --engine, checked to be the engine's source.")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt"]),
              help="torch: the GPU engine (--engine's weights or --checkpoint), or the fp32 reference on the CPU; "
                   "ort: ONNX Runtime on --engine's reference graphs (CPU); trt: TensorRT on --engine's plans. "
                   "Default: ort with --engine, else torch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True,
              help="torch: cuda runs the GPU engine, cpu the fp32 reference (auto: cuda when torch sees a GPU); "
                   "trt: lean loads --lean plans with tensorrt_lean.")
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), help=PRECISION_HELP)
@codec_precision_option
@click.option("--ref-codes", type=PATH, help="Voice clone: reference audio codes [T,8] (.npy).")
@click.option("--ref-audio", type=PATH,
              help="Voice clone: a reference recording (wav/flac/ogg/mp3, mono or stereo, 1–30 s), encoded with the "
                   "backend's codec encoder. It and the text must fit the engine's prefill (the default 512 tokens: "
                   "about 19 s of reference beside a sentence).")
@click.option("--ref-text", help="Voice clone: transcript of the reference audio (needs --ref-codes or --ref-audio).")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 is greedy (argmax).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely codes (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1] (1: off).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed 0..2**63-1: same seed, same audio.")
@click.option("--codes-out", type=FILE_OUT, help="Also save the final frames [T,8] (.npy).")
@click.option("--max-seq", type=int, help=MAX_SEQ_HELP)
@click.option("--stream", is_flag=True, help="Write audio as it is decoded (time to first audio on stderr).")
@stream_plan_options
@click.pass_context
def run(ctx, text, out, engine, checkpoint, backend, device, precision, codec_precision, ref_codes, ref_audio, ref_text,
        temperature, top_k, top_p, seed, codes_out, max_seq, stream, first_chunk, chunk, context, holdback,
        first_holdback):
    """Speak TEXT into a wav file (or stream it as it is decoded)."""
    import sys

    from .engines import check_codec_precision, choose_backend, load_tokenizer, open_engine, open_sources
    from .options import sampling
    from .outputs import write_file
    from .prompt import build_prompt, check_text, load_reference_codes
    from .scheduler import Scheduler, request_for
    from .sinks import PcmSink, WavSink
    from .wav import SAMPLE_RATE, write_wav

    settings = sampling(temperature, top_k, top_p, seed)
    check_text(text)
    if ref_codes and ref_audio:
        raise HiggsError("give --ref-codes or --ref-audio, not both")
    if ref_text is not None:
        if ref_codes is None and ref_audio is None:
            raise HiggsError("--ref-text needs --ref-codes or --ref-audio (the transcript of which reference audio?)")
        check_text(ref_text, "reference text")
    to_stdout = str(out) == "-"
    if to_stdout and not stream:
        raise HiggsError("--out - (raw PCM on stdout) needs --stream")
    if to_stdout and sys.stdout is None:
        raise HiggsError("--out -: standard output is closed")
    if codes_out is not None and str(codes_out) == "-":
        raise HiggsError("--codes-out takes a file path ('-' names no file here; the codes are an .npy file)")
    inputs = (checkpoint, engine, ref_codes, ref_audio)
    check_outputs(None if to_stdout else out, codes_out, inputs)
    plan = stream_plan(first_chunk, chunk, context, holdback, first_holdback)  # sizes checked before any work
    ref = load_reference_codes(ref_codes) if ref_codes else None

    t0 = time.perf_counter()
    name = choose_backend(backend, engine, checkpoint, device, given(ctx))
    sources = open_sources(name, engine, checkpoint, precision, max_seq)
    check_codec_precision(sources, device, codec_precision)
    tokenizer = load_tokenizer(sources)
    if ref_audio:
        ref, done = _reference_codes(ref_audio, sources, device)
        say(done)
    model = open_engine(sources, device=device, precision=precision, codec_precision=codec_precision,
                        say=say)
    plan = stream_plan(first_chunk, chunk, context, holdback, first_holdback, model.codec_strides, warn=True)
    prompt = build_prompt(tokenizer, text, ref, ref_text)
    request = request_for(model, prompt, settings)
    say(f"loaded {model.name} backend in {time.perf_counter() - t0:.1f} s; prompt of {len(prompt)} tokens")

    sink = None
    try:  # whatever stops the command from here on (a failed write, Ctrl-C) takes the growing wav with it
        sink = (PcmSink(sys.stdout.buffer) if to_stdout else WavSink(out, inputs)) if stream else None
        request.on_chunk = sink.write if sink else None
        scheduler = Scheduler(model, plan)
        scheduler.submit(request)
        scheduler.run()
        u = request.utterance
        seconds = len(u.frames()) * 960 / SAMPLE_RATE
        wall = request.finished_at - request.submitted_at
        first = (f"first audio after {1e3 * (request.first_audio_at - request.submitted_at):.0f} ms, "
                 if request.first_audio_at else "")
        say(f"decoded {len(u.rows)} rows → {len(u.frames())} frames, {seconds:.2f} s of audio (stopped by "
            f"{u.stop_reason}); {first}{wall:.2f} s in all, real-time factor {wall / max(seconds, 1e-9):.3f}")

        if codes_out is not None:
            write_file(codes_out, npy_writer(u.frames()), inputs)
        if sink:
            sink.close()
            clipped = sink.clipped
        else:
            clipped = write_wav(out, request.audio(), inputs=inputs)
    except BaseException:
        if sink:
            sink.abort()
        raise
    say(f"wrote {'stdout' if to_stdout else out}" + (f" ({clipped} samples clipped to ±1)" if clipped else ""))


@main.command()
@click.option("--engine", type=PATH, help="Engine directory made by `higgs-trt export`.")
@click.option("--checkpoint", type=PATH,
              help="Checkpoint directory (torch backend); with --engine, checked to be the engine's source.")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt"]), help="As for `run`. Default: ort with --engine, "
              "else torch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True,
              help="As for `run`.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), help=PRECISION_HELP)
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
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds a request may take, waiting included; then it is cancelled and its slot freed.")
@click.option("--fixed-length", is_flag=True,
              help="Benchmarks on random weights only: every request decodes exactly max_new_tokens rows (the stop "
                   "rules, which end random-weight utterances at 32 repeated rows, are off).")
@stream_plan_options
@click.pass_context
def serve(ctx, engine, checkpoint, backend, device, host, port, precision, codec_precision, max_batch, voices_dir,
          ref_dir, max_queue, timeout, fixed_length, first_chunk, chunk, context, holdback, first_holdback):
    """Serve OpenAI's POST /v1/audio/speech (plus /v1/models, /health, /metrics) on the in-flight scheduler."""
    import math

    from . import extras
    from .engines import (check_codec_precision, choose_backend, load_tokenizer, open_encoder, open_engine,
                          open_sources, torch_on_cpu)
    from .options import within

    with extras.needed("serve", "higgs-trt serve"):
        from .server import EngineThread, SpeechService, load_voices
        from .server import serve as run_server
    if not host.strip():  # uvicorn would listen on every interface and log http://:PORT
        raise HiggsError("--host is empty; give an address (127.0.0.1, or 0.0.0.0 for every interface)")
    within("--port", port, 0, 65535)
    within("--max-batch", max_batch, 1, 4096)
    within("--max-queue", max_queue, 1, 1_000_000)
    if not (math.isfinite(timeout) and timeout > 0):
        raise HiggsError(f"--timeout must be a positive number of seconds, got {timeout}")
    if ref_dir is not None and not ref_dir.is_dir():
        raise HiggsError(f"--ref-dir {ref_dir}: not a directory")
    stream_plan(first_chunk, chunk, context, holdback, first_holdback)  # sizes checked before any work
    name = choose_backend(backend, engine, checkpoint, device, given(ctx))
    sources = open_sources(name, engine, checkpoint, precision, None)
    if name == "torch":
        torch_on_cpu(sources, device, precision)  # its option rules, before the server starts
    check_codec_precision(sources, device, codec_precision)
    tokenizer = load_tokenizer(sources)
    voices = load_voices(voices_dir, tokenizer)  # every voice file checked before the server starts
    thread = EngineThread(lambda: open_engine(sources, device=device, max_batch=max_batch, precision=precision,
                                              codec_precision=codec_precision, say=say),
                          lambda: open_encoder(sources, device), tokenizer, voices, max_queue,
                          lambda strides: stream_plan(first_chunk, chunk, context, holdback, first_holdback, strides,
                                                      warn=True))
    run_server(SpeechService(thread, tokenizer, voices, ref_dir, timeout, fixed_length=fixed_length), host, port)


def stream_plan(first_chunk: int, chunk: int, context: int | None, holdback: int | None, first_holdback: int | None,
                strides=(8, 5, 4, 2, 3), warn: bool = False):
    """Codec windows: exact by default (context and holdback from the decoder's receptive field)."""
    from .streaming import StreamPlan, receptive_field

    left, right = receptive_field(tuple(strides))
    plan = StreamPlan(left if context is None else context, right if holdback is None else holdback, first_chunk,
                      chunk, first_holdback)
    short = plan.left < left or plan.right < right or plan.first_right is not None and plan.first_right < right
    if warn and short:
        say(f"note: context {plan.left} / holdback {plan.right}"
            + (f" / first holdback {plan.first_right}" if plan.first_right is not None else "")
            + f" frames is less than the codec's receptive field ({left} / {right}): chunk seams are not exact")
    return plan


def encoder_source(command):
    """The options that pick a codec encoder: `encode-audio` and `bench encode`."""
    for option in reversed([
        click.option("--engine", type=PATH,
                     help="Engine directory (its codec_encoder graph or plan: ort or trt encoder)."),
        click.option("--checkpoint", type=PATH, help="Checkpoint directory (torch encoder)."),
        click.option("--backend", type=click.Choice(["torch", "ort", "trt"]),
                     help="Default: ort with --engine, else torch."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto",
                     show_default=True)]):
        command = option(command)
    return command


@main.command("encode-audio")
@click.option("--audio", type=PATH, required=True,
              help="Reference recording: wav/flac/ogg/mp3, mono or stereo, 1–30 s.")
@click.option("--out", type=FILE_OUT, required=True, help="Codes to write: frames [T,8] int32 (.npy).")
@encoder_source
@click.pass_context
def encode_audio(ctx, audio, out, engine, checkpoint, backend, device):
    """Encode a reference recording into codes for `run --ref-codes` (the layout --codes-out writes)."""
    from .engines import choose_backend, open_sources
    from .outputs import output_file, write_file

    inputs = (checkpoint, engine, audio)
    output_file(out, inputs)
    sources = open_sources(choose_backend(backend, engine, checkpoint, device, given(ctx)), engine, checkpoint, None, None)
    codes, done = _reference_codes(audio, sources, device)
    write_file(out, npy_writer(codes), inputs)
    say(f"{done}; wrote {out}")


@main.group()
def bench():
    """Benchmarks that print figures: decode loop, streaming, a running server, reference encoding, export memory,
    BF16 vs FP8 builds, kernels."""


def _bench_engine(ctx, backend, checkpoint, engine, device, max_seq, max_batch, precision, placeholder_scales,
                  codec_precision):
    """(engine, tokenizer) a benchmark times; --placeholder-scales times FP8 from a checkpoint without calibrating
    (the scales do not change the work, only the numbers)."""
    if not placeholder_scales:
        _, model, tokenizer = _engine(ctx, backend, engine, checkpoint, device, precision, max_seq, max_batch,
                                      codec_precision)
        return model, tokenizer
    if not checkpoint or engine or precision != "fp8":
        raise HiggsError("--placeholder-scales times FP8 speed from a --checkpoint (with --precision fp8)")
    from higgs_trt.builder.gpu_bench import placeholder_amax
    from higgs_trt.builder.gpu_engine import load_gpu_engine

    from .engines import load_tokenizer, open_sources

    sources = open_sources("torch", None, checkpoint, precision, max_seq)
    ckpt, max_seq = sources.checkpoint, sources.max_seq
    model = load_gpu_engine(ckpt, max_seq=max_seq, max_batch=max_batch, max_prompt=prompt_length(max_seq),
                            act_amax=placeholder_amax(ckpt.config), codec_fp16=codec_precision != "tf32", say=say)
    return model, load_tokenizer(sources)


def bench_options(command):
    for option in reversed([
        click.option("--engine", type=PATH, help="Engine directory."),
        click.option("--checkpoint", type=PATH, help="Checkpoint directory (torch backend)."),
        click.option("--backend", type=click.Choice(["torch", "ort", "trt"]), help="Default: ort with --engine, else torch."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True),
        click.option("--precision", type=click.Choice(["bf16", "fp8"])),
        click.option("--placeholder-scales", is_flag=True,
                     help="FP8 speed from a checkpoint with unit activation scales instead of calibrating (timing only)."),
        codec_precision_option,
        click.option("--text", default="The quick brown fox jumps over the lazy dog, twice, and then once more.",
                     show_default=True),
        click.option("--max-seq", type=int, help=MAX_SEQ_HELP),
        click.option("--rows", type=int, default=250, show_default=True,
                     help="Rows per request at most (random weights rarely emit EOC: this fixes the length)."),
        click.pass_context,
    ]):
        command = option(command)
    return command


@bench.command("decode")
@bench_options
@click.option("--batches", help="Batch sizes (GPU engine: one figure each; host-driven engines: the largest, prompts "
                                "decoded together).  [default: 1,8,64; host-driven engines: up to their slots]")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs (host-driven engines).")
def bench_decode(ctx, engine, checkpoint, backend, device, precision, placeholder_scales, codec_precision, text,
                 max_seq, rows, batches, repeats):
    """Time the decode loop. GPU engine: ms per step by batch size, host µs per row, audio-s/s, time to first audio,
    peak memory, ratio to the weight-read floor. Host-driven engines: ms per step, host overhead, codec, RTF."""
    from .decoding import Sampling
    from .options import sizes, within
    from .prompt import build_prompt

    batch_sizes = sizes("--batches", "1,8,64" if batches is None else batches, 512)
    within("--repeats", repeats, 1, 1000)
    within("--rows", rows, 8, 2048)
    model, tokenizer = _bench_engine(ctx, backend, checkpoint, engine, device, max_seq, max(batch_sizes), precision,
                                     placeholder_scales, codec_precision)
    prompt = build_prompt(tokenizer, text)
    say(f"{model.name} backend, prompt of {len(prompt)} tokens, at most {rows} rows")
    if model.name == "torch-cuda":
        from higgs_trt.builder.gpu_bench import bench_decode as gpu_bench_decode

        gpu_bench_decode(model, prompt, batch_sizes, rows, say=click.echo)
        return
    from .bench import run_bench

    batch = max(batch_sizes) if batches is not None else min(max(batch_sizes), model.max_batch)
    within("--batches", batch, 1, model.max_batch, "the engine's slots")
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=0)):
        click.echo(run_bench(model, [prompt] * batch, sampling, repeats, rows).line())


@bench.command("stream")
@bench_options
@click.option("--concurrency", default="1,8,64", show_default=True, help="Closed-loop clients, one figure each.")
@click.option("--requests", type=int, default=0, help="Requests per concurrency level [default: 2 × concurrency].")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--stagger", is_flag=True,
              help="Start the clients one after another over one request's rows, so that requests end and join at "
                   "different steps, as served traffic does [default: all at once].")
@click.option("--ref-seconds", type=float, default=0.0, show_default=True,
              help="Voice-clone load: every prompt carries a reference of this many seconds (1 to 30; random codes, "
                   "25 frames a second) with --text as its transcript.")
@click.option("--timeline", is_flag=True,
              help="GPU engine: run each level once more under torch's profiler and say where its time went (the "
                   "decode stream's busy time, its idle gaps by the scheduler or engine call running when each began, "
                   "the codec stream's overlap).")
@stream_plan_options
def bench_stream(ctx, engine, checkpoint, backend, device, precision, placeholder_scales, codec_precision, text,
                 max_seq, rows, concurrency, requests, temperature, stagger, ref_seconds, timeline, first_chunk, chunk,
                 context, holdback, first_holdback):
    """Streaming under load: audio-s/s, time to first audio p50/p95, underruns, per concurrency level (exact chunk
    seams unless the window options say otherwise)."""
    from .audio import MAX_SECONDS, MIN_SECONDS
    from .bench import bench_stream as run_stream
    from .options import sampling, sizes, within
    from .prompt import build_prompt

    levels = sizes("--concurrency", concurrency, 4096)
    within("--rows", rows, 8, 2048)
    within("--requests", requests, 0, 100_000)
    settings = sampling(temperature, 0, 1.0, 0)
    if not (ref_seconds == 0 or MIN_SECONDS <= ref_seconds <= MAX_SECONDS):
        raise HiggsError(f"--ref-seconds must be 0 (no reference) or lie in {MIN_SECONDS:g}..{MAX_SECONDS:g} (as "
                         f"--ref-audio's), got {ref_seconds}")
    stream_plan(first_chunk, chunk, context, holdback, first_holdback)  # sizes checked before any work
    if timeline and (backend or ("ort" if engine else "torch")) != "torch":
        raise HiggsError("--timeline profiles the GPU engine: --backend torch on a GPU")
    model, tokenizer = _bench_engine(ctx, backend, checkpoint, engine, device, max_seq, max(levels), precision,
                                     placeholder_scales, codec_precision)
    if timeline and model.name != "torch-cuda":
        raise HiggsError("--timeline profiles the GPU engine: --backend torch on a GPU (none here)")
    plan = stream_plan(first_chunk, chunk, context, holdback, first_holdback, model.codec_strides, warn=True)
    if ref_seconds:
        from .decoding import CODEBOOK_SIZE, FRAMES_PER_SECOND, NUM_CODEBOOKS

        frames = round(FRAMES_PER_SECOND * ref_seconds)
        ref_codes = np.random.default_rng(0).integers(0, CODEBOOK_SIZE, (frames, NUM_CODEBOOKS), dtype=np.int32)
        prompt = build_prompt(tokenizer, text, ref_codes, text)
    else:
        prompt = build_prompt(tokenizer, text)
    say(f"{model.name} backend, {model.max_batch} slots, prompt of {len(prompt)} tokens"
        + (f" ({ref_seconds:g} s reference)" if ref_seconds else "") + f", {rows} rows per request, "
        f"first chunk {plan.first} frames, then {plan.chunk}{'; clients staggered' if stagger else ''}")
    for c in levels:
        run_stream(model, prompt, c, c, rows, settings, plan, stagger)  # warm-up: the codec meets this level's windows
        level = partial(run_stream, model, prompt, c, requests or 2 * c, rows, settings, plan, stagger)
        click.echo(level().line())
        if timeline:
            from higgs_trt.builder.gpu_profile import profile_level

            click.echo(f"  (profiled: {profile_level(level, model, say=click.echo).line()})")


@bench.command("serve")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="A running `higgs-trt serve`.")
@click.option("--concurrency", default="1,8,64", show_default=True, help="Closed-loop clients, one figure each.")
@click.option("--requests", type=int, default=0, help="Requests per concurrency level [default: 2 × concurrency].")
@click.option("--max-new-tokens", type=int, default=250, show_default=True,
              help="Decode steps per request at most (random weights rarely end an utterance: this fixes the length).")
@click.option("--text", default="The quick brown fox jumps over the lazy dog, twice, and then once more.",
              show_default=True)
@click.option("--voice", default="default", show_default=True)
@click.option("--wait", type=float, default=600.0, show_default=True,
              help="Seconds (0 to 86400) to wait for the server's /health to turn 200 before measuring (saying every "
                   "30 s that it still waits).")
def bench_serve(url, concurrency, requests, max_new_tokens, text, voice, wait):
    """A running server measured at the client: streamed pcm over HTTP, audio-s/s and time to first audio p50/p95
    per concurrency level (from sending the request to the first audio byte), underruns."""
    from . import extras
    from .options import seconds_within, server_url, sizes, within
    from .prompt import check_text

    url = server_url("--url", url)
    levels = sizes("--concurrency", concurrency, 4096)
    within("--requests", requests, 0, 100_000)
    within("--max-new-tokens", max_new_tokens, 8, 2048)
    seconds_within("--wait", wait, 0, 86400)
    check_text(text, "--text")  # here, not as 400s from the server after the wait for it
    with extras.needed("serve", "bench serve"):
        from .bench_serve import run_bench_serve
    run_bench_serve(url, levels, requests, max_new_tokens, text, voice, wait, say=say, echo=click.echo)


@bench.command("encode")
@encoder_source
@click.option("--seconds", type=float, default=10.0, show_default=True, help="Reference length (1 to 30).")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True, help="Timed encodes (median shown).")
@click.pass_context
def bench_encode(ctx, engine, checkpoint, backend, device, seconds, repeats):
    """Time encoding a reference: reading + resampling a 44.1 kHz stereo wav, then the codec encoder alone."""
    from . import extras
    from .audio import MAX_SECONDS, MIN_SECONDS
    from .bench_encode import run_encode_bench
    from .engines import choose_backend, open_encoder, open_sources
    from .options import seconds_within

    seconds_within("--seconds", seconds, MIN_SECONDS, MAX_SECONDS)
    name = choose_backend(backend, engine, checkpoint, device, given(ctx))
    encoder = open_encoder(open_sources(name, engine, checkpoint, None, None), device)
    with extras.needed("audio", "bench encode"):
        click.echo(run_encode_bench(encoder, seconds, repeats))


@main.command()
def doctor():
    """What TensorRT / TensorRT-RTX / lean runtime / ONNX Runtime / GPU this machine has, and what works here."""
    from .doctor import report

    facts, modes = report()
    width = max(len(k) for k, _ in facts)
    for key, value in facts:
        click.echo(f"{key:<{width}}  {value}")
    click.echo("")
    for mode, ok, needs in modes:
        click.echo(f"  [{'x' if ok else ' '}] {mode}" + ("" if ok else f"  ({needs})"))


from higgs_trt.builder import cli as build_commands  # noqa: E402  (click only: heavy imports run in the commands)

for command in build_commands.COMMANDS:
    main.add_command(command)
for command in build_commands.BENCHMARKS:
    bench.add_command(command)

if __name__ == "__main__":
    main()
