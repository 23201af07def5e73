"""ONNX graphs → TensorRT plans, written into the engine directory beside the graphs.

- `lm.plan`: the lm graph with two optimization profiles, 0 = prefill (S = 1..max_prompt) and 1 = decode
  step (S = 1). One engine rather than two: the weights (8 GB in bf16 for Higgs v3) are held once on the GPU,
  and one execution context switches profiles. The KV caches are static [B, Hkv, S_max, D] inputs in both
  profiles (TensorRT's KV-cache layer needs a static S_max).
- `codec.plan`: codes [B, 8, T] → waveform, B = 1..max_batch windows of T = 1..CODEC_MAX_FRAMES frames (the
  runtime decodes audio only in streaming windows; TensorRT sizes context memory for the profile's maximum).
- `codec_encoder.plan` (when the graph exists): reference audio of 1..30 s → codes; both inputs' lengths vary.

Networks are strongly typed (precision comes from the ONNX tensor types and explicit Q/DQ; TensorRT 11 has no
precision flags). `target` builds with TensorRT-RTX for that compute capability (works without a GPU);
without it, datacenter TensorRT builds for the local GPU. `lean` makes VERSION_COMPATIBLE plans that exclude the
lean runtime, for `tensorrt_lean` of the same version. docs/tensorrt.md gives the sources of each decision.
"""

import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from higgs_trt.runtime import cuda, trt_shim
from higgs_trt.runtime.audio import MAX_SECONDS, MIN_SECONDS, SAMPLE_RATE, SEMANTIC_RATE
from higgs_trt.runtime.decoding import CODEC_MAX_FRAMES
from higgs_trt.runtime.errors import HiggsError

from .checkpoint import Checkpoint

WORKSPACE = 4 << 30
TIMING_CACHE = "timing.cache"
PLANS = {"lm": "lm.plan", "codec": "codec.plan", "codec_encoder": "codec_encoder.plan"}
ATTENTION = ("fused", "matmul")  # export's choices for the native path (builder/ops.py)


@dataclass
class Plan:
    data: bytes
    layers: Counter  # layer type name → count in the parsed network
    seconds: float
    errors: list  # ERROR lines TensorRT logged although it returned a plan
    layer_info: str | None = None  # the builder's engine layer information, when asked for (TensorRT-RTX logs it)


def _concrete(shape: list, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else sizes[d] for d in shape)


def profiles_for(graph_io: dict, ranges: dict[str, dict[str, tuple[int, int, int]]]) -> list[dict]:
    """Optimization profiles in index order: each input's [min, opt, max] shape from the graph's symbolic dims."""
    return [{"name": profile, "shapes": {
        t["name"]: [list(_concrete(t["shape"], {k: v[i] for k, v in sizes.items()})) for i in range(3)]
        for t in graph_io["inputs"]}} for profile, sizes in ranges.items()]


def lm_ranges(limits: dict) -> dict:
    b, p = limits["max_batch"], limits["max_prompt"]
    return {"prefill": {"batch": (1, 1, b), "seq": (1, min(64, p), p)},
            "decode": {"batch": (1, 1, b), "seq": (1, 1, 1)}}


CODEC_OPT_FRAMES = 45  # a streaming window: 10 frames of left context + 25 new + 10 held back


def codec_ranges(limits: dict) -> dict:
    return {"decode": {"batch": (1, 1, limits["max_batch"]),
                       "frames": (1, min(CODEC_OPT_FRAMES, CODEC_MAX_FRAMES), CODEC_MAX_FRAMES)}}


def encoder_ranges(geometry: dict) -> dict:
    """Reference lengths 1..30 s (10 s optimal); the 24 kHz input may carry the hop/2 padding on both sides."""
    def samples(rate: int, extra: int = 0) -> tuple[int, int, int]:
        return int(MIN_SECONDS * rate), 10 * rate, int(MAX_SECONDS * rate) + extra

    return {"encode": {"samples_24k": samples(SAMPLE_RATE, 2 * geometry["acoustic_pad"]),
                       "samples_16k": samples(SEMANTIC_RATE)}}


