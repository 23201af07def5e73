"""Opening a decode engine for `run`, `bench` and `serve`: which backend runs which files, and the checks on the way.

- ort:   ONNX Runtime on the engine directory's fp32 twin (CPU), host-driven (runtime/stepper.py)
- trt:   TensorRT on the engine directory's plans (GPU), host-driven
- torch: on a CUDA GPU, the GPU engine (runtime/gpu/) from the engine directory's weights.bin or from a checkpoint;
         on the CPU, the fp32 torch reference from a checkpoint (builder/torch_backend.py, host-driven)

An engine directory given with a checkpoint must have been built from it. Options that do not apply to the chosen
backend are refused, not ignored.
"""

from dataclasses import dataclass
from pathlib import Path

from higgs_trt.runtime import extras
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.manifest import EngineDir
from higgs_trt.runtime.stepper import HostStepper

DEVICES = {"torch": ("auto", "cpu", "cuda"), "ort": ("auto", "cpu"), "trt": ("auto", "cuda", "lean")}


@dataclass
class Sources:
    backend: str
    engine: EngineDir | None
    checkpoint: object | None  # builder.checkpoint.Checkpoint (needs the builder extra)
    max_seq: int | None = None  # the cache length of the torch backend from a checkpoint


def choose_backend(name: str | None, engine: Path | None, checkpoint: Path | None, device: str,
                   options: set[str]) -> str:
    """The backend to use; `options` are the ones the user set (the rest are defaults)."""
    if checkpoint is None and engine is None:
        raise HiggsError("give --engine DIR (an exported engine directory) or --checkpoint DIR (torch backend)")
    name = name or ("ort" if engine else "torch")
    if name != "torch" and engine is None:
        raise HiggsError(f"--backend {name} needs --engine")
    if "max_seq" in options and (name != "torch" or engine is not None):
        raise HiggsError("--max-seq applies to --backend torch from a --checkpoint only; an engine directory keeps "
                         "the cache length it was exported with")
    if device not in DEVICES[name]:
        raise HiggsError(f"--device {device} does not apply to --backend {name} (it takes {', '.join(DEVICES[name])})")
    return name


def open_sources(backend: str, engine_dir: Path | None, checkpoint: Path | None, precision: str | None,
                 max_seq: int | None) -> Sources:
    """The engine directory and checkpoint, verified and checked against each other; no weights are read yet.
    `max_seq` None: the default cache length (options.cache_length)."""
    from higgs_trt.runtime.options import cache_length

    engine = EngineDir(engine_dir) if engine_dir else None
    if engine and precision and engine.manifest["precision"] != precision:
        raise HiggsError(f"{engine_dir} holds {engine.manifest['precision']} engines, not {precision}")
    ckpt = cache = None
    if checkpoint:
        with extras.needed("builder", f"--checkpoint with --backend {backend}"):
            from higgs_trt.builder.checkpoint import Checkpoint
        ckpt = Checkpoint(checkpoint)
        if engine:
            engine.check_checkpoint(ckpt.fingerprint(), checkpoint)
        else:
            cache = cache_length(max_seq, ckpt.config.max_position_embeddings)
    return Sources(backend, engine, ckpt, cache)


def load_tokenizer(sources: Sources):
    """The tokenizer of the engine (else the checkpoint), checked against the model's text vocabulary."""
    from higgs_trt.runtime.prompt import HiggsTokenizer

    if sources.engine:
        return HiggsTokenizer(sources.engine.path / "tokenizer.json", sources.engine.manifest["model"]["text_vocab_size"])
    return HiggsTokenizer(sources.checkpoint.dir / "tokenizer.json", sources.checkpoint.config.text_vocab_size)


def check_prompt_fits(prompt, engine: EngineDir | None) -> None:
    """An engine's prefill takes at most the max-prompt it was exported with."""
    limit = engine.manifest["limits"]["max_prompt"] if engine else None
    if limit is not None and len(prompt) > limit:
        raise HiggsError(prompt.too_long(limit, "the engine's prefill (its --max-prompt) takes at most"))


def open_engine(sources: Sources, *, device: str = "auto", max_batch: int = 1,
                precision: str | None = None, codec_precision: str | None = None, say=lambda msg: None):
    """The slot engine the scheduler drives (runtime/scheduler.py). `codec_precision` (GPU engine only): fp16, the
    default, or tf32 convolutions in its codec (CodecDecoder.fp16)."""
    engine = sources.engine
    check_codec_precision(sources, device, codec_precision)
    if sources.backend == "torch":
        return _torch(sources, device, max_batch, precision, codec_precision != "tf32", say)
    if sources.backend == "trt":
        from higgs_trt.runtime.backends.trt import TrtBackend

        return HostStepper(TrtBackend(engine, "lean" if device == "lean" else "tensorrt", max_batch))
    with extras.needed("ort", "--backend ort"):
        from higgs_trt.runtime.backends.ort import OrtBackend
    return HostStepper(OrtBackend(engine, max_batch=max_batch))


def torch_on_cpu(sources: Sources, device: str, precision: str | None) -> bool:
    """Whether --backend torch runs the fp32 reference on the CPU (else the GPU engine); its options checked before
    anything loads."""
    with extras.needed("builder", "--backend torch"):
        import torch
    if device == "cuda":
        extras.require_cuda("--device cuda")
    if device != "cpu" and torch.cuda.is_available():
        return False
    if sources.checkpoint is None:
        raise HiggsError("--backend torch on the CPU runs the fp32 reference model: it needs --checkpoint")
    if sources.engine is not None:
        raise HiggsError("--engine does not apply to --backend torch on the CPU (the fp32 reference runs "
                         "--checkpoint's weights); the GPU engine runs an engine directory")
    if precision is not None:
        raise HiggsError("--precision does not apply to --backend torch on the CPU (the fp32 reference); "
                         "BF16 and FP8 run on a GPU")
    return True


