"""`run` (text → wav, or streamed PCM) and `encode-audio` (a reference recording → codes)."""

import io
import time
from pathlib import Path

import click
import numpy as np

from higgs_trt.runtime.decoding import HARD_CAP_ROWS
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.longform import DEFAULT_HISTORY

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


def read_text_file(path: Path) -> str:
    from higgs_trt.runtime.inputs import TEXT_BYTES, input_file

    try:
        return input_file(path, TEXT_BYTES).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise HiggsError(f"{path}: not UTF-8 text (byte {e.start})") from None


def speaker_voices(speakers: tuple[str, ...]) -> dict[str, str]:
    """--speaker S1=NAME … → {S1: NAME}, each tag once."""
    from higgs_trt.runtime.longform import SPEAKER_KEY

    mapping = {}
    for entry in speakers:
        key, _, name = entry.partition("=")
        if not SPEAKER_KEY.fullmatch(key) or not name:
            raise HiggsError(f"--speaker {entry!r}: give TAG=VOICE, the tag S1 to S99 (e.g. S1=alice)")
        if key in mapping:
            raise HiggsError(f"--speaker {key} is given twice")
        mapping[key] = name
    return mapping


def named_voices(directory: Path | None, mapping: dict[str, str], tokenizer, sources, device: str) -> dict:
    """The voices --speaker names ({NAME: Reference}), read from --voices (recordings encoded with the backend's
    codec encoder)."""
    from higgs_trt.runtime.audio import encode_reference
    from higgs_trt.runtime.longform import Reference
    from higgs_trt.runtime.server.voices import VoiceStore

    if directory is not None and not mapping:
        raise HiggsError("--voices applies to --speaker (the voices of [S1] … turns)")
    store = VoiceStore(directory, tokenizer)
    unknown = sorted({name for name in mapping.values() if name not in store.voices})
    if unknown:
        raise HiggsError(f"--speaker: no voice {unknown[0]!r} (known: {', '.join(sorted(store.voices))})")
    encoder = None
    voices = {}
    for name in set(mapping.values()):
        voice = store.voices[name]
        if voice.audio is not None:
            from .engines import open_encoder

            encoder = encoder or open_encoder(sources, device)
            voice.codes, voice.audio = encode_reference(voice.audio, encoder), None
        voices[name] = Reference(voice.codes, voice.text)
    return voices


class StdinText:
    """Standard input, read as it arrives (a pipe from an LLM), fed to the request's script: each segment is spoken
    as soon as its text is complete. A read or text error cancels the request and is reported by the command."""

    def __init__(self, scheduler, request):
        import threading

        self.scheduler, self.request, self.error = scheduler, request, None
        threading.Thread(target=self._read, name="higgs-stdin", daemon=True).start()

    def _read(self) -> None:
        import codecs
        import os
        import sys

        from higgs_trt.runtime.prompt import check_text

        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            while chunk := os.read(sys.stdin.fileno(), 4096):
                text = decoder.decode(chunk)
                if text.strip():
                    check_text(text, "standard input")
                self.scheduler.feed_text(self.request, text)
            self.scheduler.feed_text(self.request, decoder.decode(b"", final=True), finish=True)
        except (HiggsError, UnicodeDecodeError, OSError) as e:
            self.error = f"standard input: {e}" if not isinstance(e, HiggsError) else str(e)
            self.scheduler.cancel(self.request)


def check_outputs(out: Path | None, codes_out: Path | None, inputs) -> None:
    from higgs_trt.runtime.outputs import output_file

    targets = [output_file(path, inputs) for path in (out, codes_out) if path is not None]
    if len(set(targets)) < len(targets):
        raise HiggsError(f"--out and --codes-out name the same file ({out})")


@click.command()
@click.option("--text", help="Text to speak (inline style tags like <|emotion:elation|> allowed; [S1] … [S2] … "
                             "turns with --speaker); '-' reads it from standard input as it arrives.")
@click.option("--text-file", type=NonEmptyPath(allow_dash=True),
              help="Read the text from this UTF-8 file ('-': standard input, spoken as it arrives).")
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
@click.option("--max-new-tokens", type=int, default=HARD_CAP_ROWS, show_default=True,
              help="Decode steps (rows of 8 codes, 25 a second) each segment may take at most.")
@click.option("--voices", "voices_dir", type=PATH,
              help="Named voices for --speaker: NAME.wav|.flac|.ogg|.mp3 or NAME.npy/.npz, as `serve --voices`.")
@click.option("--speaker", "speakers", multiple=True, metavar="S1=NAME",
              help="Dialogue: the voice of tag [S1] in the text (a name from --voices, or 'default'); repeat per speaker.")
@click.option("--history", type=click.IntRange(0, 8), default=DEFAULT_HISTORY, show_default=True,
              help="Long texts: earlier segments of the same voice carried in each segment's prompt, at most.")
