"""The build-side commands: `export`, `build`, `calibrate`, `tiny-checkpoint`. Each imports torch, onnx or
TensorRT when it runs, not when the CLI starts."""

import time
from pathlib import Path

import click

from higgs_trt.runtime import extras, trt_shim
from higgs_trt.runtime.errors import HiggsError

from .options import given, options, say
from .paths import FILE_OUT, PATH


def open_checkpoint(checkpoint: Path, what: str):
    """The checkpoint, opened once by the command and handed down to every stage it runs."""
    with extras.needed("builder", what):
        from higgs_trt.builder.checkpoint import Checkpoint
    return Checkpoint(checkpoint)


limit_options = options(
    click.option("--max-seq", type=int, help="KV-cache rows (prompt + generated rows) [default: 2048, or the model's "
                                             "positions if fewer]."),
    click.option("--max-batch", type=int, default=8, show_default=True, help="Largest batch the engines take."),
    click.option("--max-prompt", type=int, help="Longest prompt (prefill) in tokens [default: 512, or half of "
                                                "--max-seq if less]."),
)


attention_option = click.option(
    "--attention", type=click.Choice(["fused", "matmul"]), default="fused", show_default=True,
    help="--ops native: fused: ONNX Attention, TensorRT's attention layer (a fused kernel, else decomposed); matmul: "
         "MatMul + Softmax, layers every TensorRT builds (reads every cache row, as the fused layer does).")


def fp8_options(command):
    """--precision, --calibration and the accuracy-gate floors, shared by export and build."""
    from higgs_trt.calibration.gate import DEFAULT_COSINE, DEFAULT_TOP1

    return options(
        click.option("--precision", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
                     help="fp8: FP8 GEMMs (per-tensor activation, per-channel weight scales) via explicit Q/DQ."),
        click.option("--calibration", type=PATH,
                     help="FP8 scales from `higgs-trt calibrate` [default: calibrate now on the built-in prompts]."),
        click.option("--gate-cosine", type=float, default=DEFAULT_COSINE, show_default=True,
                     help="FP8 gate: refuse if any teacher-forced step's logits cosine vs BF16 is below this."),
        click.option("--gate-top1", type=float, default=DEFAULT_TOP1, show_default=True,
                     help="FP8 gate: refuse if the top-1 code agreement with BF16 is below this."),
    )(command)


def check_fp8_options(precision: str, options: set[str], gate_cosine: float, gate_top1: float) -> None:
    """--calibration and the gate floors apply to --precision fp8 only: refused with bf16 rather than ignored."""
    extra = [o for o in ("calibration", "gate_cosine", "gate_top1") if o in options]
    if precision != "fp8" and extra:
        raise HiggsError(f"--{extra[0].replace('_', '-')} applies to --precision fp8 only")
    if not -1 <= gate_cosine <= 1:  # NaN fails too
        raise HiggsError(f"--gate-cosine must lie in [-1, 1], got {gate_cosine}")
    if not 0 <= gate_top1 <= 1:
        raise HiggsError(f"--gate-top1 must lie in [0, 1], got {gate_top1}")


def engine_out(out: Path | None, checkpoint: Path) -> Path:
    """--out, or engines/<checkpoint name>; checked (new, empty or an engine directory) before any work."""
    from higgs_trt.runtime.outputs import output_engine_dir

    out = out or Path("engines") / checkpoint.resolve().name
    output_engine_dir(out, inputs=(checkpoint,))
    return out


@click.command()
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--out", type=PATH,
              help="Engine directory [default: engines/<checkpoint name>]: new, empty, or an engine directory to replace.")
@click.option("--ops", type=click.Choice(["native", "plugin"]), default="native", show_default=True,
              help="native: RoPE/KV-cache/attention and the codebook step as standard ONNX ops TensorRT maps to its "
                   "own layers; plugin: the higgs::rope_kv_write, higgs::decode_attention and "
                   "higgs::delayed_codebook_step plugins (Triton kernels).")
@attention_option
@limit_options
@fp8_options
@click.pass_context
def export(ctx, checkpoint, out, ops, attention, max_seq, max_batch, max_prompt, precision, calibration, gate_cosine,
           gate_top1):
    """Export the LM (bf16 + fp32 reference twin; FP8 Q/DQ graphs too with --precision fp8) and codec graphs."""
    check_fp8_options(precision, given(ctx), gate_cosine, gate_top1)
    with extras.needed("builder", "export"):
        from higgs_trt.builder.export import export_engine
        from higgs_trt.builder.trt_build import op_path
    path = op_path(ops, attention)
    out = engine_out(out, checkpoint)
    ckpt = open_checkpoint(checkpoint, "export")
    say(f"exporting {checkpoint} → {out}")
    t0 = time.perf_counter()
    export_engine(ckpt, out, max_seq, max_batch, max_prompt, path, say, precision, calibration, (gate_cosine, gate_top1))
    say(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


@click.command()
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--out", type=PATH,
              help="Engine directory [default: engines/<checkpoint name>]: new, empty, or an engine directory to replace.")
