"""`higgs-trt compare`: the same teacher-forced decode through several runners, compared with Polygraphy.

Feeds are built from a reference run (the torch reference when a checkpoint is given, else ONNX Runtime): a
prefill of each prompt, then N decode steps fed the reference's own rows. Each feed carries the KV caches the
reference had at that step, so every runner computes one step from the same state (errors cannot pile up and
a cache bug shows at the step it happens) and every feed replays on its own, also with Polygraphy's CLI.

Runners: `torch` (the reference, fp32 math on the checkpoint's bf16 weights), `ort` (ONNX Runtime on the
engine's twin: lm.ref.onnx in fp32, or for FP8 engines lm.fp8.bf16ref.onnx, the FP8 graph with its bf16 roundings,
what an FP8 engine is held to: builder/bf16_twin.py) and `trt` (TensorRT on lm.plan; needs the
`tensorrt` module and a GPU, so it has not run here). Polygraphy's Comparator runs them and checks logits and
caches against the first runner with per-precision tolerances; codes are compared as per-codebook agreement.
"""

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.generate import NO_END, prefill_feeds, step_feeds
from higgs_trt.runtime.manifest import EngineDir

# (atol, rtol, min cosine) per compared pair: an output passes when every element is within atol + rtol·|ref| and
# its cosine to the reference is at least `min cosine`. Twin vs torch is the same fp32 math; FP8 adds quantization
# (logits max |Δ| 1.3, cosine ≥ 0.9967 on the tiny checkpoint; README); a TensorRT engine rounds activations to
# bf16 (about 1e-2 relative, per onnx-polygraphy-notes; not measured here).
TOLERANCES = {"fp32": (1e-4, 1e-4, 0.99999), "fp8": (3.0, 0.5, 0.99), "trt-bf16": (0.25, 0.1, 0.999),
              "trt-fp8": (3.0, 0.5, 0.99)}


def _runner_base():
    from polygraphy.backend.base import BaseRunner

    return BaseRunner


class TorchRunner(_runner_base()):
    """The torch reference as a Polygraphy runner: one stateless lm call per feed (caches in the feed)."""

    def __init__(self, ckpt, max_seq: int, io: dict):
        super().__init__(name="torch")
        self.ckpt, self.max_seq, self.io = ckpt, max_seq, io
        self.caches = [t["name"] for t in io["inputs"] if t["name"].startswith("past_")]

    def activate_impl(self):
        import torch

        from .model import HiggsLM

        self.torch = torch
        self.model = HiggsLM.from_checkpoint(self.ckpt, self.max_seq, torch.float32)

    def get_input_metadata_impl(self):
        from polygraphy.common import TensorMetadata

        meta = TensorMetadata()
        for t in self.io["inputs"]:
            meta.add(t["name"], np.dtype(t["dtype"]), t["shape"])
        return meta

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        torch = self.torch
        feeds = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feed_dict.items()}
        caches = tuple(feeds.pop(n) for n in self.caches)
        with torch.inference_mode():
            logits, codes, *present = self.model(**feeds, caches=caches)
        names = [n.replace("past_", "present_") for n in self.caches]
        self.inference_time = time.perf_counter() - t0
        return {"logits": logits.numpy(), "codes": codes.numpy(), **{n: c.numpy() for n, c in zip(names, present)}}

    def deactivate_impl(self):
        del self.model


def _zero_caches(engine: EngineDir) -> dict[str, np.ndarray]:
    """Empty fp32 caches for one sequence, as the engine's reference twin takes them."""
    return {t["name"]: np.zeros((1, *t["shape"][1:]), np.float32)
            for t in engine.graph("lm_ref")["inputs"] if t["name"].startswith("past_")}


def check_cache_binding(context, caches: list[str]) -> None:
    """Every `present_*` must be bound at its `past_*`'s address: the plan updates the caches in place (TensorRT's
    KV-cache layer requires it, NvInfer.h addKVCacheUpdate; the plugin path writes only the new rows through
    `present_*`: docs/tensorrt.md)."""
    for name in caches:
        present = name.replace("past_", "present_")
        if context.get_tensor_address(present) != context.get_tensor_address(name):
            raise HiggsError(f"the TensorRT runner bound {present} apart from {name}, which the plan updates in place; "
                             "Polygraphy 0.53.4+ binds them together: pip install -U polygraphy")


