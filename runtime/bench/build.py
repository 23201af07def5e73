"""Build-side figures: BF16 against FP8 plans, export's peak memory, the checkpoint's inf/NaN check, and a B=1 step's
weight stream in hand-written CUDA (a measurement of kernel boundaries, not of the engine)."""

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.options import prompt_length

WEIGHT_STREAM = Path(__file__).with_name("weight_stream.cu")


def bf16_against_fp8(ckpt, target: str | None, max_seq: int, workdir: Path | None, echo) -> None:
    """Build BF16 and FP8 engine directories of `ckpt` side by side: plan sizes, their ratio, build times, FP8 gate
    figures."""
    from higgs_trt.builder.trt_build import build

    limits = {"max_seq": max_seq, "max_batch": 8, "max_prompt": prompt_length(max_seq)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(workdir or tmp)
        sizes = {}
        for precision in ("bf16", "fp8"):
            out = root / precision
            t0 = time.perf_counter()
            build(ckpt, out, precision, target, False, limits, lambda m: None)
            total = time.perf_counter() - t0
            m = json.loads((out / "manifest.json").read_text())
            lm = m["engines"]["lm"]
            sizes[precision] = (out / lm["file"]).stat().st_size
            gate = m.get("fp8_gate")
            echo(f"{precision}: lm.plan {sizes[precision] / 2**20:8.1f} MiB  "
                 f"lm build {lm['build_seconds']:6.1f} s  codec build {m['engines']['codec']['build_seconds']:5.1f} s  "
                 f"export+build {total:6.1f} s"
                 + (f"\n      {gate['cosine_mean']:.5f} mean / {gate['cosine_min']:.5f} min logits cosine, "
                    f"top-1 {gate['top1']:.3f}, worst site {gate['worst_site']} "
                    f"({100 * gate['worst_site_error']:.2f}%)" if gate else ""))
        echo(f"fp8 / bf16 lm.plan size: {sizes['fp8'] / sizes['bf16']:.3f}")


def export_memory(checkpoint: Path, max_seq: int, echo) -> None:
    """Peak memory of `export` (a child process) as a multiple of the checkpoint's size on disk."""
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
    echo(f"checkpoint {weights / gib:.3f} GiB  export peak RSS {peak / gib:.3f} GiB = {peak / weights:.2f}x "
         f"checkpoint  engine dir {engine_bytes / gib:.3f} GiB  {seconds:.1f} s")


def finite_check(checkpoint: Path, repeats: int, echo) -> None:
    """Seconds per GiB of the non-finite weight check, on a fresh Checkpoint each run (nothing checked yet)."""
    from higgs_trt.builder.checkpoint import NONFINITE, Checkpoint

    first = Checkpoint(checkpoint)
    names = [n for n in first.names() if first.dtype(n) in NONFINITE]
    size = sum(first.nbytes(n) for n in names)
    for run in range(repeats):
        ckpt = Checkpoint(checkpoint)
        t0 = time.perf_counter()
        ckpt.check_finite(names)
        seconds = time.perf_counter() - t0
        echo(f"run {run}: {len(names)} tensors, {size / 2**30:.3f} GiB in {seconds:.3f} s = "
             f"{seconds / (size / 2**30):.3f} s/GiB ({size / 2**30 / seconds:.2f} GiB/s)")


def weight_stream(nvcc: str, precision: str, rings: list[int], blocks: list[int], check: bool, say) -> None:
    """Compile weight_stream.cu and run it (it prints its own figures)."""
    compiler = shutil.which(nvcc)
    if compiler is None:
        raise HiggsError(f"bench weight-stream needs the CUDA compiler: {nvcc!r} not found (--nvcc PATH)")
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "weight_stream"
        say(f"compiling {WEIGHT_STREAM.name} with {compiler}")
        built = subprocess.run([compiler, "-O3", "-std=c++17", "-arch=sm_90", "-o", str(program), str(WEIGHT_STREAM)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            lines = (built.stderr or built.stdout).strip().splitlines() or ["no output"]
            raise HiggsError(f"nvcc failed on {WEIGHT_STREAM.name}: {lines[0]}")
        if not program.is_file():
            raise HiggsError(f"{compiler} exited 0 but wrote no program (is --nvcc the CUDA compiler?)")
        args = [str(program), "--precision", precision, "--rings", ",".join(map(str, rings)),
                "--blocks", ",".join(map(str, blocks))]
        if subprocess.run(args + (["--check"] if check else [])).returncode != 0:
            raise HiggsError("bench weight-stream failed (its error is above)")
