"""`run` (text → wav, or streamed PCM) and `encode-audio` (a reference recording → codes)."""

import io
import time
from pathlib import Path

import click
import numpy as np

from higgs_trt.runtime.errors import HiggsError

from .options import (codec_precision_option, engine_source, given, max_seq_option, precision_option, say, stream_plan,
                      stream_plan_options)
from .paths import FILE_OUT, PATH, NonEmptyPath


def npy_writer(array: np.ndarray):
    """write_file's writer of `array` as an .npy file. Through a buffer: np.save into a file writes small arrays
    with C stdio and misses its failed flush, so a full disk left a truncated file reported as written."""
    def write(tmp: Path) -> None:
        buffer = io.BytesIO()
        np.save(buffer, array)
        tmp.write_bytes(buffer.getbuffer())

    return write


def check_outputs(out: Path | None, codes_out: Path | None, inputs) -> None:
    from higgs_trt.runtime.outputs import output_file

    targets = [output_file(path, inputs) for path in (out, codes_out) if path is not None]
    if len(set(targets)) < len(targets):
        raise HiggsError(f"--out and --codes-out name the same file ({out})")


@click.command()
@click.option("--text", required=True, help="Text to speak (inline style tags like <|emotion:elation|> allowed).")
@click.option("--out", "out", type=NonEmptyPath(allow_dash=True, file_output=True), required=True,
              help="Output wav (24 kHz mono); with --stream, '-' writes raw PCM (s16le, 24 kHz, mono) to stdout.")
@engine_source
@precision_option
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
@max_seq_option
@click.option("--stream", is_flag=True, help="Write audio as it is decoded (time to first audio on stderr).")
@stream_plan_options
@click.pass_context
def run(ctx, text, out, engine, checkpoint, backend, device, precision, codec_precision, ref_codes, ref_audio, ref_text,
        temperature, top_k, top_p, seed, codes_out, max_seq, stream, first_chunk, chunk, context, holdback,
        first_holdback):
    """Speak TEXT into a wav file (or stream it as it is decoded)."""
    import sys

    from higgs_trt.runtime.options import sampling
    from higgs_trt.runtime.outputs import write_file
    from higgs_trt.runtime.prompt import build_prompt, check_text, load_reference_codes
    from higgs_trt.runtime.scheduler import Scheduler, request_for
    from higgs_trt.runtime.sinks import PcmSink, WavSink
    from higgs_trt.runtime.wav import SAMPLE_RATE, write_wav

    from .engines import check_codec_precision, choose_backend, load_tokenizer, open_engine, open_sources, reference_codes

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
        ref, done = reference_codes(ref_audio, sources, device)
        say(done)
    model = open_engine(sources, device=device, precision=precision, codec_precision=codec_precision, say=say)
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


@click.command("encode-audio")
@click.option("--audio", type=PATH, required=True, help="Reference recording: wav/flac/ogg/mp3, mono or stereo, 1–30 s.")
@click.option("--out", type=FILE_OUT, required=True, help="Codes to write: frames [T,8] int32 (.npy).")
@engine_source
@click.pass_context
def encode_audio(ctx, audio, out, engine, checkpoint, backend, device):
    """Encode a reference recording into codes for `run --ref-codes` (the layout --codes-out writes)."""
    from higgs_trt.runtime.outputs import output_file, write_file

    from .engines import choose_backend, open_sources, reference_codes

    inputs = (checkpoint, engine, audio)
    output_file(out, inputs)
    sources = open_sources(choose_backend(backend, engine, checkpoint, device, given(ctx)), engine, checkpoint, None, None)
    codes, done = reference_codes(audio, sources, device)
    write_file(out, npy_writer(codes), inputs)
    say(f"{done}; wrote {out}")
