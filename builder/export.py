"""Checkpoint → ONNX graphs in an engine directory.

Graphs (dynamo exporter, opset 24):
  lm.onnx       bf16, for TensorRT: prefill (S = prompt) and decode step (S = 1) are one graph, so one engine
                with two optimization profiles holds the weights once
  lm.ref.onnx   fp32 reference twin for ONNX Runtime (fp32 math on the same bf16 weights)
  lm.fp8.onnx, lm.fp8.ref.onnx   with --precision fp8: the same two with FP8 Q/DQ GEMMs (calibration/qdq.py)
  lm.fp8.bf16ref.onnx  lm.fp8.onnx for ONNX Runtime with its bf16 roundings kept (builder/bf16_twin.py)
  codec.onnx    fp32 codec decoder, codes [B,8,T] → waveform [B,1,960·T]
  codec_encoder.onnx  fp32 codec encoder (voice cloning), audio_24k [1,1,N] + audio_16k [1,1,M] → codes [1,8,T];
                its length arithmetic (`geometry`) goes into the manifest; absent when the checkpoint has no encoder
All weights live once in `weights.bin`, copied straight from the checkpoint's bytes; every graph points
into it (ONNX external data), so the twin costs no second copy and export never holds the weights twice.
"""

import contextlib
import dataclasses
import io
import logging
import shutil
import time
import warnings
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxscript
import torch

from higgs_trt.calibration.qdq import insert_qdq
from higgs_trt.runtime.config import lm_tensor_shapes
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.generate import NO_END
from higgs_trt.runtime.gpu.codec import PREFIX as CODEC_PREFIX
from higgs_trt.runtime.gpu.codec import CodecDecoder, CodecDims
from higgs_trt.runtime.manifest import write_manifest
from higgs_trt.runtime.options import cache_length, prompt_length, within
from higgs_trt.runtime.outputs import output_engine_dir, staged_dir
from higgs_trt.runtime.streaming import receptive_field

from .bf16_twin import bf16_rounding_twin
from .checkpoint import Checkpoint
from .codec_encoder import CodecEncoder, has_encoder
from .model import HiggsLM
from .ops import ONNX_OPSET, ONNX_TRANSLATIONS, NativeOps
from .torch_backend import bf16_reference

WEIGHTS = "weights.bin"
LM_STEP_INPUTS = ("input_ids", "audio_codes", "is_audio", "write_pos", "new_len", "row_index", "end_frame")
# Folding a constant bigger than this would copy a weight (e.g. a bf16→fp32 cast in the twin) and lose its name.
FOLD_LIMIT = 8
ALIGN = 64
MAX_BATCH = 1024


def cache_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value")]
    return past, [n.replace("past_", "present_") for n in past]


