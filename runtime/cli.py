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


def _backend(name: str, checkpoint: Path | None, engine: Path | None, max_seq: int):
    if name == "torch":
        if checkpoint is None:
            raise HiggsError("--backend torch needs --checkpoint")
        from . import extras

        with extras.needed("builder", "--backend torch"):
            from higgs_trt.builder.torch_backend import TorchBackend
        return TorchBackend(checkpoint, max_seq=max_seq), checkpoint / "tokenizer.json"
    raise HiggsError(f"unknown backend {name!r}")


@main.command()
@click.option("--text", required=True, help="Text to speak (inline control tags like <|emotion:elation|> allowed).")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, help="Output wav (24 kHz mono).")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Checkpoint directory (torch backend).")
@click.option("--backend", type=click.Choice(["torch"]), default="torch", show_default=True,
              help="torch: the reference model straight from the checkpoint.")
@click.option("--ref-codes", type=click.Path(path_type=Path), help="Voice clone: reference audio codes [T,8] (.npy).")
@click.option("--ref-text", help="Voice clone: transcript of the reference audio.")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 is greedy (argmax).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely codes (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1: off).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed: same seed, same audio.")
@click.option("--codes-out", type=click.Path(path_type=Path), help="Also save the final frames [T,8] (.npy).")
@click.option("--max-seq", type=int, default=2048, show_default=True, help="KV-cache length (torch backend).")
def run(text, out, checkpoint, backend, ref_codes, ref_text, temperature, top_k, top_p, seed, codes_out, max_seq):
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
    ref = load_reference_codes(ref_codes) if ref_codes else None

    t0 = time.perf_counter()
    engine, tokenizer_path = _backend(backend, checkpoint, None, max_seq)
    prompt = build_prompt(HiggsTokenizer(tokenizer_path), text, ref, ref_text)
    say(f"loaded {engine.name} backend in {time.perf_counter() - t0:.1f} s; prompt of {len(prompt)} tokens")

    t0 = time.perf_counter()
    result = generate(engine, [prompt], Sampling(temperature, top_k, top_p, seed))[0]
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


@main.command("tiny-checkpoint")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed (same seed, same files).")
@click.option("--shards", type=click.IntRange(1, 8), default=2, show_default=True,
              help="1: a single model.safetensors; more: sharded with model.safetensors.index.json.")
def tiny_checkpoint(out_dir, seed, shards):
    """Write a tiny random checkpoint in the real Higgs v3 layout (for tests and the README demo)."""
    from . import extras

    with extras.needed("builder", "tiny-checkpoint"):
        from higgs_trt.builder.tiny import write_tiny_checkpoint
    write_tiny_checkpoint(out_dir, seed, shards)
    say(f"wrote tiny checkpoint to {out_dir}")
if __name__ == "__main__":
    main()
