"""`higgs-trt`: the command line. Stage commands import their heavy dependencies only when they run."""

import time
from pathlib import Path

import click
import numpy as np

from . import trt_shim
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
@click.option("--ref-text", help="Voice clone: transcript of the reference audio.")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 is greedy (argmax).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely codes (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1: off).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed: same seed, same audio.")
@click.option("--codes-out", type=click.Path(path_type=Path), help="Also save the final frames [T,8] (.npy).")
@click.option("--max-seq", type=int, default=2048, show_default=True, help="KV-cache length (torch backend).")
def run(text, out, engine, checkpoint, backend, device, precision, ref_codes, ref_text, temperature, top_k, top_p, seed,
        codes_out, max_seq):
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


@main.group()
def bench():
    """Benchmarks that print figures (decode loop, export memory)."""


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


@bench.command("build")
@click.option("--checkpoint", type=click.Path(path_type=Path), required=True, help="Checkpoint directory.")
@click.option("--target", help="TensorRT-RTX target (e.g. sm89); default: TensorRT for the local GPU.")
@click.option("--max-seq", type=int, default=1024, show_default=True)
@click.option("--workdir", type=click.Path(path_type=Path), help="Keep the engine directories here.")
def bench_build(checkpoint, target, max_seq, workdir):
    """Build BF16 and FP8 engines side by side: plan sizes, their ratio, build times, FP8 gate figures."""
    import json
    import tempfile

    from . import extras

    with extras.needed("builder", "bench build"):
        from higgs_trt.builder.trt_build import build as build_engine_dir
    limits = {"max_seq": max_seq, "max_batch": 8, "max_prompt": min(512, max_seq // 2)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(workdir or tmp)
        sizes = {}
        for precision in ("bf16", "fp8"):
            out = root / precision
            t0 = time.perf_counter()
            build_engine_dir(checkpoint, out, precision, target, False, limits, lambda m: None)
            total = time.perf_counter() - t0
            m = json.loads((out / "manifest.json").read_text())
            lm = m["engines"]["lm"]
            sizes[precision] = (out / lm["file"]).stat().st_size
            gate = m.get("fp8_gate")
            click.echo(f"{precision}: lm.plan {sizes[precision] / 2**20:8.1f} MiB  lm build {lm['build_seconds']:6.1f} s  "
                       f"codec build {m['engines']['codec']['build_seconds']:5.1f} s  export+build {total:6.1f} s"
                       + (f"\n      {gate['cosine_mean']:.5f} mean / {gate['cosine_min']:.5f} min logits cosine, "
                          f"top-1 {gate['top1']:.3f}, worst site {gate['worst_site']} "
                          f"({100 * gate['worst_site_error']:.2f}%)" if gate else ""))
        click.echo(f"fp8 / bf16 lm.plan size: {sizes['fp8'] / sizes['bf16']:.3f}")


@bench.command("kernels")
def bench_kernels():
    """Plugin kernels vs the torch eager ops they replace, and vs the device's copy bandwidth (needs a GPU)."""
    from . import extras

    with extras.needed("gpu", "bench kernels"):
        from higgs_trt.plugins.bench import run as run_kernel_bench
    for line in run_kernel_bench():
        click.echo(line)


@bench.command("export")
@click.option("--checkpoint", type=click.Path(path_type=Path), required=True, help="Checkpoint directory.")
@click.option("--max-seq", type=int, default=2048, show_default=True)
def bench_export(checkpoint, max_seq):
    """Peak memory of `export` (a child process) as a multiple of the checkpoint's size on disk."""
    import resource
    import subprocess
    import sys
    import tempfile

    weights = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", "export", "--checkpoint", str(checkpoint),
                            "--out", f"{tmp}/engine", "--max-seq", str(max_seq)], capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if r.returncode:
            raise HiggsError(f"export failed: {r.stderr.strip().splitlines()[-1]}")
        engine_bytes = sum(f.stat().st_size for f in Path(tmp, "engine").iterdir())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    gib = 1 << 30
    click.echo(f"checkpoint {weights / gib:.3f} GiB  export peak RSS {peak / gib:.3f} GiB = {peak / weights:.2f}x "
               f"checkpoint  engine dir {engine_bytes / gib:.3f} GiB  {seconds:.1f} s")


def fp8_options(command):
    """--precision, --calibration and the accuracy-gate floors, shared by export and build."""
    from higgs_trt.calibration.gate import DEFAULT_COSINE, DEFAULT_TOP1

    for option in reversed([
        click.option("--precision", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
                     help="fp8: FP8 GEMMs (per-tensor activation, per-channel weight scales) via explicit Q/DQ."),
        click.option("--calibration", type=click.Path(path_type=Path),
                     help="FP8 scales from `higgs-trt calibrate` [default: calibrate now on the built-in prompts]."),
        click.option("--gate-cosine", type=float, default=DEFAULT_COSINE, show_default=True,
                     help="FP8 gate: refuse if any teacher-forced step's logits cosine vs BF16 is below this."),
        click.option("--gate-top1", type=float, default=DEFAULT_TOP1, show_default=True,
                     help="FP8 gate: refuse if the top-1 code agreement with BF16 is below this."),
    ]):
        command = option(command)
    return command


@main.command()
@click.option("--checkpoint", type=click.Path(path_type=Path), required=True, help="Checkpoint directory.")
@click.option("--out", type=click.Path(path_type=Path), help="Engine directory [default: engines/<checkpoint name>].")
@click.option("--ops", type=click.Choice(["native", "plugin"]), default="native", show_default=True,
              help="native: RoPE/KV-cache/attention and the codebook step as standard ONNX ops TensorRT maps to its own "
                   "layers; plugin: the higgs::rope_kv_write and higgs::delayed_codebook_step plugins (Triton kernels).")
@click.option("--max-seq", type=int, default=2048, show_default=True, help="KV-cache rows (prompt + generated rows).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Largest batch the engines take.")
@click.option("--max-prompt", type=int, default=512, show_default=True, help="Longest prompt (prefill) in tokens.")
@fp8_options
def export(checkpoint, out, ops, max_seq, max_batch, max_prompt, precision, calibration, gate_cosine, gate_top1):
    """Export the LM (bf16 + fp32 reference twin; FP8 Q/DQ graphs too with --precision fp8) and codec graphs."""
    from . import extras

    with extras.needed("builder", "export"):
        from higgs_trt.builder.export import export_engine
        from higgs_trt.builder.trt_build import op_path
    out = out or Path("engines") / checkpoint.resolve().name
    say(f"exporting {checkpoint} → {out}")
    t0 = time.perf_counter()
    export_engine(checkpoint, out, max_seq, max_batch, max_prompt, op_path(ops), say, precision, calibration,
                  (gate_cosine, gate_top1))
    say(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


@main.command()
@click.option("--checkpoint", type=click.Path(path_type=Path), required=True, help="Checkpoint directory.")
@click.option("--out", type=click.Path(path_type=Path), help="Engine directory [default: engines/<checkpoint name>].")
@click.option("--ops", type=click.Choice(["native", "plugin"]), default="native", show_default=True,
              help="See `export --help`. Plugin plans built with --target hold build-only plugin twins: not runnable.")
@click.option("--target", help=f"Build with TensorRT-RTX for this compute capability, no GPU needed "
                               f"({', '.join(trt_shim.TARGETS)}). Default: datacenter TensorRT for the local GPU.")
@click.option("--lean", is_flag=True, help="VERSION_COMPATIBLE plans without the lean runtime, for tensorrt_lean.")
@click.option("--max-seq", type=int, default=2048, show_default=True, help="KV-cache rows (prompt + generated rows).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Largest batch the engines take.")
@click.option("--max-prompt", type=int, default=512, show_default=True, help="Longest prompt (prefill) in tokens.")
@fp8_options
def build(checkpoint, out, ops, target, lean, max_seq, max_batch, max_prompt, precision, calibration, gate_cosine,
          gate_top1):
    """Export (or reuse) the ONNX graphs and build TensorRT engines into an engine directory."""
    from . import extras

    with extras.needed("builder", "build"):
        from higgs_trt.builder.trt_build import build as build_engine_dir
    out = out or Path("engines") / checkpoint.resolve().name
    t0 = time.perf_counter()
    limits = {"max_seq": max_seq, "max_batch": max_batch, "max_prompt": max_prompt}
    build_engine_dir(checkpoint, out, precision, target, lean, limits, say, calibration, (gate_cosine, gate_top1), ops)
    say(f"built {out} in {time.perf_counter() - t0:.1f} s")


@main.command()
@click.option("--checkpoint", type=click.Path(path_type=Path), required=True, help="Checkpoint directory.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="calibration.json to write.")
@click.option("--statistic", type=click.Choice(["max", "p999"]), default="max", show_default=True,
              help="Per-site activation amax: the largest |x| seen, or the 99.9th percentile of per-token maxima.")
def calibrate(checkpoint, out, statistic):
    """FP8 activation scales from the built-in prompt set (prefill + free-run decode of the BF16 reference)."""
    from . import extras
    from .wav import check_writable, write_atomic

    check_writable(out)
    with extras.needed("builder", "calibrate"):
        from higgs_trt.calibration.calibrate import calibrate as run_calibration
        from higgs_trt.calibration.calibrate import write_calibration
    t0 = time.perf_counter()
    result = run_calibration(checkpoint, statistic)
    write_atomic(out, lambda tmp: write_calibration(result, tmp))
    say(f"calibrated {len(result['activation_amax'])} GEMM inputs over {result['tokens']} tokens "
        f"in {time.perf_counter() - t0:.1f} s → {out}")


@main.command()
@click.option("--engine", type=click.Path(path_type=Path), required=True, help="Engine directory.")
@click.option("--checkpoint", type=click.Path(path_type=Path),
              help="The engine's checkpoint (for the torch runner; checked against the manifest).")
@click.option("--runners", default="torch,ort,trt", show_default=True,
              help="Comma-separated, the first is the reference; trt is skipped where TensorRT is not usable.")
@click.option("--prompts", type=click.Path(path_type=Path),
              help='JSON list of {"text": ..., optional "ref_text", "ref_codes"} [default: the built-in held-out prompts].')
@click.option("--steps", type=int, default=32, show_default=True, help="Teacher-forced decode steps per prompt.")
@click.option("--save", type=click.Path(path_type=Path),
              help="Write inputs.json / outputs.json (Polygraphy's format) and report.json here.")
@click.option("--per-layer", is_flag=True,
              help="Also mark every intermediate tensor of the engine's fp32 twin and name the first one that differs "
                   "from a fresh export of --checkpoint (locates a broken layer).")
def compare(engine, checkpoint, runners, prompts, steps, save, per_layer):
    """Compare torch, ONNX Runtime and TensorRT on the same teacher-forced decode steps (Polygraphy)."""
    import json

    from . import extras
    from .prompt import HiggsTokenizer

    with extras.needed("compare", "compare"):
        from higgs_trt.builder.compare import compare as run_compare
        from higgs_trt.builder.compare import summary
        from higgs_trt.calibration.calibrate import build_prompts, prompt_set
    if prompts is None:
        items = prompt_set()["heldout"]
    else:
        try:
            items = json.loads(Path(prompts).read_text())
        except (OSError, ValueError) as e:
            raise HiggsError(f"{prompts}: unreadable prompts file ({e})") from None
        if not isinstance(items, list) or not all(isinstance(p, dict) and "text" in p for p in items):
            raise HiggsError(f'{prompts}: expected a JSON list of {{"text": ...}} objects')
    prompt_list = build_prompts(HiggsTokenizer(Path(engine) / "tokenizer.json"), items)
    report = run_compare(engine, checkpoint, [r.strip() for r in runners.split(",") if r.strip()], prompt_list,
                         steps, save, say)
    for line in summary(report):
        click.echo(line)
    if per_layer:
        if checkpoint is None:
            raise HiggsError("--per-layer needs --checkpoint")
        from higgs_trt.builder.compare import locate_divergence

        first = locate_divergence(engine, checkpoint, prompt_list, say)
        click.echo(f"per-layer: {first['compared']} tensors compared; "
                   + (f"first to differ: {first['tensor']} (max |Δ| {first['max_abs']:.3g})" if first["tensor"]
                      else "all agree"))
    if not report["passed"]:
        raise click.exceptions.Exit(1)


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


@main.command("tiny-checkpoint")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed (same seed, same files).")
@click.option("--shards", type=click.IntRange(1, 64), default=2, show_default=True,
              help="1: a single model.safetensors; more: sharded with model.safetensors.index.json.")
@click.option("--size", type=click.Choice(["tiny", "mid", "real"]), default="tiny", show_default=True,
              help="tiny: CI-sized; mid: 12 layers, hidden 1536 (~0.8 GB); real: Higgs v3 dimensions (~9 GB).")
def tiny_checkpoint(out_dir, seed, shards, size):
    """Write a random checkpoint in the real Higgs v3 layout (tiny by default: for tests and the README demo)."""
    from . import extras

    with extras.needed("builder", "tiny-checkpoint"):
        from higgs_trt.builder.tiny import write_random_checkpoint
    write_random_checkpoint(out_dir, seed, shards, size)
    say(f"wrote {size} random checkpoint to {out_dir}")
if __name__ == "__main__":
    main()