@contextlib.contextmanager
def _quiet():
    """The exporter reports every stage on stdout and warns about unrelated packages; keep our output ours."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _export(module, args, input_names, output_names, dynamic_shapes, translations=ONNX_TRANSLATIONS) -> ir.Model:
    with _quiet():
        program = torch.onnx.export(module, args, dynamo=True, opset_version=ONNX_OPSET, optimize=False,
                                    input_names=input_names, output_names=output_names,
                                    dynamic_shapes=dynamic_shapes, custom_translation_table=translations)
        model = program.model
        onnxscript.optimizer.optimize(model, input_size_limit=FOLD_LIMIT, output_size_limit=FOLD_LIMIT)
    return model


def attach_plugin_functions(model: ir.Model) -> None:
    """Give the plugin nodes their reference bodies (model-local functions), so ONNX Runtime runs the file, and
    their outputs the types the exporter cannot infer for a custom op."""
    from higgs_trt.plugins import schemas

    model.opset_imports[schemas.DOMAIN] = schemas.VERSION
    for proto in schemas.functions():
        function = ir.serde.deserialize_function(proto)
        model.functions[function.identifier()] = function
    for node in model.graph:
        if node.domain != schemas.DOMAIN:
            continue
        if node.op_type == "rope_kv_write":  # q_out like q; the caches like their inputs
            dtypes = [node.inputs[0].dtype, node.inputs[6].dtype, node.inputs[7].dtype]
        elif node.op_type == "decode_attention":  # like q
            dtypes = [node.inputs[0].dtype]
        else:  # codes int32; the embedding like the table
            dtypes = [ir.DataType.INT32, node.inputs[3].dtype]
        for value, dtype in zip(node.outputs, dtypes):
            value.type = ir.TensorType(dtype)  # a type of its own: a type object shared with the input changes with it


def export_lm(model: HiggsLM) -> ir.Model:
    b, s = 2, 3  # example sizes > 1 so the exporter keeps them symbolic
    n = model.cfg.num_codebooks
    args = (torch.zeros(b, s, dtype=torch.int32), torch.zeros(b, s, n, dtype=torch.int32),
            torch.zeros(b, s, dtype=torch.bool), torch.zeros(b, dtype=torch.int64), torch.full((b,), s),
            torch.zeros(b, dtype=torch.int64), torch.full((b,), int(NO_END)), model.new_caches(b))
    batch, seq = {0: "batch"}, {0: "batch", 1: "seq"}
    dynamic = {"input_ids": seq, "audio_codes": seq, "is_audio": seq, "write_pos": batch, "new_len": batch,
               "row_index": batch, "end_frame": batch, "caches": tuple(batch for _ in args[-1])}
    past, present = cache_names(model.cfg.num_layers)
    onnx_model = _export(model, args, [*LM_STEP_INPUTS, *past], ["logits", "codes", *present], dynamic,
                         model.ops.translations)
    if model.ops.name == "plugin":
        attach_plugin_functions(onnx_model)
    return onnx_model


def export_codec(codec: CodecDecoder) -> ir.Model:
    codes = torch.zeros(2, codec.dims.num_quantizers, 5, dtype=torch.int32)
    return _export(codec, (codes,), ["codes"], ["audio"], {"codes": {0: "batch", 2: "frames"}})


def export_codec_encoder(encoder: CodecEncoder) -> ir.Model:
    """Batch 1: references are encoded one at a time (clips of different lengths cannot share a batch unmasked)."""
    frames = 6
    audio_24k, audio_16k = torch.zeros(1, 1, encoder.dims.hop * frames), torch.zeros(1, 1, encoder.dims.hop * frames * 2 // 3)
    model = _export(encoder, (audio_24k, audio_16k), ["audio_24k", "audio_16k"], ["codes"],
                    {"audio_24k": {2: "samples_24k"}, "audio_16k": {2: "samples_16k"}})
    model.graph.outputs[0].shape = ir.Shape([1, encoder.dims.num_quantizers, "frames"])  # not the exporter's formula
    return model


class WeightsFile:
    """The engine directory's one external-data file: each initializer stored once, shared by every graph.

    Checkpoint tensors are copied byte for byte from the checkpoint (plain reads, nothing kept in memory);
    a checkpoint tensor the exporter turned into fp32 (the twin) is put back as the bf16 original + a Cast.
    """

    def __init__(self, path: Path, ckpt: Checkpoint):
        self.path, self.ckpt = path, ckpt
        self.file = open(path, "wb")
        self.placed: dict[str, tuple[int, int]] = {}
        self.index: dict[str, dict] = {}  # checkpoint name → where its values are (the manifest's weights index)

    def close(self) -> None:
        self.file.close()

    def flush(self) -> None:
        """Make everything written so far readable through the graphs' external references."""
        self.file.flush()

    def shared(self, key: str, dtype: ir.DataType, shape: ir.Shape, data: bytes) -> ir.ExternalTensor:
        """A tensor that several graphs reference, stored once under `key`."""
        if key not in self.placed:
            self.placed[key] = self._append(data)
        return self._external(key, dtype, shape, self.placed[key])

    def _append(self, data: bytes) -> tuple[int, int]:
        self.file.write(b"\0" * (-self.file.tell() % ALIGN))
        offset = self.file.tell()
        self.file.write(data)
        return offset, len(data)

    def _checkpoint_tensor(self, name: str) -> tuple[int, int]:
        if name not in self.placed:
            if self.ckpt.dtype(name) == "BF16":
                data = self.ckpt.raw_bytes(name)
            else:
                data = self.ckpt.tensor(name).to(torch.bfloat16).view(torch.uint16).numpy().tobytes()
            self.placed[name] = self._append(data)
        return self.placed[name]

    def _external(self, name: str, dtype: ir.DataType, shape: ir.Shape, where: tuple[int, int]) -> ir.ExternalTensor:
        return ir.ExternalTensor(self.path.name, *where, dtype, shape=shape, name=name, base_dir=self.path.parent)

    def place(self, model: ir.Model, checkpoint_names: bool, index_prefix: str | None = None) -> None:
        """Move the graph's initializers into the file; with `checkpoint_names`, those named like a checkpoint
        tensor are that tensor (stored once, as bf16). With `index_prefix`, initializers whose name with the prefix
        is a checkpoint tensor are stored as they are (the codec's fp32) and indexed under that name."""
        graph = model.graph
        for name, value in list(graph.initializers.items()):
            tensor = value.const_value
            if checkpoint_names and name in self.ckpt:
                where = self._checkpoint_tensor(name)
                self._record(name, where, ir.DataType.BFLOAT16, tensor.shape)
                external = self._external(name, ir.DataType.BFLOAT16, tensor.shape, where)
                if tensor.dtype == ir.DataType.BFLOAT16:
                    value.const_value = external
                else:
                    self._replace_with_bf16_cast(graph, value, external)
            elif index_prefix and index_prefix + name in self.ckpt or tensor.nbytes >= ALIGN:
                where = self._append(tensor.tobytes())
                if index_prefix and index_prefix + name in self.ckpt:
                    self._record(index_prefix + name, where, tensor.dtype, tensor.shape)
                value.const_value = self._external(name, tensor.dtype, tensor.shape, where)

    def _record(self, name: str, where: tuple[int, int], dtype: ir.DataType, shape: ir.Shape) -> None:
        self.index[name] = {"offset": where[0], "bytes": where[1], "dtype": dtype.numpy().name,
                            "shape": [int(d) for d in shape]}

    @staticmethod
    def _replace_with_bf16_cast(graph: ir.Graph, value: ir.Value, bf16: ir.ExternalTensor) -> None:
        graph.initializers.pop(value.name)
        source = ir.Value(name=value.name, shape=bf16.shape, type=ir.TensorType(ir.DataType.BFLOAT16), const_value=bf16)
        graph.register_initializer(source)
        cast = ir.node("Cast", [source], {"to": ir.DataType.FLOAT})
        cast.outputs[0].name = f"{value.name}.fp32"
        cast.outputs[0].shape, cast.outputs[0].type = bf16.shape, ir.TensorType(ir.DataType.FLOAT)
        value.replace_all_uses_with(cast.outputs[0])
        graph.insert_before(graph.node(0), cast)


