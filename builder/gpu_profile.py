"""`higgs-trt bench profile`: one decode step of the GPU engine kernel by kernel (needs a CUDA GPU).

Each kernel's GPU time from torch's profiler (CUPTI), launched without programmatic dependent launch, so that a kernel's
time is its own and not partly its wait for the one before. Kernels are named by their place in the step (the launch
order of GpuEngine._decode), and the GEMMs' weight bytes give each its read rate: where a step's time goes and how far
each kernel is from the copy bandwidth. Random weights at the checkpoint's dimensions, every slot at `context` cached
positions (attention's work), as gpu_bench does.
"""

import re

import torch

from .config import HiggsConfig
from .gpu_bench import linear_bytes, placeholder_amax, random_tensors
from .gpu_engine import GpuEngine

# one layer's kernels in launch order (Triton kernel name, label), then the step's tail
LAYER = (("rms_norm", "norm (input)"), ("linear", "q|k|v"), ("decode_attention_split", "attention"), ("linear", "o"),
         ("rms_norm", "norm (post)"), ("linear", "gate|up"), ("linear", "down"))
TAIL = (("rms_norm", "norm (final)"), ("linear", "audio head"), ("delayed_codebook_sample", "codebook"),
        ("advance_slots", "advance"))


def label_step(names: list[str], layers: int) -> list[str]:
    """The label of each kernel of one step, by its place; an unexpected kernel is an error that names it."""
    expected = list(LAYER) * layers + list(TAIL)
    if len(names) != len(expected):
        raise ValueError(f"{len(names)} kernels in the step, expected {len(expected)}: {sorted(set(names))}")
    for i, (name, (kernel, _)) in enumerate(zip(names, expected)):
        if not re.match(rf"{kernel}\b|{kernel}_", name):
            raise ValueError(f"kernel {i} of the step is {name!r}, expected {kernel}")
    return [label for _, label in expected]


def summarize(labels: list[str], us: list[float], layers: int, weight_bytes: dict[str, int]) -> list[str]:
    """Lines: per label, µs per layer (or per step for the tail), its share of the step, and for a GEMM its weight
    read rate."""
    total = sum(us)
    per_label: dict[str, float] = {}
    for label, t in zip(labels, us):
        per_label[label] = per_label.get(label, 0.0) + t
    lines = []
    for label, t in per_label.items():
        n = layers if any(label == name for _, name in LAYER) else 1
        line = f"    {label:<13} {t / n:7.1f} µs{' a layer' if n > 1 else '        '}  {100 * t / total:5.1f} %"
        if label in weight_bytes:
            line += f"  {weight_bytes[label] / 1e6:6.1f} MB at {weight_bytes[label] * n / (t * 1e-6) / 1e12:4.2f} TB/s"
        lines.append(line)
    lines.append(f"    {'step':<13} {total / 1e3:7.3f} ms (sum of the kernels' times)")
    return lines


def profile_step(cfg: HiggsConfig, batches=(1, 64), fp8_options=(False, True), context: int = 300,
                 max_seq: int = 2048, say=print) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    tensors = random_tensors(cfg)
    for fp8 in fp8_options:
        engine = GpuEngine(cfg, tensors, max_seq=max_seq, max_batch=max(batches), max_prompt=512,
                           act_amax=placeholder_amax(cfg) if fp8 else None, graphs=False, pdl=False)
        layer = engine.layers[0]
        weight_bytes = {label: linear_bytes(lin) for label, lin in (
            ("q|k|v", layer.qkv), ("o", layer.o), ("gate|up", layer.gate_up), ("down", layer.down),
            ("audio head", engine.head))}
        for b in batches:
            engine.active[:b] = 1
            for _ in range(3):  # compile and warm up
                engine.write_pos[:b] = context
                engine._decode(b)
            engine.write_pos[:b] = context
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine._decode(b)
                torch.cuda.synchronize()
            kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                             key=lambda e: e.time_range.start)
            labels = label_step([e.name for e in kernels], cfg.num_layers)
            say(f"{engine.precision} B={b}, {context} cached positions:")
            for line in summarize(labels, [e.time_range.elapsed_us() for e in kernels], cfg.num_layers, weight_bytes):
                say(line)
            engine.active.zero_()
        del engine
        torch.cuda.empty_cache()