def check_codec_precision(sources: Sources, device: str, codec_precision: str | None) -> None:
    """--codec-precision picks the GPU engine's codec convolutions: refused where no GPU engine runs."""
    if codec_precision is None:
        return
    if sources.backend != "torch":
        raise HiggsError(f"--codec-precision applies to the GPU engine (--backend torch on a GPU); --backend "
                         f"{sources.backend} decodes audio with the engine directory's codec graph")
    if torch_on_cpu(sources, device, None):
        raise HiggsError("--codec-precision applies to the GPU engine (--backend torch on a GPU); the CPU reference "
                         "decodes audio in fp32")


def _torch(sources: Sources, device: str, max_batch: int, precision: str | None, codec_fp16: bool, say):
    engine, ckpt, max_seq = sources.engine, sources.checkpoint, sources.max_seq
    if torch_on_cpu(sources, device, precision):
        from higgs_trt.builder.torch_backend import TorchBackend

        return HostStepper(TorchBackend(ckpt, max_seq=max_seq, max_batch=max_batch))
    from higgs_trt.runtime.gpu.engine import load_gpu_engine
    from higgs_trt.runtime.options import prompt_length

    amax = None
    if engine is not None:
        from higgs_trt.calibration.calibrate import load_calibration
        from higgs_trt.runtime.gpu.weights import EngineWeights

        source, limits = EngineWeights(engine), engine.manifest["limits"]
        max_seq, max_prompt, max_batch = limits["max_seq"], limits["max_prompt"], min(max_batch, limits["max_batch"])
        if engine.manifest["precision"] == "fp8":
            calibration = engine.path / engine.manifest["calibration"]["file"]
            amax = load_calibration(calibration, engine.fingerprint)["activation_amax"]
    else:
        source, max_prompt = ckpt, prompt_length(max_seq)
        if precision == "fp8":
            from higgs_trt.builder.torch_backend import bf16_reference
            from higgs_trt.calibration.calibrate import calibrate

            say("calibrating FP8 scales on the built-in prompt set…")
            amax = calibrate(bf16_reference(ckpt, "cuda"))["activation_amax"]
    return load_gpu_engine(source, max_seq=max_seq, max_batch=max_batch, max_prompt=max_prompt, act_amax=amax,
                           codec_fp16=codec_fp16, say=say)


def open_encoder(sources: Sources, device: str = "auto"):
    """The codec encoder for reference audio (runtime/audio.py's Encoder): torch on the checkpoint's encoder tensors
    (CPU or CUDA), or ort / trt on the engine directory's codec_encoder graph."""
    engine = sources.engine
    if sources.backend == "torch":
        ckpt = sources.checkpoint
        if ckpt is None:
            raise HiggsError("--ref-audio with --backend torch needs --checkpoint (the torch encoder reads the "
                             "checkpoint's encoder tensors); or encode with --backend ort/trt on the engine directory")
        from higgs_trt.builder.codec_encoder import TorchEncoder, has_encoder

        if not has_encoder(ckpt):
            raise HiggsError(f"{ckpt.dir}: carries no codec encoder tensors; clone from reference codes (--ref-codes)")
        if device == "cuda":
            extras.require_cuda("--device cuda")
        return TorchEncoder(ckpt, None if device in ("auto", "lean") else device)
    if "codec_encoder" not in engine.manifest["graphs"]:
        raise HiggsError(f"{engine.path}: has no codec encoder (codec_encoder.onnx): its checkpoint carries no encoder "
                         "tensors, or an older version exported it; clone from reference codes (--ref-codes)")
    if sources.backend == "trt":
        from higgs_trt.runtime.backends.trt_encoder import TrtEncoder

        return TrtEncoder(engine, "lean" if device == "lean" else "tensorrt")
    with extras.needed("ort", "--backend ort"):
        from higgs_trt.runtime.backends.ort import OrtEncoder
    return OrtEncoder(engine)


def open_all(backend: str | None, engine: Path | None, checkpoint: Path | None, device: str, precision: str | None,
             max_seq: int | None, options: set[str], *, max_batch: int = 1, codec_precision: str | None = None,
             say=lambda msg: None):
    """(sources, the slot engine, tokenizer): every check of the sources, then the engine loaded."""
    name = choose_backend(backend, engine, checkpoint, device, options)
    sources = open_sources(name, engine, checkpoint, precision, max_seq)
    tokenizer = load_tokenizer(sources)
    model = open_engine(sources, device=device, max_batch=max_batch, precision=precision,
                        codec_precision=codec_precision, say=say)
    return sources, model, tokenizer


def reference_codes(path: Path, sources: Sources, device: str):
    """Reference codes [T, 8] from an audio file, and a line saying what was done."""
    import time

    from higgs_trt.runtime.audio import encode_reference, load_reference_audio

    audio = load_reference_audio(path)  # every check before any model is loaded
    t0 = time.perf_counter()
    encoder = open_encoder(sources, device)
    codes = encode_reference(audio, encoder)
    return codes, (f"encoded {audio.seconds:.2f} s of reference audio ({audio.source_rate} Hz) → {len(codes)} frames "
                   f"with the {encoder.name} encoder in {time.perf_counter() - t0:.1f} s")
