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


def given(ctx: click.Context) -> set[str]:
    """The options the user set (on the command line or through the environment), not left at their defaults."""
    return {k for k in ctx.params if ctx.get_parameter_source(k) not in (None, click.core.ParameterSource.DEFAULT)}


def choose_backend(name: str | None, engine: Path | None, checkpoint: Path | None, device: str,
                   options: set[str]) -> str:
    """The backend `run` / `bench decode` will use; options that do not apply to it are refused, not ignored."""
    if checkpoint is None and engine is None:
        raise HiggsError("give --engine DIR (an exported engine directory) or --checkpoint DIR (torch backend)")
    name = name or ("ort" if engine else "torch")
    if name == "torch":
        if checkpoint is None:
            raise HiggsError("--backend torch needs --checkpoint")
        for option in ("engine", "precision"):
            if option in options:
                raise HiggsError(f"--{option} does not apply to --backend torch (it runs --checkpoint's weights)")
    else:
        if engine is None:
            raise HiggsError(f"--backend {name} needs --engine")
        if "max_seq" in options:
            raise HiggsError(f"--max-seq applies to --backend torch only; --backend {name} uses the cache length "
                             "the engine was exported with")
    allowed = {"torch": ("auto", "cpu", "cuda"), "ort": ("auto", "cpu", "cuda"), "trt": ("auto", "cuda", "lean")}[name]
    if device not in allowed:
        raise HiggsError(f"--device {device} does not apply to --backend {name} (it takes {', '.join(allowed)})")
    return name


def open_sources(engine_dir: Path | None, checkpoint: Path | None, backend: str, precision: str | None, max_seq: int):
    """(EngineDir or None, Checkpoint or None), verified and checked against each other; no weights are read yet."""
    from .manifest import EngineDir
    from .options import within

    engine = EngineDir(engine_dir) if engine_dir and backend != "torch" else None
    if engine and precision and engine.manifest["precision"] != precision:
        raise HiggsError(f"{engine_dir} holds {engine.manifest['precision']} engines, not {precision}")
    ckpt = _open_checkpoint(checkpoint, f"--checkpoint with --backend {backend}") if checkpoint else None
    if engine and ckpt:
        engine.check_checkpoint(ckpt.fingerprint(), checkpoint)
    if backend == "torch":
        within("--max-seq", max_seq, 1, ckpt.config.max_position_embeddings, "the model's max_position_embeddings")
    return engine, ckpt


def load_tokenizer(engine, ckpt):
    """The tokenizer of the engine (else the checkpoint), checked against the model's text vocabulary."""
    from .prompt import HiggsTokenizer

    if engine:
        return HiggsTokenizer(engine.path / "tokenizer.json", engine.manifest["model"]["text_vocab_size"])
    return HiggsTokenizer(ckpt.dir / "tokenizer.json", ckpt.config.text_vocab_size)


def check_prompt_fits(prompt, engine) -> None:
    """An engine's prefill takes at most the max-prompt it was exported with (the torch reference has no such bound;
    every backend refuses a prompt that leaves too few cache rows when decoding starts)."""
    limit = engine.manifest["limits"]["max_prompt"] if engine else None
    if limit is not None and len(prompt) > limit:
        raise HiggsError(f"text too long: the prompt takes {len(prompt)} tokens, the engine's prefill takes at most "
                         f"{limit} (its --max-prompt)")


def load_backend(name: str, engine, ckpt, max_seq: int, device: str):
    from . import extras

    if name == "torch":
        import torch

        from higgs_trt.builder.torch_backend import TorchBackend

        if device == "cuda" and not torch.cuda.is_available():
            raise HiggsError("--device cuda needs torch built with CUDA and an NVIDIA GPU")
        return TorchBackend(ckpt, max_seq=max_seq, device=None if device == "auto" else device)
    if name == "trt":
        from .trt_backend import TrtBackend

        return TrtBackend(engine, "lean" if device == "lean" else "tensorrt")
    with extras.needed("ort", "--backend ort"):
        from .ort_backend import OrtBackend
    return OrtBackend(engine, device)


def check_outputs(out: Path, codes_out: Path | None, inputs) -> None:
    from .outputs import output_file

    targets = [output_file(path, inputs) for path in (out, codes_out) if path is not None]
    if len(set(targets)) < len(targets):
        raise HiggsError(f"--out and --codes-out name the same file ({out})")


