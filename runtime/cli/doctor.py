"""`higgs-trt doctor`: what this machine has, and which build and run modes therefore work here; for each mode
that does not, what is missing and how to get it. `--build-check` goes further: it builds every lm variant as a
one-layer plan of the given checkpoint and, on the local GPU, runs each against its ONNX Runtime twin
(builder/trt_build.py, build_check)."""

import importlib
import platform
from importlib.metadata import PackageNotFoundError, version

import click

from higgs_trt.runtime import cuda, extras, trt_shim
from higgs_trt.runtime.errors import HiggsError

from .build import limit_options, open_checkpoint
from .options import given, say
from .paths import PATH


def _package(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _imports(module: str) -> tuple[bool, str]:
    try:
        m = importlib.import_module(module)
        return True, getattr(m, "__version__", "")
    except Exception as e:  # missing, or a wheel whose native library does not load here
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


PLUGIN_PTX = ("sm_80", "8.0")  # what --ops plugin exports (plugins/aot.py TARGET, PTX_VERSION; a test ties them)
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later


def _flavour(kind: str) -> tuple[bool, str]:
    module, problem = trt_shim.try_load(kind)
    if module is None:
        return False, problem
    too_old = trt_shim.version_problem(module) if kind == "tensorrt" else None
    return (False, too_old) if too_old else (True, module.__version__)


def _gpus() -> list[tuple[str, tuple[int, int]]]:
    if cuda.gpu_problem():
        return []
    from cuda.bindings import runtime as rt

    gpus = []
    for i in range(cuda.device_count()):
        props = cuda.check(rt.cudaGetDeviceProperties(i), "cudaGetDeviceProperties")
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        gpus.append((name.rstrip(chr(0)), cuda.capability(i)))
    return gpus


def _cuda_version(v: int) -> str:
    return f"CUDA {v // 1000}.{v % 1000 // 10}"


def report() -> tuple[list[tuple[str, str]], list[tuple[str, bool, str]]]:
    have = {m: _imports(m) for m in ("torch", "onnx", "onnxscript", "onnxruntime", "polygraphy", "triton")}
    flavours = {k: _flavour(k) for k in trt_shim.MODULES}
    gpu_problem, driver = cuda.gpu_problem(), cuda.driver_version()
    gpus = _gpus()
    caps = [cap for _, cap in gpus]
    cuda_python = _package("cuda-bindings") or _package("cuda-python")
    torch_cuda = False
    if have["torch"][0]:
        import torch

        torch_cuda = torch.cuda.is_available()
    providers = []
    if have["onnxruntime"][0]:
        import onnxruntime

        providers = onnxruntime.get_available_providers()

    def show(ok_version: tuple[bool, str]) -> str:
        ok, detail = ok_version
        return (detail or "yes") if ok else f"no ({detail})"

    facts = [("python", platform.python_version()),
             ("torch", show(have["torch"]) + (" with CUDA" if torch_cuda else "")),
             ("onnx / onnxscript", f"{show(have['onnx'])} / {show(have['onnxscript'])}"),
             ("onnxruntime", show(have["onnxruntime"]) + (f" [{', '.join(providers)}]" if providers else "")),
             ("polygraphy", show(have["polygraphy"])),
             ("tensorrt", show(flavours["tensorrt"])),
             ("tensorrt-rtx", show(flavours["rtx"])),
             ("tensorrt_lean", show(flavours["lean"])),
             ("cuda-python", cuda_python or "no"),
             ("NVIDIA driver", (_cuda_version(driver) if driver else "none")
              + (" (R580+)" if driver >= cuda.MIN_DRIVER_CUDA else "")),
             ("GPUs", ", ".join(f"{n} (sm{a}{b})" for n, (a, b) in gpus) or f"none usable: {gpu_problem}"),
             ("triton", show(have["triton"]))]
    hopper = (9, 0) in caps
    gpu = gpu_problem or ""
    trt_ok, trt_detail = flavours["tensorrt"]
    trt_missing = None if trt_ok else trt_detail if "too old" in trt_detail else f"{trt_detail}: {trt_shim.INSTALL['tensorrt']}"
    trt_build = [p for p in (trt_missing, gpu_problem) if p]
    fp8 = any(c >= FP8_CAPABILITY for c in caps)
    ptx = cuda.ptx_problem(*PLUGIN_PTX, max(caps), driver) if caps else gpu
    exportable = have["torch"][0] and have["onnx"][0] and have["onnxscript"][0]
    modes = [
        ("export (torch → ONNX)", exportable, "needs torch, onnx, onnxscript"),
        ("build --target smXX (TensorRT-RTX, no GPU needed)", flavours["rtx"][0] and exportable, "needs tensorrt-rtx"),
        ("build for the local GPU (TensorRT 10.15+)", not trt_build and exportable,
         "; ".join(trt_build) or "needs torch, onnx, onnxscript"),
        ("FP8 engines on the local GPU", fp8,
         f"FP8 needs compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+ (Ada, Hopper or later); "
         + (f"this GPU is {caps[0][0]}.{caps[0][1]}" if caps else gpu)),
        (f"--ops plugin plans on the local GPU (PTX {PLUGIN_PTX[0]}, ISA {PLUGIN_PTX[1]})", bool(caps) and not ptx,
         ptx or gpu),
        ("run --backend torch", have["torch"][0], "needs torch"),
        ("run --backend ort", have["onnxruntime"][0], "needs onnxruntime (CUDA EP: onnxruntime-gpu)"),
        ("run --backend trt", (flavours["tensorrt"][0] or flavours["lean"][0]) and bool(gpus),
         "; ".join(p for p in (None if flavours["tensorrt"][0] or flavours["lean"][0] else
                               "needs tensorrt 10.15+ (or tensorrt_lean for --lean plans): pip install 'higgs-trt[trt]'",
                               gpu_problem) if p)),
        ("run --backend trt on TensorRT-RTX plans", flavours["rtx"][0] and bool(gpus) and not hopper,
         "needs tensorrt-rtx and a GPU of the plan's compute capability (not Hopper)" + (f"; {gpu}" if gpu else "")),
        ("plugin kernels and GPU tests (Triton)", have["triton"][0] and torch_cuda, "needs triton and torch with CUDA"),
    ]
    return facts, modes


@click.command()
@click.option("--build-check", is_flag=True,
              help="Build every lm variant (op path × attention × precision) as a one-layer plan of --checkpoint and, "
                   "on the local GPU, run a prefill and two steps of each against ONNX Runtime: what works, in a "
                   "minute, before a full build.")
@click.option("--checkpoint", type=PATH, help="With --build-check: the checkpoint to build (its first layer).")
@click.option("--target", help=f"With --build-check: build with TensorRT-RTX for this compute capability instead "
                               f"(no GPU needed; nothing is run) ({', '.join(trt_shim.TARGETS)}).")
@limit_options
@click.pass_context
def doctor(ctx, build_check, checkpoint, target, max_seq, max_batch, max_prompt):
    """What TensorRT / TensorRT-RTX / lean runtime / ONNX Runtime / GPU this machine has, and what works here."""
    if build_check or given(ctx):
        _build_check(build_check, checkpoint, target, {"max_seq": max_seq, "max_batch": max_batch,
                                                       "max_prompt": max_prompt})
        return
    facts, modes = report()
    width = max(len(k) for k, _ in facts)
    for key, value in facts:
        click.echo(f"{key:<{width}}  {value}")
    click.echo("")
    for mode, ok, needs in modes:
        click.echo(f"  [{'x' if ok else ' '}] {mode}" + ("" if ok else f"  ({needs})"))


def _build_check(build_check: bool, checkpoint, target: str | None, limits: dict) -> None:
    if not build_check:
        raise HiggsError("--checkpoint, --target and the limits apply to --build-check")
    if checkpoint is None:
        raise HiggsError("--build-check needs --checkpoint: the checkpoint you will build (its first layer is built)")
    with extras.needed("builder", "--build-check"):
        from higgs_trt.builder.trt_build import build_check, datacenter_tensorrt
    if target:
        trt_shim.check_target(target)
        trt_shim.load("rtx")
    else:
        datacenter_tensorrt()  # refused before the checkpoint is read
    if not build_check(open_checkpoint(checkpoint, "--build-check"), limits, target, say):
        raise click.exceptions.Exit(1)
