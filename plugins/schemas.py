"""ONNX side of the custom ops (rope_kv_write, delayed_codebook_step, decode_attention): op schemas (so onnx.checker and the exporter accept the nodes) and model-local
functions with their exact semantics in standard ops (so ONNX Runtime runs the plugin-path graph unchanged).

A node is `op_type` = TensorRT plugin name, `domain` = `plugin_namespace` = "higgs", `plugin_version` "1", and
`aot` = 1 (TensorRT's QDP picks the ahead-of-time implementation: PTX in the engine, no Python at run time).
For TensorRT the functions are stripped (`strip_functions`), so the parser has no choice but the plugin.
"""

import onnx
from onnx import TensorProto, helper
from onnx.defs import OpSchema

DOMAIN = "higgs"
VERSION = 1
OPSET = 24  # the function bodies use RotaryEmbedding-23 and TensorScatter-24
PLUGIN_ATTRIBUTES = {"plugin_namespace": DOMAIN, "plugin_version": "1", "aot": 1}
OPS = {  # name → (inputs, outputs)
    "rope_kv_write": (["q", "k", "v", "cos", "sin", "write_pos", "k_cache", "v_cache"],
                      ["q_out", "k_cache_out", "v_cache_out"]),
    "delayed_codebook_step": (["logits", "row_index", "end_frame", "table"], ["codes", "embedding"]),
    "decode_attention": (["q", "k_cache", "v_cache", "write_pos"], ["out"]),
}


def register() -> None:
    """Register both op schemas with onnx (once per process)."""
    for name, (inputs, outputs) in OPS.items():
        if onnx.defs.has(name, DOMAIN):
            continue
        schema = OpSchema(
            name, DOMAIN, VERSION, doc=f"TensorRT plugin {DOMAIN}::{name} (see plugins/)",
            inputs=[OpSchema.FormalParameter(n, f"T{i}") for i, n in enumerate(inputs)],
            outputs=[OpSchema.FormalParameter(n, f"U{i}") for i, n in enumerate(outputs)],
            type_constraints=[(f"T{i}", list(_ALL_TYPES), "") for i in range(len(inputs))]
            + [(f"U{i}", list(_ALL_TYPES), "") for i in range(len(outputs))],
            attributes=[OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "plugin namespace"),
                        OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "plugin version"),
                        OpSchema.Attribute("aot", OpSchema.AttrType.INT, "1: ahead-of-time implementation")],
        )
        onnx.defs.register_schema(schema)


_ALL_TYPES = ("tensor(float)", "tensor(bfloat16)", "tensor(float16)", "tensor(int32)", "tensor(int64)", "tensor(bool)")


def opset():
    """The onnxscript opset of the custom domain, for the exporter's translations."""
    from onnxscript.values import Opset

    register()
    return Opset(DOMAIN, VERSION)


def _const(name: str, value, dtype=TensorProto.INT64) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, [], [value]))