def _allow_decomposed_attention(trt, network) -> int:
    """Let every attention layer fall back to several kernels where TensorRT has no fused one for the GPU and
    profile ("Setting the IAttention to decomposable=True can allow IAttention to be decomposed to use multiple
    kernels if no fused kernel support found": NvInfer.h, IAttention); TensorRT still tries the fused kernel
    first. Returns how many there are."""
    count = 0
    for i in range(network.num_layers):
        boundary = network.get_layer(i)
        if boundary.type == trt.LayerType.ATTENTION_OUTPUT:
            boundary.__class__ = trt.IAttentionOutputLayer  # the Python bindings hand out plain ILayers
            attention = boundary.attention
            attention.decomposable = True
            count += 1
    return count


def build_plan(trt, onnx_path: Path, profiles: dict, target: str | None, lean: bool, timing_cache: Path | None,
               layer_info: bool = False) -> Plan:
    """One plan. `layer_info`: keep the layer information the builder logs (kernels, fused layers, constants' types)
    with ProfilingVerbosity.DETAILED."""
    logger = trt_shim.make_logger(trt, keep=(lambda msg: str(msg).startswith("Layers:")) if layer_info else None)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(" ".join(parser.get_error(i).desc().split()) for i in range(parser.num_errors))
        raise HiggsError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    layers = Counter(network.get_layer(i).type.name for i in range(network.num_layers))
    attention = _allow_decomposed_attention(trt, network)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE)
    if layer_info:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if target:
        trt_shim.set_target(trt, config, target)
    if lean:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        config.set_flag(trt.BuilderFlag.EXCLUDE_LEAN_RUNTIME)
    for entry in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in entry["shapes"].items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    if timing_cache:
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
        config.set_timing_cache(cache, False)

    t0 = time.perf_counter()
    data = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    # The plan decides, as in trtexec (samples/common/sampleEngines.cpp) and Polygraphy (backend/trt/loader.py):
    # None is a failure; ERROR lines logged beside a plan (TensorRT-RTX logs CUDA errors without a GPU) are reported.
    if data is None:
        hints = [h for h, applies in (
            ("--lean allows only lean-runtime operators (BuilderFlag.VERSION_COMPATIBLE): build without --lean", lean),
            ("its attention layers found no kernel: export with --attention matmul (MatMul + Softmax)", attention))
            if applies]
        raise HiggsError(f"TensorRT could not build {onnx_path.name}: {'; '.join(logger.errors) or 'no engine'}"
                         + "".join(f"; if {h}" for h in hints))
    if timing_cache:
        timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    info = "\n".join(logger.kept) if layer_info and logger.kept else None
    return Plan(bytes(memoryview(data)), layers, seconds, list(logger.errors), info)


def register_plugins(trt, engine_dir: Path, manifest: dict, target: str | None) -> list:
    """The plugin path's plugins in `trt`'s registry: TensorRT-RTX's build-only twins, or the QDP AOT plugins with
    this engine directory's PTX. Keep the returned creators alive until the builds are done."""
    from higgs_trt.plugins import qdp, rtx_build

    if target:
        return rtx_build.register(trt)
    qdp.check_ptx(manifest, cuda.capability(), cuda.driver_version())
    return qdp.register(engine_dir, manifest)


