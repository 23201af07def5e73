"""The build-side commands (export, build, calibrate, compare, random checkpoints, build benchmarks).

Imported by the CLI at start-up, so it imports only click here; each command loads torch, onnx, TensorRT or
Polygraphy when it runs.
"""

import time
from pathlib import Path

import click

from higgs_trt.runtime import extras, trt_shim
from higgs_trt.runtime.click_types import FILE_OUT, PATH
from higgs_trt.runtime.errors import HiggsError


def say(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("build")
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--target", help="TensorRT-RTX target (e.g. sm89); default: TensorRT for the local GPU.")
@click.option("--max-seq", type=int, default=1024, show_default=True)
@click.option("--workdir", type=PATH, help="Keep the engine directories here.")
def bench_build(checkpoint, target, max_seq, workdir):
    """Build BF16 and FP8 engines side by side: plan sizes, their ratio, build times, FP8 gate figures."""
    import json
    import tempfile

    from higgs_trt.runtime.options import prompt_length

    with extras.needed("builder", "bench build"):
        from higgs_trt.builder.trt_build import build as build_engine_dir
    limits = {"max_seq": max_seq, "max_batch": 8, "max_prompt": prompt_length(max_seq)}
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
            click.echo(f"{precision}: lm.plan {sizes[precision] / 2**20:8.1f} MiB  "
                       f"lm build {lm['build_seconds']:6.1f} s  codec build {m['engines']['codec']['build_seconds']:5.1f} s  "
                       f"export+build {total:6.1f} s"
                       + (f"\n      {gate['cosine_mean']:.5f} mean / {gate['cosine_min']:.5f} min logits cosine, "
                          f"top-1 {gate['top1']:.3f}, worst site {gate['worst_site']} "
                          f"({100 * gate['worst_site_error']:.2f}%)" if gate else ""))
        click.echo(f"fp8 / bf16 lm.plan size: {sizes['fp8'] / sizes['bf16']:.3f}")



@click.command("kernels")
def bench_kernels():
    """Plugin kernels vs the torch eager ops they replace, and vs the device's copy bandwidth (needs a GPU)."""
    with extras.needed("gpu", "bench kernels"):
        from higgs_trt.plugins.bench import run as run_kernel_bench
    extras.require_cuda("bench kernels")
    for line in run_kernel_bench():
        click.echo(line)



FP8_OPTIONS = {"bf16": (False,), "fp8": (True,), "both": (False, True)}  # --precision → the GPU benchmarks' fp8 flags


@click.command("linear")
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
def bench_linear(budget, precision, tiles):
    """The GPU engine's linear kernel at Higgs v3's weight shapes: tile shapes timed at M = 1 to 64, and 2048 for
    prefill tiles (needs a GPU). With --tiles all the budget is split between the sweeps, each starting from the
    previous one's winners."""
    with extras.needed("gpu", "bench linear"):
        from higgs_trt.builder.config import HIGGS_V3
        from higgs_trt.builder.gpu_bench import (compare_tma, sweep_linear, sweep_persistent, sweep_prefill,
                                                   sweep_ranges, sweep_wide, sweep_wide_in_step)
    extras.require_cuda("bench linear")
    fp8_options = FP8_OPTIONS[precision]
    sweeps = {"narrow": ("narrow tiles (M = 1 to 16)", sweep_linear),
              "wide": ("wide tiles (M = 17 to 64)", sweep_wide),
              "persistent": ("persistent programs (M = 1 to 16)", sweep_persistent),
              "ranges": ("K ranges, wgmma (M = 1 to 64)", sweep_ranges),
              "prefill": ("prefill tiles (M = 2048 and 64)", sweep_prefill),
              "tma": ("today's tiles, loads by TMA against loads by each thread", compare_tma),
              "step": ("wide tiles by the B=64 decode step's time", sweep_wide_in_step)}
    chosen = [name for name in sweeps if name not in ("tma", "step")] if tiles == "all" else [tiles]
    for name in chosen:
        title, sweep = sweeps[name]
        click.echo(title)
        sweep(HIGGS_V3, budget / len(chosen), fp8_options, say=click.echo)


@click.command("attention")
def bench_attention():
    """The GPU engine's decode attention at Higgs v3's heads: chunk, key block, pipeline stages, warps and loads (per
    thread or TMA) timed at B = 1, 8, 64 and 300, 1000 cached positions (needs a GPU)."""
    with extras.needed("gpu", "bench attention"):
        from higgs_trt.builder.config import HIGGS_V3
        from higgs_trt.builder.gpu_bench import sweep_attention
    extras.require_cuda("bench attention")
    sweep_attention(HIGGS_V3, say=click.echo)


@click.command("codec")
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
        from higgs_trt.builder.gpu_bench import bench_codec as run_codec_bench
    extras.require_cuda("bench codec")
    run_codec_bench(Checkpoint(checkpoint), tuple(counts), say=click.echo)


@click.command("profile")
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
        from higgs_trt.builder.config import HIGGS_V3
        from higgs_trt.builder.gpu_profile import chain_costs, profile_step
    extras.require_cuda("bench profile")
    fp8_options = FP8_OPTIONS[precision]
    run = chain_costs if leave_out else profile_step
    run(HIGGS_V3, tuple(batch_sizes), fp8_options, context, say=click.echo)


@click.command("weight-stream")
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
    import shutil
    import subprocess
    import tempfile

    from higgs_trt.runtime.options import sizes

    ring_sizes = sizes("--rings", rings, 192)
    block_counts = sizes("--blocks", blocks, 4)
    if min(ring_sizes) < 16:
        raise HiggsError("--rings: each ring must hold at least 16 KB")
    compiler = shutil.which(nvcc)
    if compiler is None:
        raise HiggsError(f"bench weight-stream needs the CUDA compiler: {nvcc!r} not found (--nvcc PATH)")
    source = Path(__file__).with_name("weight_stream.cu")
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "weight_stream"
        say(f"compiling {source.name} with {compiler}")
        built = subprocess.run([compiler, "-O3", "-std=c++17", "-arch=sm_90", "-o", str(program), str(source)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            lines = (built.stderr or built.stdout).strip().splitlines() or ["no output"]
            raise HiggsError(f"nvcc failed on {source.name}: {lines[0]}")
        if not program.is_file():
            raise HiggsError(f"{compiler} exited 0 but wrote no program (is --nvcc the CUDA compiler?)")
        args = [str(program), "--precision", precision, "--rings", ",".join(map(str, ring_sizes)),
                "--blocks", ",".join(map(str, block_counts))]
        if subprocess.run(args + (["--check"] if check else [])).returncode != 0:
            raise HiggsError("bench weight-stream failed (its error is above)")


@click.command("export")
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
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
            raise HiggsError(f"export failed: {r.stderr.strip().splitlines()[-1].removeprefix('Error: ')}")
        engine_bytes = sum(f.stat().st_size for f in Path(tmp, "engine").iterdir())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    gib = 1 << 30
    click.echo(f"checkpoint {weights / gib:.3f} GiB  export peak RSS {peak / gib:.3f} GiB = {peak / weights:.2f}x "
               f"checkpoint  engine dir {engine_bytes / gib:.3f} GiB  {seconds:.1f} s")



@click.command("checkpoint")
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--repeats", type=click.IntRange(1, 100), default=3, show_default=True)
def bench_checkpoint(checkpoint, repeats):
    """What the non-finite weight check costs: seconds per GiB of float tensors (every run after the first reads
    from the page cache; the first may read from disk)."""
    with extras.needed("builder", "bench checkpoint"):
        from higgs_trt.builder.checkpoint import NONFINITE, Checkpoint
    first = Checkpoint(checkpoint)
    names = [n for n in first.names() if first.dtype(n) in NONFINITE]
    size = sum(first.nbytes(n) for n in names)
    for run in range(repeats):
        ckpt = Checkpoint(checkpoint)  # a fresh one: nothing checked yet
        t0 = time.perf_counter()
        ckpt.check_finite(names)
        seconds = time.perf_counter() - t0
        click.echo(f"run {run}: {len(names)} tensors, {size / 2**30:.3f} GiB in {seconds:.3f} s = "
                   f"{seconds / (size / 2**30):.3f} s/GiB ({size / 2**30 / seconds:.2f} GiB/s)")


def limit_options(command):
    """--max-seq, --max-batch and --max-prompt: the engine's limits, shared by export and build."""
    for option in reversed([
        click.option("--max-seq", type=int, help="KV-cache rows (prompt + generated rows) [default: 2048, or the "
                                                 "model's positions if fewer]."),
        click.option("--max-batch", type=int, default=8, show_default=True, help="Largest batch the engines take."),
        click.option("--max-prompt", type=int, help="Longest prompt (prefill) in tokens [default: 512, or half of "
                                                    "--max-seq if less]."),
    ]):
        command = option(command)
    return command


def fp8_options(command):
    """--precision, --calibration and the accuracy-gate floors, shared by export and build."""
    from higgs_trt.calibration.gate import DEFAULT_COSINE, DEFAULT_TOP1

    for option in reversed([
        click.option("--precision", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
                     help="fp8: FP8 GEMMs (per-tensor activation, per-channel weight scales) via explicit Q/DQ."),
        click.option("--calibration", type=PATH,
                     help="FP8 scales from `higgs-trt calibrate` [default: calibrate now on the built-in prompts]."),
        click.option("--gate-cosine", type=float, default=DEFAULT_COSINE, show_default=True,
                     help="FP8 gate: refuse if any teacher-forced step's logits cosine vs BF16 is below this."),
        click.option("--gate-top1", type=float, default=DEFAULT_TOP1, show_default=True,
                     help="FP8 gate: refuse if the top-1 code agreement with BF16 is below this."),
    ]):
        command = option(command)
    return command


def check_fp8_options(precision: str, options: set[str], gate_cosine: float, gate_top1: float) -> None:
    """--calibration and the gate floors apply to --precision fp8 only: refused with bf16 rather than ignored."""
    extra = [o for o in ("calibration", "gate_cosine", "gate_top1") if o in options]
    if precision != "fp8" and extra:
        raise HiggsError(f"--{extra[0].replace('_', '-')} applies to --precision fp8 only")
    if not -1 <= gate_cosine <= 1:  # NaN fails too
        raise HiggsError(f"--gate-cosine must lie in [-1, 1], got {gate_cosine}")
    if not 0 <= gate_top1 <= 1:
        raise HiggsError(f"--gate-top1 must lie in [0, 1], got {gate_top1}")


@click.command()
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--out", type=PATH,
              help="Engine directory [default: engines/<checkpoint name>]: new, empty, or an engine directory to replace.")
@click.option("--ops", type=click.Choice(["native", "plugin"]), default="native", show_default=True,
              help="native: RoPE/KV-cache/attention and the codebook step as standard ONNX ops TensorRT maps to its "
                   "own layers; plugin: the higgs::rope_kv_write, higgs::decode_attention and "
                   "higgs::delayed_codebook_step plugins (Triton kernels).")
@limit_options
@fp8_options
@click.pass_context
def export(ctx, checkpoint, out, ops, max_seq, max_batch, max_prompt, precision, calibration, gate_cosine, gate_top1):
    """Export the LM (bf16 + fp32 reference twin; FP8 Q/DQ graphs too with --precision fp8) and codec graphs."""
    from higgs_trt.runtime.cli import given

    check_fp8_options(precision, given(ctx), gate_cosine, gate_top1)
    with extras.needed("builder", "export"):
        from higgs_trt.builder.export import export_engine
        from higgs_trt.builder.trt_build import op_path
    out = out or Path("engines") / checkpoint.resolve().name
    say(f"exporting {checkpoint} → {out}")
    t0 = time.perf_counter()
    export_engine(checkpoint, out, max_seq, max_batch, max_prompt, op_path(ops), say, precision, calibration,
                  (gate_cosine, gate_top1))
    say(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


@click.command()
@click.option("--checkpoint", type=PATH, required=True, help="Checkpoint directory.")
@click.option("--out", type=PATH,
              help="Engine directory [default: engines/<checkpoint name>]: new, empty, or an engine directory to replace.")
@click.option("--ops", type=click.Choice(["native", "plugin"]), default="native", show_default=True,
              help="See `export --help`. Plugin plans built with --target hold build-only plugin twins: not runnable.")
@click.option("--target", help=f"Build with TensorRT-RTX for this compute capability, no GPU needed "
                               f"({', '.join(trt_shim.TARGETS)}). Default: datacenter TensorRT for the local GPU.")
@click.option("--lean", is_flag=True, help="VERSION_COMPATIBLE plans without the lean runtime, for tensorrt_lean.")
@limit_options
@fp8_options
@click.option("--recipe", help="Named settings from engines/recipes/ (e.g. h200-fp8, tiny); flags given here win.")
@click.pass_context
def build(ctx, checkpoint, out, ops, target, lean, max_seq, max_batch, max_prompt, precision, calibration, gate_cosine,
          gate_top1, recipe):
    """Export (or reuse) the ONNX graphs and build TensorRT engines into an engine directory."""
    from higgs_trt.runtime.cli import given

    options = given(ctx)
    if recipe:
        settings = _recipe(recipe)
        chosen = {**{k: v for k, v in settings.items() if k not in options}, **{k: ctx.params[k] for k in options}}
        ops, target, max_seq, max_batch, max_prompt, precision = (
            chosen.get(k, ctx.params[k]) for k in ("ops", "target", "max_seq", "max_batch", "max_prompt", "precision"))
    check_fp8_options(precision, options, gate_cosine, gate_top1)
    with extras.needed("builder", "build"):
        from higgs_trt.builder.trt_build import build as build_engine_dir
    out = out or Path("engines") / checkpoint.resolve().name
    t0 = time.perf_counter()
    limits = {"max_seq": max_seq, "max_batch": max_batch, "max_prompt": max_prompt}
    build_engine_dir(checkpoint, out, precision, target, lean, limits, say, calibration, (gate_cosine, gate_top1), ops)
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
    with extras.needed("builder", "calibrate"):
        from higgs_trt.calibration.calibrate import calibrate as run_calibration
        from higgs_trt.calibration.calibrate import write_calibration
    t0 = time.perf_counter()
    result = run_calibration(checkpoint, statistic)
    write_file(out, lambda tmp: write_calibration(result, tmp), inputs=(checkpoint,))
    say(f"calibrated {len(result['activation_amax'])} GEMM inputs over {result['tokens']} tokens "
        f"in {time.perf_counter() - t0:.1f} s → {out}")


PROMPT_KEYS = ("text", "ref_text", "ref_codes")
SAVED = ("inputs.json", "outputs.json", "report.json")


def read_prompts_file(path: Path) -> list[dict]:
    """compare --prompts: a JSON list of {"text", optional "ref_text", "ref_codes" [T,8]}, every field checked."""
    from higgs_trt.runtime.jsonfile import read_json
    from higgs_trt.runtime.prompt import check_reference_codes, check_text

    items = read_json(path)
    if not isinstance(items, list) or not items:
        raise HiggsError(f'{path}: expected a non-empty JSON list of {{"text": ...}} objects')
    for i, item in enumerate(items):
        where = f"{path}: prompt {i}"
        if not isinstance(item, dict) or "text" not in item:
            raise HiggsError(f'{where} is not a {{"text": ...}} object')
        unknown = sorted(set(item) - set(PROMPT_KEYS))
        if unknown:
            raise HiggsError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(PROMPT_KEYS)})")
        check_text(item["text"], f"{where} text")
        if "ref_text" in item:
            if "ref_codes" not in item:
                raise HiggsError(f"{where} has ref_text without ref_codes")
            check_text(item["ref_text"], f"{where} ref_text")
        if "ref_codes" in item:
            check_reference_codes(item["ref_codes"], where)
    return items


def check_runners(runners: str) -> list[str]:
    names = [r.strip() for r in runners.split(",") if r.strip()]
    unknown = [r for r in names if r not in ("torch", "ort", "trt")]
    if unknown:
        raise HiggsError(f"unknown runner {unknown[0]!r}; choose from torch, ort, trt")
    if len(set(names)) != len(names) or len(names) < 2:
        raise HiggsError(f"--runners needs at least two runners, each named once, got {runners!r}")
    return names


def _not_a_compare_save(directory: Path) -> str | None:
    from higgs_trt.runtime.outputs import unexpected_entries

    others = unexpected_entries(directory, lambda name: name in SAVED)
    return f"holds files compare --save does not write ({', '.join(sorted(others)[:5])})" if others else None


@click.command()
@click.option("--engine", type=PATH, required=True, help="Engine directory.")
@click.option("--checkpoint", type=PATH,
              help="The engine's checkpoint (for the torch runner; checked against the manifest).")
@click.option("--runners", default="torch,ort,trt", show_default=True,
              help="Comma-separated, the first is the reference; trt is skipped where TensorRT is not usable.")
@click.option("--prompts", type=PATH,
              help='JSON list of {"text": ..., optional "ref_text", "ref_codes"} '
                   '[default: the built-in held-out prompts].')
@click.option("--steps", type=int, default=32, show_default=True, help="Teacher-forced decode steps per prompt.")
@click.option("--save", type=PATH,
              help="Write inputs.json / outputs.json (Polygraphy's format) and report.json into this directory "
                   "(new, empty, or one an earlier --save wrote).")
@click.option("--per-layer", is_flag=True,
              help="Also mark every intermediate tensor of the engine's fp32 twin and name the first one that differs "
                   "from a fresh export of --checkpoint (locates a broken layer).")
def compare(engine, checkpoint, runners, prompts, steps, save, per_layer):
    """Compare torch, ONNX Runtime and TensorRT on the same teacher-forced decode steps (Polygraphy)."""
    from contextlib import nullcontext

    from higgs_trt.runtime.engines import Sources, check_prompt_fits, load_tokenizer
    from higgs_trt.runtime.manifest import EngineDir
    from higgs_trt.runtime.options import within
    from higgs_trt.runtime.outputs import output_dir, staged_dir

    runner_names = check_runners(runners)
    if per_layer and checkpoint is None:
        raise HiggsError("--per-layer needs --checkpoint")
    if save is not None:
        save = output_dir(save, "a compare --save directory", _not_a_compare_save, inputs=(engine, checkpoint, prompts))
    items = read_prompts_file(prompts) if prompts is not None else None
    engine_dir = EngineDir(engine)
    within("--steps", steps, 1, engine_dir.manifest["limits"]["max_seq"], "the engine's max-seq")
    with extras.needed("compare", "compare"):
        from higgs_trt.builder.compare import compare as run_compare
        from higgs_trt.builder.compare import summary
        from higgs_trt.calibration.calibrate import build_prompts, prompt_set
    tok = load_tokenizer(Sources("ort", engine_dir, None))
    prompt_list = []
    for i, p in enumerate(items or prompt_set()["heldout"]):
        try:
            prompt = build_prompts(tok, [p])[0]
            check_prompt_fits(prompt, engine_dir)
        except HiggsError as e:
            raise HiggsError(f"{prompts or 'built-in prompts'}: prompt {i}: {e}") from None
        prompt_list.append(prompt)
    with staged_dir(save) if save is not None else nullcontext() as staging:
        report = run_compare(engine, checkpoint, runner_names, prompt_list, steps, staging, say)
    for line in summary(report):
        click.echo(line)
    if per_layer:
        from higgs_trt.builder.compare import locate_divergence

        first = locate_divergence(engine, checkpoint, prompt_list, say)
        click.echo(f"per-layer: {first['compared']} tensors compared; "
                   + (f"first to differ: {first['tensor']} (max |Δ| {first['max_abs']:.3g})" if first["tensor"]
                      else "all agree"))
    if not report["passed"]:
        raise click.exceptions.Exit(1)


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


COMMANDS = [export, build, calibrate, compare, tiny_checkpoint]
BENCHMARKS = [bench_build, bench_kernels, bench_export, bench_checkpoint, bench_linear, bench_attention,
              bench_codec, bench_profile, bench_weight_stream]