@main.command()
@click.option("--text", required=True, help="Text to speak (inline style tags like <|emotion:elation|> allowed).")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="Output wav (24 kHz mono).")
@click.option("--engine", type=click.Path(path_type=Path), help="Engine directory made by `higgs-trt export`.")
@click.option("--checkpoint", type=click.Path(path_type=Path),
              help="Checkpoint directory (torch backend); with --engine, checked to be the engine's source.")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt"]),
              help="torch: the reference model from --checkpoint; ort: ONNX Runtime on --engine's reference graphs; "
                   "trt: TensorRT on --engine's plans. Default: ort with --engine, else torch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True,
              help="torch, ort: cpu or cuda; trt: lean loads --lean plans with tensorrt_lean.")
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), help="Refuse an engine of another precision.")
@click.option("--ref-codes", type=click.Path(path_type=Path), help="Voice clone: reference audio codes [T,8] (.npy).")
@click.option("--ref-text", help="Voice clone: transcript of the reference audio (needs --ref-codes).")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 is greedy (argmax).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely codes (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1] (1: off).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed 0..2**63-1: same seed, same audio.")
@click.option("--codes-out", type=click.Path(path_type=Path), help="Also save the final frames [T,8] (.npy).")
@click.option("--max-seq", type=int, default=2048, show_default=True, help="KV-cache length (torch backend only).")
@click.pass_context
def run(ctx, text, out, engine, checkpoint, backend, device, precision, ref_codes, ref_text, temperature, top_k, top_p,
        seed, codes_out, max_seq):
    """Speak TEXT into a wav file."""
    from .generate import generate
    from .options import sampling
    from .outputs import write_file
    from .prompt import build_prompt, check_text, load_reference_codes
    from .wav import SAMPLE_RATE, write_wav

    backend = choose_backend(backend, engine, checkpoint, device, given(ctx))
    settings = sampling(temperature, top_k, top_p, seed)
    check_text(text)
    if ref_text is not None:
        if ref_codes is None:
            raise HiggsError("--ref-text needs --ref-codes (the transcript of which reference audio?)")
        check_text(ref_text, "reference text")
    check_outputs(out, codes_out, (checkpoint, engine, ref_codes))
    ref = load_reference_codes(ref_codes) if ref_codes else None

    t0 = time.perf_counter()
    engine, ckpt = open_sources(engine, checkpoint, backend, precision, max_seq)
    prompt = build_prompt(load_tokenizer(engine, ckpt), text, ref, ref_text)
    check_prompt_fits(prompt, engine)
    model = load_backend(backend, engine, ckpt, max_seq, device)
    say(f"loaded {model.name} backend in {time.perf_counter() - t0:.1f} s; prompt of {len(prompt)} tokens")

    t0 = time.perf_counter()
    result = generate(model, [prompt], settings)[0]
    seconds = len(result.audio) / SAMPLE_RATE
    say(f"decoded {result.rows} rows in {time.perf_counter() - t0:.1f} s → {len(result.frames)} frames, "
        f"{seconds:.2f} s of audio (stopped by {result.stop_reason})")

    if codes_out is not None:
        def save_codes(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.save(f, result.frames)

        write_file(codes_out, save_codes)
    clipped = write_wav(out, result.audio)
    say(f"wrote {out}" + (f" ({clipped} samples clipped to ±1)" if clipped else ""))


@main.group()
def bench():
    """Benchmarks that print figures: decode loop, export memory, BF16 vs FP8 builds, plugin kernels."""


@bench.command("decode")
@click.option("--engine", type=click.Path(path_type=Path), help="Engine directory (ort backend).")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Checkpoint directory (torch backend).")
@click.option("--backend", type=click.Choice(["torch", "ort", "trt"]), help="Default: ort with --engine, else torch.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "lean"]), default="auto", show_default=True)
@click.option("--text", default="The quick brown fox jumps over the lazy dog, twice, and then once more.",
              show_default=True)
@click.option("--batch", type=int, default=1, show_default=True, help="Prompts decoded together.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs (the median run is shown).")
@click.option("--max-seq", type=int, default=2048, show_default=True, help="KV-cache length (torch backend only).")
@click.pass_context
def bench_decode(ctx, engine, checkpoint, backend, device, text, batch, repeats, max_seq):
    """Time the decode loop: ms per row in the engine, host overhead per row, codec time, real-time factor."""
    from .bench import run_bench
    from .decoding import Sampling
    from .options import within
    from .prompt import build_prompt

    backend = choose_backend(backend, engine, checkpoint, device, given(ctx))
    within("--repeats", repeats, 1, 1000)
    engine, ckpt = open_sources(engine, checkpoint, backend, None, max_seq)
    model = load_backend(backend, engine, ckpt, max_seq, device)
    within("--batch", batch, 1, model.max_batch, "the backend's largest batch")
    prompt = build_prompt(load_tokenizer(engine, ckpt), text)
    check_prompt_fits(prompt, engine)
    say(f"{model.name} backend, batch {batch}, prompt of {len(prompt)} tokens; median of {repeats} runs")
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=0)):
        click.echo(run_bench(model, [prompt] * batch, sampling, repeats).line())


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