def build_engines(engine_dir: Path, manifest: dict, lm_graph: str, target: str | None, lean: bool, say) -> dict:
    """Build lm, codec (and codec_encoder) plans into `engine_dir`; returns the manifest's `engines` and `build`
    sections."""
    trt = trt_shim.load("rtx") if target else datacenter_tensorrt()
    limits = manifest["limits"]
    engines = {}
    plugins = manifest["ops"] == "plugin"
    registered = register_plugins(trt, engine_dir, manifest, target) if plugins else None  # alive until the builds end
    plans = [("lm", lm_graph, lm_ranges(limits)), ("codec", "codec", codec_ranges(limits))]
    if "codec_encoder" in manifest["graphs"]:
        plans.append(("codec_encoder", "codec_encoder", encoder_ranges(manifest["graphs"]["codec_encoder"]["geometry"])))
    for key, graph, ranges in plans:
        io = manifest["graphs"][graph]
        profiles = profiles_for(io, ranges)
        names = ", ".join(p["name"] for p in profiles)
        say(f"  building {PLANS[key]} from {io['file']} ({names} profile{'s' * (len(profiles) > 1)})…")
        onnx_path = engine_dir / io["file"]
        if plugins and key == "lm":
            onnx_path = _without_plugin_functions(onnx_path)
        # TensorRT-RTX has no timing cache (its cache calls are no-ops that log CUDA errors without a GPU)
        try:
            plan = build_plan(trt, onnx_path, profiles, target, lean, None if target else engine_dir / TIMING_CACHE)
        finally:
            if onnx_path != engine_dir / io["file"]:
                onnx_path.unlink()
        tmp = engine_dir / f".{PLANS[key]}.tmp"
        tmp.write_bytes(plan.data)
        tmp.replace(engine_dir / PLANS[key])
        engines[key] = {"file": PLANS[key], "graph": graph, "profiles": profiles, "layers": dict(plan.layers),
                        "build_seconds": round(plan.seconds, 2)}
        say(f"  {PLANS[key]}: {len(plan.data) / 2**20:.1f} MiB in {plan.seconds:.1f} s")
        if plan.layers["ATTENTION_OUTPUT"]:
            say(f"  {PLANS[key]}: {plan.layers['ATTENTION_OUTPUT']} attention layers, each a fused kernel where "
                "TensorRT has one for this GPU and profile, else decomposed (IAttention.decomposable)")
        if plan.errors:
            say(f"  TensorRT logged {len(plan.errors)} error(s) while building {PLANS[key]} and returned a plan: "
                f"{'; '.join(dict.fromkeys(plan.errors))[:500]}")
    build = {"builder": "tensorrt-rtx" if target else "tensorrt", "version": trt.__version__,
             "target": target or "local-gpu", "lean": lean}
    if plugins:
        build["plugins"] = "build-only twins (plugins/rtx_build.py): do not run" if target else "QDP AOT (PTX in the plan)"
        del registered
    return {"engines": engines, "build": build}


def datacenter_tensorrt():
    """The `tensorrt` module, if it and the local GPU can build our plans (else one HiggsError line)."""
    trt = trt_shim.load("tensorrt")
    problem = trt_shim.version_problem(trt) or cuda.gpu_problem()
    if problem:
        raise HiggsError(f"cannot build for the local GPU: {problem}")
    return trt


def _without_plugin_functions(path: Path) -> Path:
    """A copy of the graph without the plugin nodes' reference bodies, beside it (its external data resolves)."""
    import onnx

    from higgs_trt.plugins.schemas import strip_functions

    model = strip_functions(onnx.load(path, load_external_data=False))
    stripped = path.with_name(f".{path.stem}.for-tensorrt.onnx")
    onnx.save(model, stripped)
    return stripped


def check_request(ops: str, attention: str, target: str | None, lean: bool) -> None:
    """Combinations refused before any work, each in one line (sources: docs/tensorrt.md)."""
    if lean and target:
        raise HiggsError("--lean makes plans for tensorrt_lean, which TensorRT-RTX plans cannot use; drop --target")
    if lean and ops == "plugin":
        raise HiggsError("--lean with --ops plugin: version-compatible plans take plugins only from plugin libraries "
                         "(IBuilderConfig.plugins_to_serialize), which the QDP AOT plugins are not; use --ops native")
    if attention != "fused" and ops == "plugin":
        raise HiggsError(f"--attention {attention} applies to --ops native; the plugin path attends with "
                         "higgs::decode_attention")


