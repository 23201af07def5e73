"""`higgs-trt`: the command line. Stage commands import their heavy dependencies only when they run."""

import time
from pathlib import Path

import click
import numpy as np

from .errors import HiggsError


class Cli(click.Group):
    """Turns HiggsError into a one-line `Error: ...` and exit code 1, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HiggsError as e:
            raise click.ClickException(str(e)) from None


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="higgs-trt")
def main():
    """Higgs Audio v3 text-to-speech on TensorRT: export, build, run and compare."""


def say(msg: str) -> None:
    click.echo(msg, err=True)


def _open_checkpoint(path: Path, what: str):
    from . import extras

    with extras.needed("builder", what):
        from higgs_trt.builder.checkpoint import Checkpoint
    return Checkpoint(path)


def _backend(name: str | None, checkpoint: Path | None, engine_dir: Path | None, max_seq: int, device: str,
             precision: str | None = None):
    """(backend, tokenizer.json) for `run`; an engine given with a checkpoint must have been built from it."""
    from .manifest import EngineDir

    if checkpoint is None and engine_dir is None:
        raise HiggsError("give --engine DIR (an exported engine directory) or --checkpoint DIR (torch backend)")
    engine = EngineDir(engine_dir) if engine_dir else None
    if engine and precision and engine.manifest["precision"] != precision:
        raise HiggsError(f"{engine_dir} holds {engine.manifest['precision']} engines, not {precision}")
    ckpt = _open_checkpoint(checkpoint, f"--checkpoint with --backend {name}") if checkpoint else None
    if engine and ckpt:
        engine.check_checkpoint(ckpt.fingerprint(), checkpoint)
    name = name or ("ort" if engine else "torch")
    if name == "torch":
        if ckpt is None:
            raise HiggsError("--backend torch needs --checkpoint")
        from higgs_trt.builder.torch_backend import TorchBackend

        return TorchBackend(ckpt, max_seq=max_seq), checkpoint / "tokenizer.json"
    if engine is None:
        raise HiggsError(f"--backend {name} needs --engine")
    from . import extras

    if name == "trt":
        from .trt_backend import TrtBackend

        return TrtBackend(engine, "lean" if device == "lean" else "tensorrt"), engine.path / "tokenizer.json"
    with extras.needed("ort", "--backend ort"):
        from .ort_backend import OrtBackend
    return OrtBackend(engine, device), engine.path / "tokenizer.json"


def _encoder(name: str | None, checkpoint: Path | None, engine_dir: Path | None, device: str):
    """The codec encoder for reference audio: torch on --checkpoint, or ort/trt on --engine's codec_encoder graph."""
    from .manifest import EngineDir

    if checkpoint is None and engine_dir is None:
        raise HiggsError("give --engine DIR (an exported engine directory) or --checkpoint DIR (torch backend)")
    engine = EngineDir(engine_dir) if engine_dir else None
    name = name or ("ort" if engine else "torch")
    if name == "torch":
        if checkpoint is None:
            raise HiggsError("--backend torch needs --checkpoint")
        ckpt = _open_checkpoint(checkpoint, "encoding reference audio with --backend torch")
        if engine:
            engine.check_checkpoint(ckpt.fingerprint(), checkpoint)
        from higgs_trt.builder.codec_encoder import TorchEncoder, has_encoder

        if not has_encoder(ckpt):
            raise HiggsError(f"{checkpoint}: carries no codec encoder tensors; clone from reference codes (--ref-codes)")
        return TorchEncoder(ckpt)
    if engine is None:
        raise HiggsError(f"--backend {name} needs --engine")
    if "codec_encoder" not in engine.manifest["graphs"]:
        raise HiggsError(f"{engine.path}: has no codec encoder (codec_encoder.onnx): its checkpoint carries no encoder "
                         "tensors, or an older version exported it; clone from reference codes (--ref-codes)")
    if name == "trt":
        from .trt_encoder import TrtEncoder

        return TrtEncoder(engine, "lean" if device == "lean" else "tensorrt")
    from . import extras

    with extras.needed("ort", "--backend ort"):
        from .ort_backend import OrtEncoder
    return OrtEncoder(engine, "auto" if device == "lean" else device)


def _reference_codes(path: Path, backend: str | None, checkpoint: Path | None, engine: Path | None, device: str):
    """Reference codes [T, 8] from an audio file, and a line saying what was done."""
    from .audio import encode_reference, load_reference_audio

    audio = load_reference_audio(path)  # every check before any model is loaded
    t0 = time.perf_counter()
    encoder = _encoder(backend, checkpoint, engine, device)
    codes = encode_reference(audio, encoder)
    return codes, (f"encoded {audio.seconds:.2f} s of reference audio ({audio.source_rate} Hz) → {len(codes)} frames "
                   f"with the {encoder.name} encoder in {time.perf_counter() - t0:.1f} s")


@main.command()
@click.option("--text", required=True, help="Text to speak (inline control tags like <|emotion:elation|> allowed).")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="Output wav (24 kHz mono).")
@click.option("--engine", type=click.Path(path_type=Path), help="Engine directory made by `higgs-trt export`.")
@click.option("--checkpoint", type=click.Path(path_type=Path),
              help="Checkpoint directory (torch backend); with --engine, checked to be the engine's source.")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt"]),
              help="torch: the reference model from --checkpoint; ort: ONNX Runtime on --engine's reference graphs; "
                   "trt: TensorRT on --engine's plans. Default: ort with --engine, else torch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True,
              help="ort: cpu or cuda (onnxruntime-gpu); trt: lean loads --lean plans with tensorrt_lean.")
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), help="Refuse an engine of another precision.")
@click.option("--ref-codes", type=click.Path(path_type=Path), help="Voice clone: reference audio codes [T,8] (.npy).")
@click.option("--ref-audio", type=click.Path(path_type=Path),
              help="Voice clone: a reference recording (wav/flac/ogg/mp3, mono or stereo, 1–30 s), encoded with the "
                   "backend's codec encoder.")