class CachesInPlace:
    """A plan's ICudaEngine that reports every `present_*` as an alias of its `past_*`, as the KV-cache layer's
    plans do, so that Polygraphy binds the plugin path's caches in place too (everything else is the engine's)."""

    def __init__(self, lm_engine):
        self.lm_engine = lm_engine

    def __getattr__(self, name):
        return getattr(self.lm_engine, name)

    def get_aliased_input_tensor(self, name):
        if name.startswith("present_"):
            return name.replace("present_", "past_")
        return self.lm_engine.get_aliased_input_tensor(name)


def cache_bound_trt_runner():
    """Polygraphy's TrtRunner with the KV caches bound in place, checked after every inference.

    Polygraphy ≥ 0.53.4 (backend/trt/runner.py, `_infer_impl`) binds each output that the engine reports through
    get_aliased_input_tensor at its input's address and returns that buffer as the output; every other output gets
    a buffer from its output allocator. The engine here reports every cache pair, so `present_*` comes back holding
    the updated cache."""
    from polygraphy.backend.trt import TrtRunner

    class CacheBoundTrtRunner(TrtRunner):
        def activate_impl(self):
            super().activate_impl()
            self.engine = CachesInPlace(self.engine)

        def _infer_impl(self, feed_dict, copy_outputs_to_host, return_raw_buffers):
            out = super()._infer_impl(feed_dict, copy_outputs_to_host, return_raw_buffers)
            check_cache_binding(self.context, [n for n in feed_dict if n.startswith("past_")])
            return out

    return CacheBoundTrtRunner


def _host_array(value) -> np.ndarray:
    """An output as numpy: a torch tensor comes to the host, bf16 widened to fp32 (numpy has no bf16), every other
    dtype kept (the int32 codes stay integers in outputs.json)."""
    if hasattr(value, "cpu"):
        import torch

        value = value.cpu()
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    return np.asarray(value)


class TrtPlanRunner(_runner_base()):
    """lm.plan through Polygraphy's TrtRunner (prefill profile, which also takes S = 1).

    The feeds carry the reference's fp32 caches; the plan takes bf16 ones. So this runner's input metadata names
    fp32 caches (what BaseRunner.infer checks the feeds against, and what numpy can hold), and infer_impl rounds
    them to bf16 torch tensors for the inner runner, whose metadata is the plan's."""

    def __init__(self, plan: Path):
        super().__init__(name="trt")
        self.plan = plan

    def activate_impl(self):
        from polygraphy.backend.trt import EngineFromBytes

        self.inner = cache_bound_trt_runner()(EngineFromBytes(self.plan.read_bytes()), optimization_profile=0)
        self.inner.activate()

    def get_input_metadata_impl(self):
        from polygraphy.datatype import DataType

        meta = self.inner.get_input_metadata(use_numpy_dtypes=False)
        for name, tensor in meta.items():
            if name.startswith("past_"):
                tensor.dtype = DataType.FLOAT32
        return meta

    def infer_impl(self, feed_dict):
        import torch

        feeds = {k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16) if k.startswith("past_") else v
                 for k, v in feed_dict.items()}
        out = self.inner.infer(feeds)
        self.inference_time = self.inner.last_inference_time()
        return {k: _host_array(v) for k, v in out.items()}

    def deactivate_impl(self):
        self.inner.deactivate()


def reference_feeds(engine: EngineDir, ckpt, prompts, steps: int) -> list[dict]:
    """Prefill + `steps` teacher-forced step feeds per prompt, each with the caches the reference had then."""
    max_seq = engine.manifest["limits"]["max_seq"]
    with _reference(engine, ckpt) as ref:
        return [feed for prompt in prompts for feed in teacher_forced(ref, prompt, steps, max_seq, _zero_caches(engine))]


def teacher_forced(ref, prompt, steps: int, max_seq: int, caches: dict) -> list[dict]:
    """The prefill of `prompt` and up to `steps` decode steps, each step fed the row `ref` (a feed → outputs
    function) chose, each feed with the caches `ref` had then (starting from `caches`)."""
    from higgs_trt.runtime.decoding import delay_mask

    feed, feeds = {**prefill_feeds([prompt]), **caches}, []
    for row in range(min(steps, max_seq - len(prompt)) + 1):
        feeds.append(feed)
        out = ref(feed)
        codes = delay_mask(out["codes"], np.array([row]), np.array([NO_END]))
        caches = {n: out[n.replace("past_", "present_")] for n in caches}
        feed = {**step_feeds(codes, np.array([len(prompt) + row]), row + 1, np.array([NO_END])), **caches}
    return feeds