def graph_io(model: ir.Model) -> dict:
    def describe(v: ir.Value) -> dict:
        return {"name": v.name, "dtype": v.dtype.numpy().name, "shape": [d if isinstance(d, int) else str(d) for d in v.shape]}

    return {"inputs": [describe(v) for v in model.graph.inputs], "outputs": [describe(v) for v in model.graph.outputs]}


def _check_weights_kept(model: ir.Model, expected: list[str]) -> None:
    names = set(model.graph.initializers)
    lost = [n for n in expected if n not in names]
    if lost:
        raise RuntimeError(f"export folded checkpoint tensors away (would copy weights): {lost[:5]}")


def engine_limits(config, max_seq: int | None, max_batch: int, max_prompt: int | None) -> dict:
    """The manifest's limits, checked; max_seq defaults to 2048 or the model's positions if fewer, max_prompt to 512
    or half of max_seq if less."""
    max_seq = cache_length(max_seq, config.max_position_embeddings)
    max_prompt = prompt_length(max_seq) if max_prompt is None else max_prompt
    if not 1 <= max_prompt < max_seq:
        raise HiggsError(f"--max-prompt must lie in 1..{max_seq - 1} (below --max-seq, {max_seq}), got {max_prompt}")
    within("--max-batch", max_batch, 1, MAX_BATCH)
    return {"max_seq": max_seq, "max_batch": max_batch, "max_prompt": max_prompt}