def build(ckpt: Checkpoint, out: Path, precision: str, target: str | None, lean: bool, limits: dict, say,
          calibration: Path | None = None, gate: tuple[float, float] | None = None, ops: str = "native",
          attention: str = "fused") -> Path:
    """Export (reusing the engine directory's graphs when nothing they depend on changed), then build."""
    from higgs_trt.runtime.manifest import EngineDir, write_manifest
    from higgs_trt.runtime.outputs import output_engine_dir, remove_stale, staged_dir

    from .export import engine_limits, export_engine

    directory = output_engine_dir(out, inputs=(ckpt.dir,))  # new, empty or an engine directory: checked first
    remove_stale(directory)  # what a killed export or build of `out` left beside it
    check_request(ops, attention, target, lean)
    if target:
        trt_shim.check_target(target)  # before a long export
    else:
        datacenter_tensorrt()
    fingerprint, limits = ckpt.fingerprint(), engine_limits(ckpt.config, **limits)
    path = op_path(ops, attention)
    engine = _reusable(out, fingerprint, limits, precision, calibration, path)
    if engine is None:
        say(f"exporting {ckpt.dir} → {out}")
        export_engine(ckpt, out, limits["max_seq"], limits["max_batch"], limits["max_prompt"], say=say,
                      precision=precision, calibration=calibration, gate=gate, ops=path)
        engine = EngineDir(out)
    else:
        say(f"reusing the ONNX graphs in {out} (same checkpoint, limits, precision, ops and tool version)")
    manifest = engine.manifest
    # the plans go into a copy of the directory (hard links to its graphs and weights) that replaces it once the
    # build is done: a build killed or interrupted midway leaves `out` as it was, its old plans included
    with staged_dir(directory) as staging:
        _link_files(directory, staging, manifest["files"])
        sections = build_engines(staging, manifest, "lm_fp8" if precision == "fp8" else "lm", target, lean, say)
        manifest = {**manifest, **sections}
        files = [*manifest["files"], *(e["file"] for e in sections["engines"].values())]
        write_manifest(staging, manifest, files)
    return out


def _link_files(source: Path, staging: Path, names) -> None:
    """The engine directory's files into `staging`: hard links (no copy of the weights; every file we write there is
    written beside its name and renamed over it, so a link is never written through), a copy of the timing cache,
    which the build rewrites in place."""
    for name in names:
        try:
            os.link(source / name, staging / name)
        except OSError:  # a file system without hard links
            shutil.copy2(source / name, staging / name)
    if (source / TIMING_CACHE).is_file():
        shutil.copy2(source / TIMING_CACHE, staging / TIMING_CACHE)


def op_path(ops: str, attention: str = "fused"):
    """The exporter's ops object for `--ops native|plugin` and `--attention fused|matmul`."""
    check_request(ops, attention, None, False)
    if ops == "plugin":
        from higgs_trt.builder.plugin_ops import PluginOps

        return PluginOps
    from .ops import MatmulAttentionOps, NativeOps

    return MatmulAttentionOps if attention == "matmul" else NativeOps


def _reusable(out: Path, fingerprint: str, limits: dict, precision: str, calibration: Path | None, ops):
    """The existing engine directory at `out`, if its graphs are what this build would export."""
    from higgs_trt.runtime.jsonfile import read_json
    from higgs_trt.runtime.manifest import EngineDir, tool_version

    if not (out / "manifest.json").exists():
        return None
    try:
        engine = EngineDir(out)
    except HiggsError:
        return None  # damaged or stale: export again
    m = engine.manifest
    same = (m["checkpoint"]["fingerprint"] == fingerprint and m["limits"] == limits and m["precision"] == precision
            and m["ops"] == ops.name and m.get("attention") == ops.attention and m["tool_version"] == tool_version())
    if same and calibration is not None:
        try:
            wanted = read_json(calibration)
        except HiggsError:
            return None  # let the export report the unreadable file
        ours = m.get("calibration", {}).get("content_sha256")
        same = isinstance(wanted, dict) and wanted.get("content_sha256") == ours
    return engine if same else None