@click.option("--codes-out", type=FILE_OUT, help="Also save the final frames [T,8] (.npy).")
@max_seq_option
@click.option("--stream", is_flag=True, help="Write audio as it is decoded (time to first audio on stderr).")
@stream_plan_options
@click.pass_context
def run(ctx, text, text_file, out, engine, checkpoint, backend, device, precision, codec_precision, ref_codes, ref_audio,
        ref_text, temperature, top_k, top_p, seed, max_new_tokens, voices_dir, speakers, history, codes_out, max_seq,
        stream,
        first_chunk, chunk, context, holdback, first_holdback):
    """Speak the text into a wav file (or stream it as it is decoded). Text longer than one prompt is spoken in
    segments, each continuing the voice and the audio of the one before."""
    import sys

    from higgs_trt.runtime.longform import Reference, Script, plan_text
    from higgs_trt.runtime.options import sampling, within
    from higgs_trt.runtime.outputs import write_file
    from higgs_trt.runtime.prompt import check_text, load_reference_codes
    from higgs_trt.runtime.request import MIN_ROWS, request_for
    from higgs_trt.runtime.scheduler import Scheduler
    from higgs_trt.runtime.sinks import PcmSink, WavSink
    from higgs_trt.runtime.wav import SAMPLE_RATE, write_wav

    from .engines import check_codec_precision, choose_backend, load_tokenizer, open_engine, open_sources, reference_codes

    settings = sampling(temperature, top_k, top_p, seed)
    within("--max-new-tokens", max_new_tokens, MIN_ROWS, HARD_CAP_ROWS)
    if (text is None) == (text_file is None):
        raise HiggsError("give the text with --text or --text-file (one of them)")
    incremental = "-" in (text, str(text_file))
    if text_file is not None and not incremental:
        text = read_text_file(text_file)
    if not incremental:
        check_text(text)
    mapping = speaker_voices(speakers)
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
    inputs = (checkpoint, engine, ref_codes, ref_audio, text_file if not incremental else None, voices_dir)
    check_outputs(None if to_stdout else out, codes_out, inputs)
    stream_plan(first_chunk, chunk, context, holdback, first_holdback)  # sizes checked before any work
    ref = load_reference_codes(ref_codes) if ref_codes else None

    t0 = time.perf_counter()
    name = choose_backend(backend, engine, checkpoint, device, given(ctx))
    sources = open_sources(name, engine, checkpoint, precision, max_seq)
    check_codec_precision(sources, device, codec_precision)
    tokenizer = load_tokenizer(sources)
    if ref_audio:
        ref, done = reference_codes(ref_audio, sources, device)
        say(done)
    voices = named_voices(voices_dir, mapping, tokenizer, sources, device)
    model = open_engine(sources, device=device, precision=precision, codec_precision=codec_precision, say=say)
    windows = stream_plan(first_chunk, chunk, context, holdback, first_holdback, model.codec_strides, warn=True)
    voice = Reference(ref, ref_text)
    cast = {key: voices[name] for key, name in mapping.items()} or None
    if incremental:
        script, prompt = Script(tokenizer, voice, cast, model.max_prompt, history), None
    else:
        prompt, script = plan_text(tokenizer, text, voice, cast, model.max_prompt, history)
    request = request_for(model, prompt, settings, max_new_tokens, script=script)
    say(f"loaded {model.name} backend in {time.perf_counter() - t0:.1f} s"
        + (f"; prompt of {len(prompt)} tokens" if prompt is not None else "; reading the text from standard input"))

    sink = None
    try:  # whatever stops the command from here on (a failed write, Ctrl-C) takes the growing wav with it
        sink = (PcmSink(sys.stdout.buffer) if to_stdout else WavSink(out, inputs)) if stream else None
        request.on_chunk = sink.write if sink else None
        scheduler = Scheduler(model, windows)
        scheduler.submit(request)
        reader = StdinText(scheduler, request) if incremental else None
        scheduler.run()
        if reader is not None and reader.error:
            raise HiggsError(reader.error)
        if request.error:
            raise HiggsError(request.error)
        s = request.stream
        frames = s.frames()
        seconds = len(frames) * 960 / SAMPLE_RATE
        wall = request.finished_at - request.submitted_at
        first = (f"first audio after {1e3 * (request.first_audio_at - request.submitted_at):.0f} ms, "
                 if request.first_audio_at else "")
        segments = f" in {s.segments} segments" if s.segments > 1 else ""
        say(f"decoded {s.total_rows} rows{segments} → {len(frames)} frames, {seconds:.2f} s of audio (stopped by "
            f"{request.utterance.stop_reason}); {first}{wall:.2f} s in all, real-time factor "
            f"{wall / max(seconds, 1e-9):.3f}")

        if codes_out is not None:
            write_file(codes_out, npy_writer(frames), inputs)
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