def export_engine(ckpt: Checkpoint, out: Path, max_seq: int | None = None, max_batch: int = 8,
                  max_prompt: int | None = None,
                  ops=NativeOps, say=print, precision: str = "bf16", calibration: Path | None = None,
                  gate: tuple[float, float] | None = None) -> Path:
    """Export every graph of an engine directory at `out` (built in a staging directory beside it, then swapped in
    whole; `out` may be new, empty or an engine directory: runtime/outputs.py).

    Limits left None take their defaults (engine_limits).
    precision fp8 adds the FP8 Q/DQ graphs, with scales from `calibration` (a file from `higgs-trt calibrate`)
    or computed now from the built-in prompt set, and runs the accuracy gate (cosine, top-1 floors) on them.
    """
    from higgs_trt.calibration.calibrate import calibrate, load_calibration, write_calibration
    from higgs_trt.calibration.gate import DEFAULT_COSINE, DEFAULT_TOP1, run_gate
    from higgs_trt.runtime.manifest import EngineDir
    from higgs_trt.runtime.prompt import HiggsTokenizer

    checkpoint_dir, out = ckpt.dir, Path(out)
    target = output_engine_dir(out, inputs=(checkpoint_dir,))  # symlinks followed: the directory a link names
    limits = engine_limits(ckpt.config, max_seq, max_batch, max_prompt)
    max_seq = limits["max_seq"]
    tokenizer = checkpoint_dir / "tokenizer.json"
    if not tokenizer.exists():
        raise HiggsError(f"{checkpoint_dir}: tokenizer.json not found")
    HiggsTokenizer(tokenizer, ckpt.config.text_vocab_size)  # its special tokens and ids, now rather than at run time
    fingerprint = ckpt.fingerprint()
    codec_dims = CodecDims.from_checkpoint(ckpt)
    scales = reference = None
    if precision == "fp8":
        reference = bf16_reference(ckpt)  # calibration and the gate observe the same one
        if calibration:
            scales = load_calibration(calibration, fingerprint)
        else:
            say("  calibrating FP8 scales on the built-in prompt set (BF16 torch reference)…")
            scales = calibrate(reference)
    with staged_dir(target) as staging:
        graphs, weights_index = _export_graphs(ckpt, staging, max_seq, ops, say, scales)
        shutil.copy(tokenizer, staging / "tokenizer.json")
        files = [*(g["file"] for g in graphs.values()), WEIGHTS, "tokenizer.json"]
        plugins = plugin_kernels(ckpt, staging, say) if ops.name == "plugin" else None
        files += [p["file"] for p in (plugins or {}).values()]
        manifest = {
            "checkpoint": {"fingerprint": fingerprint, "source": str(checkpoint_dir.resolve())},
            "model": ckpt.config.to_dict(),
            "precision": precision,
            "ops": ops.name,
            "attention": ops.attention,
            "limits": limits,
            "codec": {"strides": list(codec_dims.strides), "receptive_field": list(receptive_field(codec_dims.strides))},
            "graphs": graphs,
            "weights": {"file": WEIGHTS, "tensors": weights_index},
        }
        if plugins:
            manifest["plugins"] = plugins
        if scales:
            write_calibration(scales, staging / "calibration.json")
            files.append("calibration.json")
            manifest["calibration"] = {"file": "calibration.json", "content_sha256": scales["content_sha256"]}
        write_manifest(staging, manifest, files)
        if scales:
            cosine, top1 = gate or (DEFAULT_COSINE, DEFAULT_TOP1)
            manifest["fp8_gate"] = run_gate(EngineDir(staging), reference, scales, cosine, top1, say)
            write_manifest(staging, manifest, files)
    return out


def plugin_kernels(ckpt: Checkpoint, staging: Path, say) -> dict:
    """PTX of the plugin kernels for this model's dimensions, written beside the graphs (TensorRT embeds it)."""
    from higgs_trt.runtime import extras

    with extras.needed("gpu", "--ops plugin (compiling its Triton kernels to PTX)"):
        from higgs_trt.plugins.aot import OPS, compile_kernel, constants_for
    cfg, plugins = ckpt.config, {}
    for op in OPS:
        kernel = compile_kernel(op, constants_for(op, cfg.head_dim, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                                  cfg.codebook_vocab, cfg.num_codebooks))
        (staging / f"{op}.ptx").write_text(kernel.ptx)
        plugins[op] = {"file": f"{op}.ptx", "namespace": "higgs", "version": "1", "entry": kernel.entry,
                       "threads": kernel.threads, "shared": kernel.shared, "constants": kernel.constants,
                       "target": kernel.target, "ptx_version": kernel.ptx_version, "ptx_sha256": kernel.sha256}
        say(f"  {op}.ptx: {len(kernel.ptx)} bytes, {kernel.target}, PTX ISA {kernel.ptx_version} "
            f"(sha256 {kernel.sha256[:12]}…)")
    return plugins


