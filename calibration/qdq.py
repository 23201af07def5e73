"""FP8 Q/DQ graphs: the exported lm graph with every decoder GEMM made an FP8 GEMM.

Per GEMM `y = x Wᵀ` (ONNX Gemm, transB=1, W = a checkpoint tensor [N, K]):
  x → QuantizeLinear(per-tensor scale = amax/448) → DequantizeLinear → Gemm
  W → FP8 E4M3 initializer (per output channel scale = row amax/448) → DequantizeLinear(axis=0) → Gemm
q/k/v (and gate/up) read the same tensor and share one activation Q/DQ. The text-embedding table is stored in FP8
too (per-row scales, DequantizeLinear before its Gather, which TensorRT fuses keeping the table in FP8): it is a
tenth of the model's bytes and only feeds the prompt. Norms, RoPE, attention, the KV cache and the audio table
(input embedding and head) stay bf16. Scales are rounded to bf16 once, so the bf16 graph (for TensorRT) and its
fp32 twin (for ONNX Runtime) quantize with identical scales. FP8 tensors are stored once in the engine's
weights.bin and shared by both graphs.
"""

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.passes.common import RemoveUnusedNodesPass

from higgs_trt.plugins.fp8 import bf16_scale, quantize_weight
from higgs_trt.runtime.config import TEXT_EMBEDDING


def _source_weight(graph: ir.Graph, value: ir.Value) -> ir.Value:
    """The checkpoint initializer behind a Gemm's B input (the twin reaches it through a Cast to fp32)."""
    node = value.producer()
    if node is not None and node.op_type == "Cast":
        value = node.inputs[0]
    return value if value.name in graph.initializers else None


def insert_qdq(model: ir.Model, amax: dict[str, float], weights) -> int:
    """Rewrite `model` in place; FP8 weights go through `weights.shared(key, bytes)`. Returns GEMMs quantized."""
    graph = model.graph
    activations: dict[ir.Value, ir.Value] = {}
    quantized = 0
    compute = ir.DataType.FLOAT  # bf16 for the TensorRT graph, fp32 for the twin: read off the GEMM inputs
    for gemm in [n for n in graph if n.op_type == "Gemm"]:
        source = _source_weight(graph, gemm.inputs[1])
        site = source.name.removesuffix(".weight") if source is not None else None
        if site not in amax:
            continue
        x = gemm.inputs[0]
        dtype = compute = x.dtype
        if x not in activations:
            activations[x] = _qdq_activation(graph, gemm, x, amax[site], dtype)
        gemm.replace_input_with(0, activations[x])
        gemm.replace_input_with(1, _dq_weight(graph, gemm, source, weights, dtype))
        quantized += 1
    for gather in [n for n in graph if n.op_type == "Gather" and n.inputs[0].name == TEXT_EMBEDDING]:
        table = graph.initializers[TEXT_EMBEDDING]
        # in the twin the table dequantizes to fp32 (the Cast to fp32 after the Gather becomes a no-op)
        gather.replace_input_with(0, _dq_weight(graph, gather, table, weights, compute))
        gather.outputs[0].type = ir.TensorType(compute)
    RemoveUnusedNodesPass()(model)  # the bf16 weights (and the twin's casts) this graph no longer reads
    return quantized


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _scale_tensor(scale: torch.Tensor, dtype: ir.DataType, name: str) -> ir.TensorProtocol:
    return ir.tensor(scale.to(torch.bfloat16 if dtype == ir.DataType.BFLOAT16 else torch.float32), name=name)


def _qdq_activation(graph, before: ir.Node, x: ir.Value, amax: float, dtype: ir.DataType) -> ir.Value:
    base = x.name
    scale = _initializer(graph, f"{base}.act_scale", _scale_tensor(bf16_scale(amax), dtype, f"{base}.act_scale"))
    zero = _initializer(graph, f"{base}.act_zero", ir.tensor(torch.zeros((), dtype=torch.float8_e4m3fn), name=f"{base}.act_zero"))
    q = ir.node("QuantizeLinear", [x, scale, zero], {"saturate": 1}, name=f"{base}.quantize")
    dq = ir.node("DequantizeLinear", [q.outputs[0], scale, zero], name=f"{base}.dequantize")
    q.outputs[0].name, dq.outputs[0].name = f"{base}.fp8", f"{base}.dq"
    graph.insert_before(before, [q, dq])
    return dq.outputs[0]


def _dq_weight(graph, before: ir.Node, source: ir.Value, weights, dtype: ir.DataType) -> ir.Value:
    name = source.name
    w8, scale = quantize_weight(torch.from_numpy(np.asarray(source.const_value.numpy(), dtype=np.float32)))
    raw = w8.view(torch.uint8).numpy().tobytes()
    fp8 = weights.shared(f"{name}.fp8", ir.DataType.FLOAT8E4M3FN, ir.Shape(w8.shape), raw)
    value = graph.initializers.get(f"{name}.fp8") or _initializer(graph, f"{name}.fp8", fp8)
    scale_value = _initializer(graph, f"{name}.scale", _scale_tensor(scale, dtype, f"{name}.scale"))
    dq = ir.node("DequantizeLinear", [value, scale_value], {"axis": 0}, name=f"{name}.dequantize")
    dq.outputs[0].name = f"{name}.dq"
    graph.insert_before(before, dq)
    return dq.outputs[0]