@click.option("--ref-text", help="Voice clone: transcript of the reference audio.")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 is greedy (argmax).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely codes (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1: off).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed: same seed, same audio.")
@click.option("--codes-out", type=click.Path(path_type=Path), help="Also save the final frames [T,8] (.npy).")
@click.option("--max-seq", type=int, default=2048, show_default=True, help="KV-cache length (torch backend).")
def run(text, out, engine, checkpoint, backend, device, precision, ref_codes, ref_audio, ref_text, temperature, top_k,
        top_p, seed, codes_out, max_seq):
    """Speak TEXT into a wav file."""
    from .decoding import Sampling
    from .generate import generate
    from .prompt import HiggsTokenizer, build_prompt, load_reference_codes
    from .wav import SAMPLE_RATE, check_writable, write_atomic, write_wav

    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise HiggsError("need temperature ≥ 0, top-k ≥ 0 and 0 < top-p ≤ 1")
    for path in (out, codes_out):
        if path is not None:
            check_writable(path)
    if ref_codes and ref_audio:
        raise HiggsError("give --ref-codes or --ref-audio, not both")
    ref = load_reference_codes(ref_codes) if ref_codes else None
    if ref_audio:
        ref, done = _reference_codes(ref_audio, backend, checkpoint, engine, device)
        say(done)

    t0 = time.perf_counter()
    model, tokenizer_path = _backend(backend, checkpoint, engine, max_seq, device, precision)
    prompt = build_prompt(HiggsTokenizer(tokenizer_path), text, ref, ref_text)
    say(f"loaded {model.name} backend in {time.perf_counter() - t0:.1f} s; prompt of {len(prompt)} tokens")

    t0 = time.perf_counter()
    result = generate(model, [prompt], Sampling(temperature, top_k, top_p, seed))[0]
    seconds = len(result.audio) / SAMPLE_RATE
    say(f"decoded {result.rows} rows in {time.perf_counter() - t0:.1f} s → {len(result.frames)} frames, "
        f"{seconds:.2f} s of audio (stopped by {result.stop_reason})")

    if codes_out is not None:
        def save_codes(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.save(f, result.frames)

        write_atomic(codes_out, save_codes)
    clipped = write_wav(out, result.audio)
    say(f"wrote {out}" + (f" ({clipped} samples clipped to ±1)" if clipped else ""))


@main.command("encode-audio")
@click.option("--audio", type=click.Path(path_type=Path), required=True,
              help="Reference recording: wav/flac/ogg/mp3, mono or stereo, 1–30 s.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Codes to write: frames [T,8] int32 (.npy).")
@click.option("--engine", type=click.Path(path_type=Path), help="Engine directory (its codec_encoder graph or plan).")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Checkpoint directory (torch encoder).")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt"]), help="Default: ort with --engine, else torch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True)
def encode_audio(audio, out, engine, checkpoint, backend, device):
    """Encode a reference recording into codes for `run --ref-codes` (the layout --codes-out writes)."""
    from .wav import check_writable, write_atomic

    check_writable(out)
    codes, done = _reference_codes(audio, backend, checkpoint, engine, device)

    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, codes)

    write_atomic(out, save)
    say(f"{done}; wrote {out}")


@main.group()
def bench():
    """Benchmarks that print figures: decode loop, reference encoding, export memory, BF16 vs FP8 builds, plugin kernels."""


@bench.command("decode")
@click.option("--engine", type=click.Path(path_type=Path), help="Engine directory (ort backend).")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Checkpoint directory (torch backend).")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt"]), help="Default: ort with --engine, else torch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True)
@click.option("--text", default="The quick brown fox jumps over the lazy dog, twice, and then once more.",
              show_default=True)
@click.option("--batch", type=int, default=1, show_default=True, help="Prompts decoded together.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs (the median run is shown).")
@click.option("--max-seq", type=int, default=2048, show_default=True, help="KV-cache length (torch backend).")
def bench_decode(engine, checkpoint, backend, device, text, batch, repeats, max_seq):
    """Time the decode loop: ms per row in the engine, host overhead per row, codec time, real-time factor."""
    from .bench import run_bench
    from .decoding import Sampling
    from .prompt import HiggsTokenizer, build_prompt

    model, tokenizer_path = _backend(backend, checkpoint, engine, max_seq, device)
    prompts = [build_prompt(HiggsTokenizer(tokenizer_path), text)] * batch
    say(f"{model.name} backend, batch {batch}, prompt of {len(prompts[0])} tokens; median of {repeats} runs")
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=0)):
        click.echo(run_bench(model, prompts, sampling, repeats).line())


@bench.command("encode")
@click.option("--engine", type=click.Path(path_type=Path), help="Engine directory (ort or trt encoder).")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Checkpoint directory (torch encoder).")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt"]), help="Default: ort with --engine, else torch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True)
@click.option("--seconds", type=click.FloatRange(1, 30), default=10.0, show_default=True, help="Reference length.")
@click.option("--repeats", type=click.IntRange(1), default=5, show_default=True, help="Timed encodes (median shown).")
def bench_encode(engine, checkpoint, backend, device, seconds, repeats):
    """Time encoding a reference: reading + resampling a 44.1 kHz stereo wav, then the codec encoder alone."""
    from . import extras
    from .bench_encode import run_encode_bench

    encoder = _encoder(backend, checkpoint, engine, device)
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