LM_GRAPHS = (("lm", "lm.onnx", torch.bfloat16), ("lm_ref", "lm.ref.onnx", torch.float32))


def _save(directory: Path, file: str, model: ir.Model, dtype: str, t0: float, say) -> dict:
    ir.save(model, directory / file)
    say(f"  {file}: {len(model.graph)} nodes ({time.perf_counter() - t0:.1f} s)")
    return {"file": file, "dtype": dtype, **graph_io(model)}


def export_lm_graphs(ckpt: Checkpoint, weights: WeightsFile, directory: Path, max_seq: int, ops=NativeOps,
                     scales: dict | None = None, say=print, twin: bool = True) -> dict:
    """The lm graphs into `directory`, their weights through `weights`: lm.onnx (bf16, for TensorRT) and, with
    `twin`, lm.ref.onnx (fp32, for ONNX Runtime); with FP8 `scales` each again with FP8 GEMMs (lm.fp8.onnx,
    lm.fp8.ref.onnx) and lm.fp8.onnx as ONNX Runtime runs it with the engine's bf16 roundings
    (lm.fp8.bf16ref.onnx). Returns their manifest entries by graph key."""
    graphs = {}
    lm_names = list(lm_tensor_shapes(ckpt.config))
    for key, file, dtype in LM_GRAPHS if twin else LM_GRAPHS[:1]:
        t0 = time.perf_counter()
        model = export_lm(HiggsLM.from_checkpoint(ckpt, max_seq, dtype, ops))
        _check_weights_kept(model, lm_names)
        weights.place(model, checkpoint_names=True)
        name = str(dtype).removeprefix("torch.")
        graphs[key] = _save(directory, file, model, name, t0, say)
        if scales:  # the same graph, FP8 GEMMs (in place: this graph is saved already)
            t0 = time.perf_counter()
            weights.flush()
            insert_qdq(model, scales["activation_amax"], weights)
            graphs[key.replace("lm", "lm_fp8")] = _save(directory, file.replace("lm.", "lm.fp8."), model, name, t0, say)
            if key == "lm":
                t0 = time.perf_counter()
                graphs["lm_fp8_bf16ref"] = _save(directory, "lm.fp8.bf16ref.onnx", bf16_rounding_twin(model),
                                                 "float32", t0, say)
    return graphs


def _export_graphs(ckpt: Checkpoint, staging: Path, max_seq: int, ops, say, scales: dict | None) -> tuple[dict, dict]:
    """Every graph into `staging`; returns the graphs' manifest entries and the weights index (checkpoint name →
    offset, bytes, dtype, shape in weights.bin)."""
    weights = WeightsFile(staging / WEIGHTS, ckpt)
    try:
        graphs = export_lm_graphs(ckpt, weights, staging, max_seq, ops, scales, say)
        t0 = time.perf_counter()
        model = export_codec(CodecDecoder.from_checkpoint(ckpt))
        weights.place(model, checkpoint_names=False, index_prefix=CODEC_PREFIX)
        graphs["codec"] = _save(staging, "codec.onnx", model, "float32", t0, say)
        if has_encoder(ckpt):
            t0 = time.perf_counter()
            encoder = CodecEncoder.from_checkpoint(ckpt)
            model = export_codec_encoder(encoder)
            weights.place(model, checkpoint_names=False, index_prefix=CODEC_PREFIX)
            graphs["codec_encoder"] = _save(staging, "codec_encoder.onnx", model, "float32", t0, say)
            graphs["codec_encoder"]["geometry"] = encoder.dims.geometry()
        else:
            say("  no codec encoder tensors in the checkpoint: no codec_encoder.onnx (voice cloning from codes only)")
    finally:
        weights.close()
    for g in graphs.values():
        onnx.checker.check_model(str(staging / g["file"]), full_check=True)
    return graphs, weights.index


class FirstLayers:
    """A checkpoint seen with only its first `layers` decoder layers: a model that builds in seconds with the
    checkpoint's own dimensions and weights (doctor --build-check)."""

    def __init__(self, ckpt: Checkpoint, layers: int):
        self._ckpt = ckpt
        self.config = dataclasses.replace(ckpt.config, num_layers=min(layers, ckpt.config.num_layers))

    def __getattr__(self, name):
        return getattr(self._ckpt, name)

    def __contains__(self, name: str) -> bool:
        return name in self._ckpt