def functions() -> list[onnx.FunctionProto]:
    """Reference bodies: the native path's ops, node for node."""
    rope = helper.make_function(
        DOMAIN, "rope_kv_write", OPS["rope_kv_write"][0], OPS["rope_kv_write"][1],
        [
            helper.make_node("Shape", ["q"], ["seq"], start=2, end=3),
            helper.make_node("Squeeze", ["seq"], ["n"]),
            _const("zero", 0), _const("one", 1), helper.make_node("Constant", [], ["ax0"], value_ints=[0]),
            helper.make_node("Constant", [], ["ax1"], value_ints=[1]),
            helper.make_node("Range", ["zero", "n", "one"], ["steps"]),
            helper.make_node("Unsqueeze", ["write_pos", "ax1"], ["start"]),
            helper.make_node("Unsqueeze", ["steps", "ax0"], ["offsets"]),
            helper.make_node("Add", ["start", "offsets"], ["positions"]),
            helper.make_node("RotaryEmbedding", ["q", "cos", "sin", "positions"], ["q_out"]),
            helper.make_node("RotaryEmbedding", ["k", "cos", "sin", "positions"], ["k_rot"]),
            helper.make_node("TensorScatter", ["k_cache", "k_rot", "write_pos"], ["k_cache_out"], axis=-2),
            helper.make_node("TensorScatter", ["v_cache", "v", "write_pos"], ["v_cache_out"], axis=-2),
        ],
        [helper.make_opsetid("", OPSET)], attributes=list(PLUGIN_ATTRIBUTES),
    )
    step = helper.make_function(
        DOMAIN, "delayed_codebook_step", OPS["delayed_codebook_step"][0], OPS["delayed_codebook_step"][1],
        [
            helper.make_node("ArgMax", ["logits"], ["best"], axis=-1, keepdims=0),
            helper.make_node("Shape", ["logits"], ["books"], start=1, end=2),
            helper.make_node("Shape", ["logits"], ["vocab"], start=2, end=3),
            helper.make_node("Squeeze", ["books"], ["k"]),
            _const("zero", 0), _const("one", 1), _const("boc", 1024), _const("eoc", 1025),
            helper.make_node("Constant", [], ["ax1"], value_ints=[1]),
            helper.make_node("Range", ["zero", "k", "one"], ["codebook"]),
            helper.make_node("Unsqueeze", ["row_index", "ax1"], ["row"]),
            helper.make_node("Unsqueeze", ["end_frame", "ax1"], ["end"]),
            helper.make_node("Less", ["row", "codebook"], ["ramp_up"]),
            helper.make_node("Where", ["ramp_up", "boc", "best"], ["masked"]),
            helper.make_node("Sub", ["row", "codebook"], ["frame"]),
            helper.make_node("GreaterOrEqual", ["frame", "end"], ["ended"]),
            helper.make_node("Where", ["ended", "eoc", "masked"], ["chosen"]),
            helper.make_node("Cast", ["chosen"], ["codes"], to=TensorProto.INT32),
            helper.make_node("Mul", ["codebook", "vocab"], ["offsets"]),
            helper.make_node("Add", ["chosen", "offsets"], ["rows"]),
            helper.make_node("Gather", ["table", "rows"], ["gathered"]),
            helper.make_node("Cast", ["gathered"], ["gathered32"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["gathered32", "ax1"], ["summed"], keepdims=0),
            helper.make_node("CastLike", ["summed", "table"], ["embedding"]),
        ],
        [helper.make_opsetid("", OPSET)], attributes=list(PLUGIN_ATTRIBUTES),
    )
    attention = helper.make_function(
        DOMAIN, "decode_attention", OPS["decode_attention"][0], OPS["decode_attention"][1],
        [
            helper.make_node("Shape", ["q"], ["seq"], start=2, end=3),
            helper.make_node("Shape", ["k_cache"], ["cache_len"], start=2, end=3),
            helper.make_node("Squeeze", ["seq"], ["n"]),
            helper.make_node("Squeeze", ["cache_len"], ["m"]),
            _const("zero", 0), _const("one", 1),
            helper.make_node("Constant", [], ["ax0"], value_ints=[0]),
            helper.make_node("Constant", [], ["ax1"], value_ints=[1]),
            helper.make_node("Constant", [], ["ax13"], value_ints=[1, 3]),
            helper.make_node("Constant", [], ["key_shape"], value_ints=[1, 1, 1, -1]),
            helper.make_node("Range", ["zero", "n", "one"], ["steps"]),
            helper.make_node("Range", ["zero", "m", "one"], ["keys"]),
            helper.make_node("Unsqueeze", ["write_pos", "ax1"], ["start"]),
            helper.make_node("Unsqueeze", ["steps", "ax0"], ["offsets"]),
            helper.make_node("Add", ["start", "offsets"], ["positions"]),
            helper.make_node("Unsqueeze", ["positions", "ax13"], ["query_pos"]),
            helper.make_node("Reshape", ["keys", "key_shape"], ["key_pos"]),
            helper.make_node("LessOrEqual", ["key_pos", "query_pos"], ["mask"]),
            helper.make_node("Attention", ["q", "k_cache", "v_cache", "mask"], ["out"], scale=1.0),
        ],
        [helper.make_opsetid("", OPSET)], attributes=list(PLUGIN_ATTRIBUTES),
    )
    return [rope, step, attention]


def strip_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """The TensorRT copy: plugin nodes without their reference bodies, so only the plugin can implement them."""
    keep = [f for f in model.functions if f.domain != DOMAIN]
    del model.functions[:]
    model.functions.extend(keep)
    return model
