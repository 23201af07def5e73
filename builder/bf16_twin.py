"""The FP8 engine graph (bf16 activations) as ONNX Runtime can run it with the engine's numbers.

ONNX Runtime's CPU kernels do not compute in bf16, so the FP8 graph's first twin (`lm.fp8.ref.onnx`) is exported in
fp32: the same quantization, but every activation, residual and cache value carries 24 bits where the engine keeps 8.
FP8 quantization turns those differences into whole FP8 steps wherever a value lies near a rounding boundary, so
that twin drifts from the engine about as much as two copies of the engine that differ in one bf16 rounding of one
op. This twin is the bf16 graph itself, computed in fp32 with every
bf16 value rounded to bf16 where the graph produces it (a Cast to bf16 and back), so ONNX Runtime makes the engine's
bf16 numbers up to the order of fp32 sums:

- bf16 initializers (norm weights, the audio table, scales) are read through a Cast to fp32: no copies;
- every op output the graph types bf16 is rounded, except DequantizeLinear's (an engine fuses a DQ into its consumer:
  the GEMM's operand, or the rows a Gather takes from the FP8 text table, which are rounded as the Gather's output)
  and ops that only move or select values already rounded;
- inputs and outputs are fp32, as the fp32 twin's are (the caches hold bf16 values in fp32).
"""

import onnx_ir as ir

BF16, F32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
MOVES_ROUNDED_VALUES = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Concat", "Where", "TensorScatter", "GatherND",
                        "Slice", "Identity", "Expand"}


def round_trip(value: ir.Value) -> list[ir.Node]:
    """Cast nodes that round `value` (fp32) to bf16 and back."""
    down = ir.node("Cast", [value], attributes={"to": BF16})
    up = ir.node("Cast", [down.outputs[0]], attributes={"to": F32})
    down.outputs[0].dtype, up.outputs[0].dtype = BF16, F32
    down.outputs[0].shape = up.outputs[0].shape = value.shape
    return [down, up]


def _reroute(graph: ir.Graph, value: ir.Value, to: ir.Value, skip: ir.Node) -> None:
    """Every reader of `value` but `skip` reads `to`; a graph output named `value` becomes `to` under that name."""
    for user, index in list(value.uses()):
        if user is not skip:
            user.replace_input_with(index, to)
    if value in graph.outputs:
        name = value.name
        value.name = f"{name}.unrounded"
        to.name = name
        graph.outputs[list(graph.outputs).index(value)] = to


def bf16_rounding_twin(model: ir.Model) -> ir.Model:
    """Rewrite the bf16 graph `model` in place into its bf16-rounding fp32 twin; returns it."""
    graph = model.graph
    for value in list(graph.initializers.values()):
        if value.dtype == BF16:
            cast = ir.node("Cast", [value], attributes={"to": F32})
            cast.outputs[0].dtype, cast.outputs[0].shape = F32, value.shape
            graph.insert_before(graph.node(0), cast)
            _reroute(graph, value, cast.outputs[0], skip=cast)
    for value in graph.inputs:
        if value.dtype == BF16:
            value.type = ir.TensorType(F32)
    for node in list(graph):
        if node.op_type == "Cast" and node.attributes["to"].as_int() == BF16:
            node.attributes["to"] = ir.AttrInt64("to", F32)
        for value in node.outputs:
            if value.dtype != BF16:
                continue
            value.type = ir.TensorType(F32)  # not .dtype: a type object may be shared (an initializer's stays bf16)
            if node.op_type in MOVES_ROUNDED_VALUES:
                continue
            rounding = round_trip(value)
            graph.insert_after(node, rounding)
            _reroute(graph, value, rounding[1].outputs[0], skip=rounding[0])
    return model
