"""Opening a decode engine for `run`, `bench` and `serve`: which backend runs which files.

- ort:   ONNX Runtime on the engine directory's fp32 twin (CPU), host-driven (runtime/stepper.py)
- trt:   TensorRT on the engine directory's plans (GPU), host-driven
- torch: on a CUDA GPU, the GPU engine (builder/gpu_engine.py) from the engine directory's weights.bin or from a
         checkpoint; on the CPU, the fp32 torch reference from a checkpoint (host-driven)

An engine directory given with a checkpoint must have been built from it.
"""

from pathlib import Path

from . import extras
from .errors import HiggsError
from .manifest import EngineDir
from .stepper import HostStepper


def open_engine(backend: str | None, checkpoint: Path | None, engine_dir: Path | None, *, device: str = "auto",
                max_seq: int = 2048, max_batch: int = 1, precision: str | None = None, say=lambda msg: None):
    """(engine, tokenizer.json path)."""
    if checkpoint is None and engine_dir is None:
        raise HiggsError("give --engine DIR (an exported engine directory) or --checkpoint DIR (torch backend)")
    engine = EngineDir(engine_dir) if engine_dir else None
    if engine and precision and engine.manifest["precision"] != precision:
        raise HiggsError(f"{engine_dir} holds {engine.manifest['precision']} engines, not {precision}")
    ckpt = None
    if checkpoint:
        with extras.needed("builder", f"--checkpoint with --backend {backend or 'torch'}"):
            from higgs_trt.builder.checkpoint import Checkpoint
        ckpt = Checkpoint(checkpoint)
        if engine:
            engine.check_checkpoint(ckpt.fingerprint(), checkpoint)
    backend = backend or ("ort" if engine else "torch")
    tokenizer = (engine.path if engine else Path(checkpoint)) / "tokenizer.json"
    if backend == "torch":
        return _torch(engine, ckpt, checkpoint, device, max_seq, max_batch, precision, say), tokenizer
    if engine is None:
        raise HiggsError(f"--backend {backend} needs --engine")
    if backend == "trt":
        from .trt_backend import TrtBackend

        return HostStepper(TrtBackend(engine, "lean" if device == "lean" else "tensorrt")), tokenizer
    if device not in ("auto", "cpu"):
        raise HiggsError(f"--backend ort runs on the CPU (--device {device} does not apply); on a GPU use "
                         "--backend trt or --backend torch")
    with extras.needed("ort", "--backend ort"):
        from .ort_backend import OrtBackend
    return HostStepper(OrtBackend(engine, max_batch=max_batch)), tokenizer


def _torch(engine: EngineDir | None, ckpt, checkpoint: Path | None, device: str, max_seq: int, max_batch: int,
           precision: str | None, say):
    with extras.needed("builder", "--backend torch"):
        import torch
    if device == "lean":
        raise HiggsError("--device lean applies to --backend trt")
    cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise HiggsError("--device cuda: torch sees no CUDA GPU here")
    if not cuda:
        if ckpt is None:
            raise HiggsError("--backend torch on the CPU runs the reference model: it needs --checkpoint")
        if precision == "fp8":
            raise HiggsError("--backend torch on the CPU is the fp32 reference; FP8 runs on a GPU")
        from higgs_trt.builder.torch_backend import TorchBackend

        return HostStepper(TorchBackend(ckpt, max_seq=max_seq, max_batch=max_batch))
    from higgs_trt.builder.gpu_engine import load_gpu_engine

    amax = None
    if engine is not None:
        from higgs_trt.builder.engine_weights import EngineWeights

        source, limits = EngineWeights(engine), engine.manifest["limits"]
        max_seq, max_prompt = limits["max_seq"], limits["max_prompt"]
        max_batch = min(max_batch, limits["max_batch"])
        if engine.manifest["precision"] == "fp8":
            amax = _calibration(engine.path / engine.manifest["calibration"]["file"], engine.fingerprint)
    else:
        source, max_prompt = ckpt, min(512, max_seq // 2)
        if precision == "fp8":
            from higgs_trt.calibration.calibrate import calibrate

            say("calibrating FP8 scales on the built-in prompt set…")
            amax = calibrate(checkpoint, device="cuda")["activation_amax"]
    return load_gpu_engine(source, max_seq=max_seq, max_batch=max_batch, max_prompt=max_prompt, act_amax=amax, say=say)


def _calibration(path: Path, fingerprint: str) -> dict:
    from higgs_trt.calibration.calibrate import load_calibration

    return load_calibration(path, fingerprint)["activation_amax"]