# ---- doctor --build-check: every lm variant as a one-layer plan, run against the ONNX Runtime twin -------------------

CHECK_OPS = (("native", "fused"), ("native", "matmul"), ("plugin", "fused"))
CHECK_AMAX = 16.0  # every GEMM input's FP8 range: the plan and its twin quantize alike, so any positive value checks
CHECK_TEXT = "One minute to learn what works."


def build_check(ckpt: Checkpoint, limits: dict, target: str | None, say) -> bool:
    """Build a one-layer lm plan of `ckpt` (its own dimensions and first layer's weights) for every op path,
    attention choice and precision; on the local GPU (no `target`) run a prefill and two decode steps of each
    against the graph's ONNX Runtime twin. One line per variant; returns whether all passed."""
    import tempfile

    from higgs_trt.runtime import extras

    from .export import FirstLayers, WeightsFile, engine_limits, export_lm_graphs

    if target:
        trt_shim.check_target(target)
    trt = trt_shim.load("rtx") if target else datacenter_tensorrt()
    limits = engine_limits(ckpt.config, **limits)
    model = FirstLayers(ckpt, 1)
    scales = {"activation_amax": {n.removesuffix(".weight"): CHECK_AMAX for n in _gemm_weights(model.config)}}
    say(f"build check: one decoder layer of {ckpt.dir}, TensorRT {trt.__version__}, "
        f"{'target ' + target + ' (built, not run)' if target else 'the local GPU'}; limits {limits}")
    passed = True
    with tempfile.TemporaryDirectory(prefix="higgs-build-check-") as tmp:
        for ops, attention in CHECK_OPS:
            directory = Path(tmp) / f"{ops}-{attention}"
            directory.mkdir()
            path = op_path(ops, attention)
            label = f"{ops} {attention if ops == 'native' else ''}".strip()
            try:
                weights = WeightsFile(directory / "weights.bin", model)
                try:
                    graphs = export_lm_graphs(model, weights, directory, limits["max_seq"], path, scales,
                                              say=lambda msg: None, twin=not target)
                finally:
                    weights.close()
                manifest = {"graphs": graphs}
                if ops == "plugin" and not target:
                    with extras.needed("gpu", "the plugin path's check (compiling its Triton kernels to PTX)"):
                        from .export import plugin_kernels
                    manifest["plugins"] = plugin_kernels(model, directory, say=lambda msg: None)
                registered = register_plugins(trt, directory, manifest, target) if ops == "plugin" else None
            except HiggsError as e:
                say(f"  {label}: cannot be checked here: {e}")
                passed = False
                continue
            for precision in ("bf16", "fp8"):
                key = "lm_fp8" if precision == "fp8" else "lm"
                twin = "lm_fp8_bf16ref" if precision == "fp8" else "lm_ref"
                try:
                    line, ok = _check_variant(trt, directory, graphs, key, twin, precision, ops, limits, target, model)
                except HiggsError as e:
                    line, ok = f"FAILED: {e}", False
                say(f"  {label} {precision}: {line}")
                passed = passed and ok
            del registered
    return passed


def _gemm_weights(cfg) -> list[str]:
    from higgs_trt.runtime.config import lm_tensor_shapes

    return [n for n in lm_tensor_shapes(cfg) if n.endswith("_proj.weight")]


