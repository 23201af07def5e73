"""`higgs-trt doctor`: what this machine has, and which build and run modes therefore work here."""

import importlib
import platform
from importlib.metadata import PackageNotFoundError, version

from . import cuda, trt_shim


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


def _flavour(kind: str) -> tuple[bool, str]:
    module, problem = trt_shim.try_load(kind)
    return (True, module.__version__) if module else (False, problem)


def _gpus() -> list[str]:
    if cuda.device_count() == 0:
        return []
    from cuda.bindings import runtime as rt

    names = []
    for i in range(cuda.device_count()):
        props = cuda.check(rt.cudaGetDeviceProperties(i), "cudaGetDeviceProperties")
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        names.append(f"{name.rstrip(chr(0))} (sm{props.major}{props.minor})")
    return names


def report() -> tuple[list[tuple[str, str]], list[tuple[str, bool, str]]]:
    have = {m: _imports(m) for m in ("torch", "onnx", "onnxscript", "onnxruntime", "polygraphy", "triton")}
    flavours = {k: _flavour(k) for k in trt_shim.MODULES}
    gpus = _gpus()
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
             ("GPUs", ", ".join(gpus) or "none visible"),
             ("triton", show(have["triton"]))]
    hopper = any("sm90" in g for g in gpus)
    exportable = have["torch"][0] and have["onnx"][0] and have["onnxscript"][0]
    modes = [
        ("export (torch → ONNX)", exportable, "needs torch, onnx, onnxscript"),
        ("build --target smXX (TensorRT-RTX, no GPU needed)", flavours["rtx"][0] and exportable, "needs tensorrt-rtx"),
        ("build for the local GPU (TensorRT)", flavours["tensorrt"][0] and bool(gpus) and exportable,
         "needs tensorrt and an NVIDIA GPU"),
        ("run --backend torch", have["torch"][0], "needs torch"),
        ("run --backend ort", have["onnxruntime"][0], "needs onnxruntime (CUDA EP: onnxruntime-gpu)"),
        ("run --backend trt", (flavours["tensorrt"][0] or flavours["lean"][0]) and bool(gpus) and bool(cuda_python),
         "needs tensorrt (or tensorrt_lean for --lean plans), cuda-python and an NVIDIA GPU"),
        ("run --backend trt on TensorRT-RTX plans", flavours["rtx"][0] and bool(gpus) and not hopper and bool(cuda_python),
         "needs tensorrt-rtx and a GPU of the plan's compute capability (not Hopper)"),
        ("plugin kernels and GPU tests (Triton)", have["triton"][0] and torch_cuda, "needs triton and torch with CUDA"),
    ]
    return facts, modes