@contextlib.contextmanager
def _reference(engine: EngineDir, ckpt):
    """A feed → outputs function: the torch reference with a checkpoint, else ONNX Runtime on the twin."""
    if ckpt is not None:
        with TorchRunner(ckpt, engine.manifest["limits"]["max_seq"], engine.graph("lm_ref")) as runner:
            yield runner.infer_impl
        return
    import onnxruntime as ort

    session = ort.InferenceSession(str(engine.file("lm_ref")), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    yield lambda feed: dict(zip(names, session.run(None, feed)))


@dataclass
class OutputStats:
    output: str
    step: int
    max_abs: float
    mean_abs: float
    max_rel: float
    cosine: float
    passed: bool
    agreement: list | None = None  # per codebook, for logits


def output_stats(name: str, step: int, ref: np.ndarray, got: np.ndarray, atol: float, rtol: float,
                 min_cosine: float) -> OutputStats:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    diff = np.abs(ref - got)
    denom = np.sqrt((ref * ref).sum() * (got * got).sum())
    cosine = float((ref * got).sum() / denom) if denom > 0 else 1.0
    passed = bool((diff <= atol + rtol * np.abs(ref)).all()) and cosine >= min_cosine
    agreement = None
    if name == "logits":
        agreement = [round(float(x), 4) for x in (ref.argmax(-1) == got.argmax(-1)).reshape(-1, ref.shape[-2]).mean(0)]
    return OutputStats(name, step, float(diff.max()), float(diff.mean()),
                       float((diff / np.maximum(np.abs(ref), 1e-6)).max()), cosine, passed, agreement)


def compare(engine_dir: Path, ckpt, runners: list[str], prompts, steps: int,
            save: Path | None, say) -> dict:
    """Run the comparison; returns the report (also written under `save`). report['passed'] is the verdict."""
    import onnxruntime
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator
    from polygraphy.json import save_json
    from polygraphy.logger import G_LOGGER

    onnxruntime.set_default_logger_severity(3)  # TensorScatter warns on every call that it copies the cache
    G_LOGGER.module_severity = G_LOGGER.WARNING

    engine = EngineDir(engine_dir)
    precision = engine.manifest["precision"]
    if "torch" in runners and ckpt is None:
        raise HiggsError("the torch runner needs --checkpoint")
    if ckpt is not None:
        engine.check_checkpoint(ckpt.fingerprint(), ckpt.dir)
    available = {}
    for name in runners:
        if name == "torch":
            available[name] = TorchRunner(ckpt, engine.manifest["limits"]["max_seq"], engine.graph("lm_ref"))
        elif name == "ort":
            twin = "lm_fp8_bf16ref" if precision == "fp8" else "lm_ref"
            available[name] = OnnxrtRunner(SessionFromOnnx(str(engine.file(twin)), providers=["cpu"]), name="ort")
        elif name == "trt":
            from higgs_trt.runtime import trt_shim

            module, problem = trt_shim.try_load("tensorrt")
            if module is None or "engines" not in engine.manifest:
                say(f"  skipping trt: {'no TensorRT engines in ' + str(engine_dir) if module else problem}")
                continue
            available[name] = TrtPlanRunner(engine.path / engine.manifest["engines"]["lm"]["file"])
        else:
            raise HiggsError(f"unknown runner {name!r}; choose from torch, ort, trt")
    if len(available) < 2:
        raise HiggsError(f"need at least two runners to compare; available here: {', '.join(available) or 'none'}")

    max_seq = engine.manifest["limits"]["max_seq"]  # the cache holds a prompt and its steps
    capped = f", fewer where the {max_seq}-row cache ends first" if steps > max_seq - max(map(len, prompts)) else ""
    say(f"  building teacher-forced feeds ({steps} steps per prompt{capped}, reference: "
        f"{'torch' if ckpt else 'ort'})…")
    feeds = reference_feeds(engine, ckpt, prompts, steps)
    say(f"  running {', '.join(available)} on {len(feeds)} feeds…")
    results = Comparator.run(list(available.values()), data_loader=feeds)

    names = list(available)
    reference = names[0]
    rows = []
    for other in names[1:]:
        kind = ("trt-" + precision) if other == "trt" else ("fp8" if precision == "fp8" and "ort" in (reference, other)
                                                          else "fp32")
        for step, (a, b) in enumerate(zip(results[reference], results[other])):
            for output in a.keys():
                if output == "codes":
                    continue
                rows.append({"pair": f"{other} vs {reference}", "tolerance": kind,
                             **output_stats(output, step, a[output], b[output], *TOLERANCES[kind]).__dict__})
    failed = [r for r in rows if not r["passed"]]
    report = {"engine": str(engine_dir), "precision": precision, "runners": names, "feeds": len(feeds),
              "tolerances": {k: dict(zip(("atol", "rtol", "min_cosine"), v)) for k, v in TOLERANCES.items()},
              "passed": not failed, "failures": sorted({f"{r['pair']}: {r['output']}" for r in failed}),
              "outputs": rows}
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        save_json(feeds, save / "inputs.json")  # Polygraphy's own format: --load-inputs
        results.save(str(save / "outputs.json"))  # RunResults: --load-outputs
        (save / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def summary(report: dict) -> list[str]:
    lines = []
    for pair in sorted({r["pair"] for r in report["outputs"]}):
        rows = [r for r in report["outputs"] if r["pair"] == pair]
        for output in ("logits", *sorted({r["output"] for r in rows} - {"logits"})):
            sel = [r for r in rows if r["output"] == output]
            if not sel:
                continue
            worst = max(sel, key=lambda r: r["max_abs"])
            line = (f"{pair:<14} {output:<16} max|Δ| {worst['max_abs']:.3g} (step {worst['step']})  "
                    f"mean|Δ| {np.mean([r['mean_abs'] for r in sel]):.3g}  "
                    f"min cos {min(r['cosine'] for r in sel):.6f}  "
                    f"{'ok' if all(r['passed'] for r in sel) else 'FAIL'}")
            if output == "logits":
                agree = np.mean([r["agreement"] for r in sel], axis=0)
                line += "  top-1 " + " ".join(f"{a:.2f}" for a in agree)
            lines.append(line)
    lines.append("PASSED" if report["passed"] else "FAILED: " + "; ".join(report["failures"]))
    return lines


def locate_divergence(engine_dir: Path, ckpt, prompts, say) -> dict:
    """Per-layer mode: every intermediate tensor of the engine's fp32 twin against the same graph exported afresh
    from the checkpoint (same exporter, same tensor names), for the first prompt's prefill. Returns the first
    tensor, in graph order, whose error exceeds the fp32 tolerance (None when all agree)."""
    import tempfile

    import onnxruntime
    from polygraphy.backend.onnx import BytesFromOnnx, ModifyOutputs, OnnxFromPath
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    from .export import export_engine

    onnxruntime.set_default_logger_severity(3)
    engine = EngineDir(engine_dir)
    limits = engine.manifest["limits"]
    feed = {**prefill_feeds(prompts[:1]), **_zero_caches(engine)}
    atol, rtol, _ = TOLERANCES["fp32"]
    with tempfile.TemporaryDirectory() as tmp:
        say("  exporting a fresh reference twin from the checkpoint…")
        fresh = export_engine(ckpt, Path(tmp) / "fresh", limits["max_seq"], limits["max_batch"],
                              limits["max_prompt"], say=lambda m: None)
        outputs = []
        for path in (engine.file("lm_ref"), fresh / "lm.ref.onnx"):
            marked = BytesFromOnnx(ModifyOutputs(OnnxFromPath(str(path)), outputs=_fp32_tensors(path)))
            with OnnxrtRunner(SessionFromOnnx(marked, providers=["cpu"])) as runner:
                outputs.append(runner.infer(feed))
    mine, fresh_out = outputs
    for name, value in mine.items():  # graph order
        if name not in fresh_out or value.dtype.kind != "f":
            continue
        ref = fresh_out[name]
        if value.shape == ref.shape and not np.allclose(value, ref, atol=atol, rtol=rtol):
            return {"tensor": _describe(engine.file("lm_ref"), name), "max_abs": float(np.abs(value - ref).max()),
                    "compared": len(mine)}
    return {"tensor": None, "compared": len(mine)}


def _describe(path: Path, tensor: str) -> str:
    """A tensor with the node that makes it, and the weights that node reads."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    weights = {i.name for i in graph.initializer}
    node = next(n for n in graph.node if tensor in n.output)
    read = [i for i in node.input if i in weights and not i.startswith("val_")]
    return f"{tensor} = {node.op_type}({', '.join(read) or '…'})"


def _fp32_tensors(path: Path) -> list[str]:
    """Every fp32 tensor a node of the graph produces, in graph order (ORT cannot hand bf16 tensors to numpy)."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(path, load_external_data=False))
    fp32 = {v.name for v in [*model.graph.value_info, *model.graph.output]
            if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    return [o for n in model.graph.node for o in n.output if o in fp32]