def _check_variant(trt, directory: Path, graphs: dict, key: str, twin: str, precision: str, ops: str, limits: dict,
                   target: str | None, model) -> tuple[str, bool]:
    onnx_path = directory / graphs[key]["file"]
    if ops == "plugin":
        onnx_path = _without_plugin_functions(onnx_path)
    try:
        plan = build_plan(trt, onnx_path, profiles_for(graphs[key], lm_ranges(limits)), target, False, None,
                          layer_info=True)
    finally:
        if ops == "plugin":
            onnx_path.unlink()
    line, ok, info = f"built in {plan.seconds:.1f} s", True, plan.layer_info
    if target:
        line += f" for {target} (TensorRT-RTX plans do not run here)"
    else:
        ran, ok, info = _run_against_twin(trt, plan.data, graphs[key], directory / graphs[twin]["file"], precision,
                                          limits, model)
        line += f"; {ran}"
    if precision == "fp8" and info:
        line += ("; the text table stays FP8 (rows gathered from it)" if text_table_stays_fp8(info)
                 else "; the text table is dequantized whole: keep it bf16")
    return line, ok


def text_table_stays_fp8(layer_info: str) -> bool:
    """Whether the plan gathers the prompt's rows straight from the FP8 text-embedding table: a layer holds the
    table as an FP8 constant and no layer outputs a dequantized copy of it (a tensor of the table's dimensions)."""
    import re

    from higgs_trt.runtime.config import TEXT_EMBEDDING

    table = re.search(rf"Name: {re.escape(TEXT_EMBEDDING)}\.fp8[^}}]*?Dimensions: \[([\d,]+)\][^}}]*?Datatype: FP8",
                      layer_info)
    if table is None:
        return False
    outputs = [line.split("Outputs:", 1)[1] for line in layer_info.splitlines() if "Outputs:" in line]
    return not any(f"Dimensions: [{table.group(1)}]" in out for out in outputs)


def _run_against_twin(trt, plan: bytes, io: dict, twin: Path, precision: str, limits: dict,
                      model) -> tuple[str, bool, str]:
    """One prefill and two teacher-forced steps on the plan (the runtime's own lm driver) and on ONNX Runtime; also
    the plan's layer information (EngineInspector)."""
    import numpy as np
    import onnxruntime

    from higgs_trt.runtime.backends.trt import TrtLm
    from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt

    from .compare import TOLERANCES, output_stats, teacher_forced

    logger = trt_shim.make_logger(trt)
    loaded = trt.Runtime(logger).deserialize_cuda_engine(plan)
    if loaded is None:
        raise HiggsError(f"the plan does not load ({'; '.join(logger.errors) or 'unknown error'})")
    lm = TrtLm(loaded, io, ["prefill", "decode"], 1, limits["max_prompt"], cuda.Stream(), logger)
    session = onnxruntime.InferenceSession(str(twin), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def reference(feed):
        return dict(zip(names, session.run(None, feed)))

    caches = {t.name: np.zeros((1, *t.shape[1:]), np.float32) for t in session.get_inputs() if t.name.startswith("past_")}
    prompt = build_prompt(HiggsTokenizer(model.dir / "tokenizer.json", model.config.text_vocab_size), CHECK_TEXT)
    tolerance = TOLERANCES[f"trt-{precision}"]
    stats, agree, total = [], 0, 0
    for i, feed in enumerate(teacher_forced(reference, prompt, 2, limits["max_seq"], caches)):
        want = reference(feed)
        logits, codes = lm.run({k: v for k, v in feed.items() if not k.startswith("past_")}, slot=0 if i == 0 else None)
        stats.append(output_stats("logits", i, want["logits"], logits, *tolerance))
        agree, total = agree + int((codes == want["codes"]).sum()), total + codes.size
    ok = all(s.passed for s in stats)
    inspector = loaded.create_engine_inspector()
    info = inspector.get_engine_information(trt.LayerInformationFormat.ONELINE)
    return (f"prefill + 2 steps vs ONNX Runtime: max|Δ| logits {max(s.max_abs for s in stats):.3g}, min cosine "
            f"{min(s.cosine for s in stats):.5f}, codes {agree}/{total} agree: {'ok' if ok else 'FAILED'}"), ok, info
