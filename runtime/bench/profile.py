"""`higgs-trt bench profile`: one decode step of the GPU engine kernel by kernel (needs a CUDA GPU), or with
`--leave-out` what each kernel kind costs inside the step's chain (chain_costs, below); and `bench stream --timeline`:
where a streaming level's time goes (profile_level, below).

Each kernel's GPU time from torch's profiler (CUPTI), launched without programmatic dependent launch, so that a kernel's
time is its own and not partly its wait for the one before. Kernels are named by their place in the step (the launch
order of GpuEngine.decode_step), and the GEMMs' weight bytes give each its read rate: where a step's time goes and how far
each kernel is from the copy bandwidth. Random weights at the checkpoint's dimensions, every slot at `context` cached
positions (attention's work), as bench decode does.
"""

import bisect
import functools
import json
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from higgs_trt.plugins import attention, engine_kernels
from higgs_trt.runtime.config import HiggsConfig
from higgs_trt.runtime.gpu.engine import GpuEngine

from .gpu import captured_step, linear_bytes, placeholder_amax, random_tensors, replay_ms, timing_engine

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
                engine.decode_step(b)
            engine.write_pos[:b] = context
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.decode_step(b)
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


# ---- what each kernel kind costs inside the step (bench profile --leave-out) --------------------------------------

# kernel kinds by the module attribute the engine launches them through (looked up at each launch, so replacing it
# there replaces every launch); the audio head is a linear too
LEAVE_OUT = {"norms": ((engine_kernels, "rms_norm"),), "attention": ((attention, "decode_attention_split"),),
             "GEMMs": ((engine_kernels, "linear"),)}
LEFT_OUT_ROWS = (("norms",), ("attention",), ("GEMMs",), ("norms", "attention"))


class _NotLaunched:
    """A kernel's stand-in: its launches do nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextmanager
def left_out(kinds):
    """Inside, the engine's launches of these kernel kinds (LEAVE_OUT) do nothing; put back on leaving."""
    targets = [target for kind in kinds for target in LEAVE_OUT[kind]]
    saved = [getattr(module, name) for module, name in targets]
    try:
        for module, name in targets:
            setattr(module, name, _NotLaunched())
        yield
    finally:
        for (module, name), kernel in zip(targets, saved):
            setattr(module, name, kernel)


def chain_costs(cfg: HiggsConfig, batches=(1, 64), fp8_options=(False, True), context: int = 300,
                max_seq: int = 2048, rounds: int = 3, say=print) -> None:
    """The step's time as the engine runs it (one CUDA graph, programmatic dependent launch, replays back to back)
    with each kernel kind left out: what each costs inside the chain, where a kernel's launch, wait and ramp overlap
    its neighbours' and the profiler's times (profile_step) do not add up. What the step computes then is garbage;
    only its time is read. Variants alternate, `rounds` times; the least time of each."""
    tensors = random_tensors(cfg)
    for fp8 in fp8_options:
        engine = timing_engine(cfg, fp8, max(batches), tensors, max_seq)
        for b in batches:
            graphs = {}
            for kinds in ((),) + LEFT_OUT_ROWS:
                with left_out(kinds):
                    graphs[kinds] = captured_step(engine, b, context)
            times = {kinds: [] for kinds in graphs}
            for _ in range(rounds):
                for kinds, graph in graphs.items():
                    times[kinds].append(replay_ms(engine, graph, b, context))
            full = min(times[()])
            say(f"{engine.precision} B={b}, {context} cached positions: the step {full:.3f} ms")
            for kinds in LEFT_OUT_ROWS:
                t = min(times[kinds])
                say(f"    without {' and '.join(kinds):<20} {t:7.3f} ms: {1e3 * (full - t) / cfg.num_layers:6.1f} µs a "
                    f"layer in the chain")
        del engine
        torch.cuda.empty_cache()


# ---- a streaming level's timeline (bench stream --timeline) ------------------------------------------------------

SCHEDULER_CALLS = ("_admit", "_due", "_decode", "_collect", "_finish")
ENGINE_CALLS = ("step", "rows", "prefill", "codec", "release")
GAP_US = 5.0  # idle gaps shorter than this are a kernel's own launch, not waiting for the host


