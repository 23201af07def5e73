"""`bench decode` on the GPU engine, and the helpers every GPU benchmark shares (needs a CUDA GPU).

Everything is measured side by side in one process, against the device's copy bandwidth measured in the same run:
the floor of a decode step is the bytes of weights it must read (FP8 halves the decoder's) over that bandwidth.
Random weights at the checkpoint's dimensions: timing does not depend on the values (nor on the text, which only
sets how many keys attention reads: each slot is put at `context` cached positions).
"""

import time

import numpy as np
import torch

from higgs_trt.runtime.config import HiggsConfig, lm_tensor_shapes
from higgs_trt.runtime.gpu.engine import GpuEngine
from higgs_trt.runtime.gpu.linear import Linear

from .kernels import copy_bandwidth, graph_ms

REPS = 30


def random_tensors(cfg: HiggsConfig, device: str = "cuda", seed: int = 0) -> dict:
    """The language model's tensors at the checkpoint's names and shapes, random (std 0.02; norms near 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in lm_tensor_shapes(cfg).items():
        t = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
        out[name] = 1 + 0.1 * t if name.endswith("norm.weight") else 0.02 * t
    return out


def placeholder_amax(cfg: HiggsConfig) -> dict[str, float]:
    """Unit activation scales (amax 4.0 at every FP8 site) for timing FP8 without calibrating: the scales change the
    numbers, not the work."""
    return {f"body.layers.{i}.{site}": 4.0 for i in range(cfg.num_layers)
            for site in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")}


def linear_bytes(lin: Linear) -> int:
    """Bytes a linear reads per call: its weights (gate and up when gated) and FP8 scales."""
    return sum(t.nbytes for t in (lin.weight, lin.up, lin.scale, lin.up_scale) if t is not None)


def weight_bytes(engine: GpuEngine) -> int:
    """Bytes one decode step must read: every decoder weight (+ FP8 scales) and the audio head."""
    return engine.head.weight.nbytes + sum(linear_bytes(lin) for layer in engine.layers
                                           for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))


def timing_engine(cfg: HiggsConfig, fp8: bool, max_batch: int, tensors: dict | None = None,
                  max_seq: int = 2048) -> GpuEngine:
    """An engine of random weights (or `tensors`) whose steps the caller captures and times itself (no graphs)."""
    return GpuEngine(cfg, tensors if tensors is not None else random_tensors(cfg), max_seq=max_seq,
                     max_batch=max_batch, max_prompt=16, act_amax=placeholder_amax(cfg) if fp8 else None,
                     graphs=False)


def captured_step(engine: GpuEngine, b: int, context: int) -> "torch.cuda.CUDAGraph":
    """One decode step for slots [0, b) at `context` cached positions, captured (its kernels compiled first)."""
    with torch.cuda.stream(engine.stream):
        engine.active[:b] = 1
        engine.write_pos[:b] = context
        engine.decode_step(b)  # compiles what it launches, outside the capture
        torch.cuda.current_stream().synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=engine.stream):
            engine.decode_step(b)
    return graph


def replay_ms(engine: GpuEngine, graph, b: int, context: int, replays: int = 100) -> float:
    """ms per replay of a captured step, back to back (as the decode loop launches them)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(engine.stream):
        engine.active[:b] = 1
        engine.write_pos[:b] = context
        graph.replay()  # untimed: the first timed replay starts behind it, as in the decode loop
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        engine.active.zero_()
    return start.elapsed_time(stop) / replays


STREAM_RUNS = 5  # bench decode's lone-stream runs (after a warm-up), reported by their medians


BACK_TO_BACK = 8  # steps timed in a row (attention then reads `context` to `context` + 7 positions)


def step_ms(engine: GpuEngine, batch: int, context: int) -> tuple[float, float]:
    """Median time of one decode step (its captured graph) with `batch` active slots at `context` positions: back to
    back (BACK_TO_BACK replays between two events, the first event recorded behind an untimed replay, so the GPU
    never waits for the host's launch: the decode loop's case, where step n+1 is launched while step n runs), and
    alone (one replay from an idle GPU, which includes the graph's launch: the figure earlier rounds reported)."""
    graph = engine.step_graph(batch)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    alone, back_to_back = [], []
    with torch.cuda.stream(engine.stream):
        engine.active[:batch] = 1
        for _ in range(REPS):
            engine.write_pos[:batch] = context  # keep the attention length fixed across replays
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            alone.append(start.elapsed_time(stop))
            engine.write_pos[:batch] = context
            graph.replay()
            start.record()
            for _ in range(BACK_TO_BACK):
                graph.replay()
            stop.record()
            stop.synchronize()
            back_to_back.append(start.elapsed_time(stop) / BACK_TO_BACK)
        engine.active.zero_()
    return float(np.median(back_to_back)), float(np.median(alone))