@click.option("--ops", type=click.Choice(["native", "plugin"]), default="native", show_default=True,
              help="See `export --help`. Plugin plans built with --target hold build-only plugin twins: not runnable.")
@click.option("--target", help=f"Build with TensorRT-RTX for this compute capability, no GPU needed "
                               f"({', '.join(trt_shim.TARGETS)}). Default: datacenter TensorRT for the local GPU.")
@click.option("--lean", is_flag=True, help="VERSION_COMPATIBLE plans without the lean runtime, for tensorrt_lean "
                                            "(--ops native only).")
@attention_option
@limit_options
@fp8_options
@click.option("--recipe", help="Named settings from engines/recipes/ (e.g. h200-fp8, tiny); flags given here win.")
@click.pass_context
def build(ctx, checkpoint, out, ops, target, lean, attention, max_seq, max_batch, max_prompt, precision, calibration,
          gate_cosine, gate_top1, recipe):
    """Export (or reuse) the ONNX graphs and build TensorRT engines into an engine directory."""
    chosen = given(ctx)
    if recipe:
        settings = _recipe(recipe)
        merged = {**{k: v for k, v in settings.items() if k not in chosen}, **{k: ctx.params[k] for k in chosen}}
        ops, target, attention, max_seq, max_batch, max_prompt, precision = (
            merged.get(k, ctx.params[k])
            for k in ("ops", "target", "attention", "max_seq", "max_batch", "max_prompt", "precision"))
    check_fp8_options(precision, chosen, gate_cosine, gate_top1)
    with extras.needed("builder", "build"):
        from higgs_trt.builder.trt_build import build as build_engine_dir
        from higgs_trt.builder.trt_build import check_request
    check_request(ops, attention, target, lean)
    out = engine_out(out, checkpoint)
    ckpt = open_checkpoint(checkpoint, "build")
    t0 = time.perf_counter()
    limits = {"max_seq": max_seq, "max_batch": max_batch, "max_prompt": max_prompt}
    build_engine_dir(ckpt, out, precision, target, lean, limits, say, calibration, (gate_cosine, gate_top1), ops,
                     attention)
    say(f"built {out} in {time.perf_counter() - t0:.1f} s")


@click.command()
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--out", type=FILE_OUT, required=True,
              help="calibration.json to write (new, or a file to replace; not inside the checkpoint).")
@click.option("--statistic", type=click.Choice(["p999", "max"]), default="p999", show_default=True,
              help="Per-site activation amax: the 99.9th percentile of per-token maxima (chosen by measurement), "
                   "or the largest |x| seen.")
def calibrate(checkpoint, out, statistic):
    """FP8 activation scales from the built-in prompt set (prefill + free-run decode of the BF16 reference)."""
    from higgs_trt.runtime.outputs import output_file, write_file

    output_file(out, inputs=(checkpoint,))
    ckpt = open_checkpoint(checkpoint, "calibrate")
    from higgs_trt.builder.torch_backend import bf16_reference
    from higgs_trt.calibration.calibrate import calibrate as run_calibration
    from higgs_trt.calibration.calibrate import write_calibration

    t0 = time.perf_counter()
    result = run_calibration(bf16_reference(ckpt), statistic)
    write_file(out, lambda tmp: write_calibration(result, tmp), inputs=(checkpoint,))
    say(f"calibrated {len(result['activation_amax'])} GEMM inputs over {result['tokens']} tokens "
        f"in {time.perf_counter() - t0:.1f} s → {out}")


def _recipe(name: str) -> dict:
    import json
    from importlib.resources import files

    path = files("higgs_trt.engines") / "recipes" / f"{name}.json"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".json") for p in (files("higgs_trt.engines") / "recipes").iterdir())
        raise HiggsError(f"no recipe {name!r}; known: {', '.join(known)}")
    settings = json.loads(path.read_text())
    settings.pop("about", None)
    return settings


@click.command("tiny-checkpoint")
@click.argument("out_dir", type=PATH)
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed 0..2**63-1 (same seed, same files).")
@click.option("--shards", type=click.IntRange(1, 64), default=2, show_default=True,
              help="1: a single model.safetensors; more: sharded with model.safetensors.index.json.")
@click.option("--size", type=click.Choice(["tiny", "mid", "real"]), default="tiny", show_default=True,
              help="tiny: CI-sized; mid: 12 layers, hidden 1536 (~0.8 GB); real: Higgs v3 dimensions (~9 GB).")
def tiny_checkpoint(out_dir, seed, shards, size):
    """Write a random checkpoint in the real Higgs v3 layout (tiny by default: for tests and the README demo).

    OUT_DIR may be new, empty, or a random checkpoint this command wrote (it is replaced); anything else is refused."""
    from higgs_trt.runtime.options import MAX_SEED, within

    within("--seed", seed, 0, MAX_SEED)
    with extras.needed("builder", "tiny-checkpoint"):
        from higgs_trt.builder.tiny import write_random_checkpoint
    write_random_checkpoint(out_dir, seed, shards, size)
    say(f"wrote {size} random checkpoint to {out_dir}")


COMMANDS = (export, build, calibrate, tiny_checkpoint)