def profile_level(run, engine, say=print):
    """run() (one streaming level) under torch's profiler with the scheduler's and the engine's calls labelled;
    says timeline_lines of the trace and returns run()'s result. The profiler slows the host: the level's own figures
    then understate what it does unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    with labelled_calls(engine), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = run()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    for line in timeline_lines(events):
        say(line)
    return result


@contextmanager
def labelled_calls(engine):
    """The scheduler's and the engine's calls as profiler ranges named "@scheduler._decode", "@engine.step", …, so
    that a trace shows what the host was doing at any moment; put back as they were on leaving."""
    from higgs_trt.runtime.scheduler import Scheduler

    def labelled(fn, label):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return call

    originals = {name: Scheduler.__dict__[name] for name in SCHEDULER_CALLS}
    own = {name: engine.__dict__[name] for name in ENGINE_CALLS if name in engine.__dict__}
    try:
        for name, fn in originals.items():
            setattr(Scheduler, name, labelled(fn, "@scheduler." + name))
        for name in ENGINE_CALLS:
            setattr(engine, name, labelled(getattr(engine, name), "@engine." + name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(Scheduler, name, fn)
        for name in ENGINE_CALLS:
            if name in own:
                setattr(engine, name, own[name])
            else:
                engine.__dict__.pop(name, None)


def timeline_lines(events: list[dict]) -> list[str]:
    """Where a profiled level's time went, from its chrome-trace events: the stream with the most kernels is the
    decode stream (prefills run there too), the next the codec's. The decode stream's busy time and its idle gaps,
    each gap of GAP_US or more charged to the innermost labelled call running when it began ("(loop)": none), with
    how long the codec stream was busy meanwhile (a gap while codec kernels hold the GPU is contention, not the
    host)."""
    kernels: dict = {}
    labels = []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "kernel":
            kernels.setdefault(e.get("args", {}).get("stream"), []).append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") == "user_annotation" and e.get("name", "").startswith("@"):
            labels.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    if not kernels:
        return ["timeline: no GPU kernels in the trace"]
    streams = sorted(kernels, key=lambda s: -len(kernels[s]))
    decode = _union(kernels[streams[0]])
    codec = _union(kernels[streams[1]]) if len(streams) > 1 else []
    span = decode[-1][1] - decode[0][0]
    lines = [f"timeline: decode stream busy {_total(decode) / 1e3:.1f} of {span / 1e3:.1f} ms; codec stream busy "
             f"{_total(codec) / 1e3:.1f} ms, {_overlap(decode, codec) / 1e3:.1f} of it beside decode kernels"]
    labels.sort()
    starts = [lab[0] for lab in labels]
    idle: dict[str, list] = {}
    for (_, gap_start), (gap_end, _) in zip(decode, decode[1:]):
        if gap_end - gap_start < GAP_US:
            continue
        name = _innermost(labels, starts, gap_start)
        entry = idle.setdefault(name, [0.0, 0, 0.0])
        entry[0] += gap_end - gap_start
        entry[1] += 1
        entry[2] += _overlap([[gap_start, gap_end]], codec)
    total = sum(t for t, _, _ in idle.values())
    lines.append(f"  decode stream idle {total / 1e3:.1f} ms in gaps of {GAP_US:g} µs or more, by the call running "
                 f"when each began (codec stream busy meanwhile):")
    for name, (t, count, beside) in sorted(idle.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"    {name:<22} {t / 1e3:8.1f} ms in {count:5d} gaps ({beside / 1e3:.1f})")
    return lines


def _innermost(labels, starts, t) -> str:
    """The latest-starting label that contains t (the host's calls nest: the innermost one), or "(loop)"."""
    for i in range(bisect.bisect_right(starts, t) - 1, -1, -1):
        if labels[i][1] >= t:
            return labels[i][2]
        if t - labels[i][0] > 1e6:  # the loop's calls take milliseconds: stop looking a second back
            break
    return "(loop)"


def _union(intervals) -> list[list[float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _total(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a, b) -> float:
    """Time inside both of two sorted, disjoint interval lists."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both