def bench_decode(engine: GpuEngine, prompt, batches=(1, 8, 64), rows: int = 250, context: int = 300,
                 say=print) -> None:
    """Per batch size: ms per step (graph replay), host µs per row (the scheduler's loop, outside waits on the
    GPU), audio-s/s of decode, and time to first audio of one stream (prefill, the rows of the first exact chunk,
    its codec window); the floor and peak GPU memory."""
    from higgs_trt.runtime.decoding import Sampling
    from higgs_trt.runtime.request import request_for
    from higgs_trt.runtime.scheduler import Scheduler

    bandwidth = copy_bandwidth()
    floor = weight_bytes(engine) / bandwidth * 1e3
    say(f"{engine.precision}: weights read per step {weight_bytes(engine) / 1e9:.2f} GB, copy {bandwidth / 1e12:.2f} TB/s"
        f" → floor {floor:.3f} ms")
    # one stream through the scheduler, greedy then sampled: TTFA and host time per row
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=0)):
        scheduler = Scheduler(engine)
        runs = []
        for _ in range(1 + STREAM_RUNS):  # the first run warms the prefill's kernels
            engine.reset_timers()
            scheduler.polled = 0.0
            request = request_for(engine, prompt, sampling, hard_cap=rows)
            request.fixed_rows = True
            scheduler.submit(request)
            t0 = time.perf_counter()
            scheduler.run()
            wall = time.perf_counter() - t0
            n = len(request.utterance.rows)
            timers = engine.timers()
            # the host's own work: neither waiting for the GPU (a step, or a first chunk's codec call while a step
            # runs) nor issuing the prefill and codec calls
            host = (wall - timers["waited"] - scheduler.polled - timers["codec"] - timers["prefill"]) / n
            runs.append((host, 1e3 * (request.first_audio_at - request.submitted_at), wall, timers["prefill"],
                         timers["codec"]))
        host, ttfa, wall, prefill, codec = (float(np.median(v)) for v in zip(*runs[1:]))
        hosts = [r[0] for r in runs[1:]]
        say(f"  1 stream {'greedy' if sampling.greedy else 'T=1':<7} {n} rows in {wall * 1e3:7.1f} ms: "
            f"first audio {ttfa:6.1f} ms (prefill issued in {1e3 * prefill:.1f} ms), host {1e6 * host:5.1f} µs/row "
            f"({1e6 * min(hosts):.1f}–{1e6 * max(hosts):.1f}), codec calls issued in {1e3 * codec:.1f} ms "
            f"(medians of {STREAM_RUNS} runs)")
    for b in batches:
        if b > engine.max_batch:
            continue
        ms, alone = step_ms(engine, b, context)
        say(f"  B={b:<3} {ms:7.3f} ms/step ({ms / floor:4.2f}× floor)  {b / (ms * 1e-3 * 25):8.1f} audio-s/s of decode; "
            f"alone {alone:7.3f} ms")
    say(f"  peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def bench_codec(ckpt, windows=(1, 8, 64), say=print) -> None:
    """One codec call as the GPU engine replays it (a CUDA graph, channels-last rows, only the kept frames' samples)
    for each window shape of the default stream plan and each window count: TF32 convolutions against fp16 ones
    (CodecDecoder.fp16, the engine's), ms per call and each one's error against exact fp32 (TF32 off), random codes."""
    from higgs_trt.runtime.gpu.codec import CodecDecoder
    from higgs_trt.runtime.streaming import StreamPlan

    models = {"TF32": CodecDecoder.from_checkpoint(ckpt).channels_last().to("cuda"),
              "fp16": CodecDecoder.from_checkpoint(ckpt).channels_last().to("cuda").fp16()}
    dims = models["TF32"].dims
    rng = np.random.default_rng(0)
    say("codec calls, ms (error against exact fp32)")
    for frames, keep in StreamPlan.exact(dims.strides).window_shapes():
        for n in windows:
            codes = torch.from_numpy(rng.integers(0, dims.codebook_size, (n, dims.num_quantizers, frames))).cuda()
            with torch.inference_mode():
                tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
                try:
                    exact = models["TF32"](codes, keep)
                finally:
                    torch.backends.cudnn.allow_tf32 = tf32  # the caller's setting, whatever it was
                figures = []
                for name, model in models.items():
                    ms = graph_ms(lambda: model(codes, keep))
                    error = float(((model(codes, keep) - exact) ** 2).mean() / (exact ** 2).mean())
                    figures.append(f"{name} {ms:6.2f} ms ({10 * np.log10(max(error, 1e-30)):5.1f} dB)")
            say(f"  {n:2d} windows of {frames} frames, frames {keep[0]}..{keep[1]} kept: {'   '.join(figures)}")
