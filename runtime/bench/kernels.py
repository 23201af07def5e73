"""Plugin-kernel microbenchmark at Higgs v3 dimensions (GPU): each kernel against the torch eager sequence it
replaces, and bytes moved per second against the device's measured copy bandwidth, side by side in one run.

Each op is called 36 times in a row (rope_kv_write: once per layer of a decode step, over 36 layers of caches
[B, 8, S_max, 128]; delayed_codebook_step: 36 steps' worth) and the figures are per call. Kernels are replayed
from one CUDA graph, as an engine's step runs them, so the graph's own launch cost is spread over 36 calls; torch
eager is timed as it runs, Python and launch overhead included.
"""

import torch
import triton
from torch.onnx import ops as onnx_ops

from higgs_trt.builder.plugin_ops import delayed_codebook_step
from higgs_trt.plugins import codebook, rope
from higgs_trt.plugins.aot import NUM_WARPS, constants_for, grid
from higgs_trt.plugins.rope_table import rope_table
from higgs_trt.runtime.config import HIGGS_V3

LAYERS, HQ, HKV, D, HIDDEN = (HIGGS_V3.num_layers, HIGGS_V3.num_heads, HIGGS_V3.num_kv_heads, HIGGS_V3.head_dim,
                              HIGGS_V3.hidden_size)
S_MAX, K, V = 2048, 8, 1026
REPS = 20


def _events_ms(fn, reps: int = REPS) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def graph_ms(fn) -> float:
    """Median time of replaying a CUDA graph of `fn` (capture after a warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return _events_ms(graph.replay)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = _events_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


def bench_rope(b: int) -> dict:
    cos, sin = (t.cuda() for t in rope_table(HIGGS_V3, S_MAX, torch.bfloat16))
    q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, HKV, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    caches = [torch.randn(b, HKV, S_MAX, D, device="cuda", dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    pos = torch.randint(0, S_MAX, (b,), device="cuda")
    q_out = torch.empty_like(q)

    def kernel():
        for i in range(LAYERS):
            rope.rope_kv_write[(b,)](q, k, v, cos, sin, pos, caches[2 * i], caches[2 * i + 1], 1, S_MAX, q_out,
                                        caches[2 * i], caches[2 * i + 1], Q_HEADS=HQ, KV_HEADS=HKV, HALF=D // 2)

    rows = torch.arange(b, device="cuda")

    def eager():  # the same work in place with torch ops: RoPE on q and k, then the cache rows written
        for i in range(LAYERS):
            onnx_ops.rotary_embedding(q, cos, sin, pos[:, None])
            k_rot = onnx_ops.rotary_embedding(k, cos, sin, pos[:, None])
            caches[2 * i][rows, :, pos] = k_rot[:, :, 0]
            caches[2 * i + 1][rows, :, pos] = v[:, :, 0]

    moved = LAYERS * (2 * q.nbytes + 4 * k.nbytes + 2 * b * D * 2 + b * 8)  # q in/out, k,v in + cache rows out, cos/sin
    return {"op": "rope_kv_write", "b": b, "kernel_ms": graph_ms(kernel), "eager_ms": _events_ms(eager),
            "bytes": moved}


def bench_codebook(b: int) -> dict:
    logits = torch.randn(b, K, V, device="cuda") * 4
    table = torch.randn(K * V, HIDDEN, device="cuda", dtype=torch.bfloat16)
    row = torch.full((b,), 12, device="cuda")
    end = torch.full((b,), 1 << 40, device="cuda")
    codes = torch.empty(b, K, device="cuda", dtype=torch.int32)
    embedding = torch.empty(b, HIDDEN, device="cuda", dtype=torch.bfloat16)
    constants = constants_for("delayed_codebook_step", D, HIDDEN, HQ, HKV)

    launch = grid("delayed_codebook_step", constants, b)

    def kernel():
        for _ in range(LAYERS):
            codebook.delayed_codebook_step[launch](logits, row, end, table, codes, embedding, **constants,
                                                  num_warps=NUM_WARPS["delayed_codebook_step"])

    def eager():
        for _ in range(LAYERS):
            delayed_codebook_step(logits, row, end, table)

    moved = LAYERS * (logits.nbytes + b * K * HIDDEN * 2 + codes.nbytes + embedding.nbytes + 2 * b * 8)
    return {"op": "delayed_codebook_step", "b": b, "kernel_ms": graph_ms(kernel), "eager_ms": _events_ms(eager),
            "bytes": moved}


def run() -> list[str]:
    bandwidth = copy_bandwidth()
    lines = [f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}; "
             f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)",
             f"{'op (per call)':<24}{'B':>4}{'kernel µs':>11}{'torch eager µs':>16}{'speed-up':>10}{'KB moved':>10}"
             f"{'GB/s':>8}{'of copy BW':>12}"]
    for bench in (bench_rope, bench_codebook):
        for b in (1, 8, 64):
            r = bench(b)
            rate = r["bytes"] / (r["kernel_ms"] * 1e-3)
            lines.append(f"{r['op']:<24}{b:>4}{1e3 * r['kernel_ms'] / LAYERS:>11.2f}{1e3 * r['eager_ms'] / LAYERS:>16.1f}"
                         f"{r['eager_ms'] / r['kernel_ms']:>9.1f}x{r['bytes'] / LAYERS / 1e3:>10.0f}{rate / 1e9:>8.0f}"
                         f"{100 * rate / bandwidth:>11.1f}%")
    return lines
