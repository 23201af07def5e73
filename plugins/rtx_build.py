"""Build-side twins of the plugins for TensorRT-RTX, so CI can build the plugin-path graphs without a GPU.

NVIDIA's QDP module (plugins/qdp.py, the real plugins with their AOT PTX) cannot drive TensorRT-RTX: it needs
`trt.ISymExpr`, which RTX lacks. These Python IPluginV3 classes declare the same names, namespace, I/O types and
shapes (and, like them, no aliased outputs), which is all the ONNX parser and the builder ask of a plugin; they have
no kernel (`enqueue` refuses), so an RTX plan built with them proves parsing and building, and must not be run.

TensorRT-RTX 1.7's parser dlopen()s "libtensorrt_rtx.so" (no version suffix) when it meets a plugin node, but
the wheel ships only libtensorrt_rtx.so.1; without an unversioned link the process aborts. `check_loader`
says how to add it (the Makefile's install step does).
"""

import ctypes
import importlib.util
from pathlib import Path

import numpy as np

from higgs_trt.runtime.errors import HiggsError

from .schemas import DOMAIN

BF16, I64, F32, I32 = "BF16", "INT64", "FLOAT", "INT32"
SPECS = {  # inputs' types, outputs' types, output → (input its dims come from) or dims picked from inputs
    "rope_kv_write": {"inputs": [BF16, BF16, BF16, BF16, BF16, I64, BF16, BF16], "outputs": [BF16, BF16, BF16],
                      "dims": [[(0, None)], [(6, None)], [(7, None)]]},
    "delayed_codebook_step": {"inputs": [F32, I64, I64, BF16], "outputs": [I32, BF16],
                              "dims": [[(0, 0), (0, 1)], [(0, 0), (3, 1)]]},
    "decode_attention": {"inputs": [BF16, BF16, BF16, I64], "outputs": [BF16], "dims": [[(0, None)]]},
}


def check_loader() -> None:
    """The parser looks beside itself (RPATH $ORIGIN) first, then on the usual library path."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    where = Path(next(iter(spec.submodule_search_locations))) if spec else Path("<site-packages>/tensorrt_rtx_libs")
    if (where / "libtensorrt_rtx.so").exists():
        return
    try:
        ctypes.CDLL("libtensorrt_rtx.so")
        return
    except OSError:
        pass
    raise HiggsError("TensorRT-RTX cannot load plugins: its wheel lacks libtensorrt_rtx.so (a packaging bug); "
                     f"fix it with: ln -s libtensorrt_rtx.so.1 {where / 'libtensorrt_rtx.so'}")


def register(trt) -> list:
    """Register both twins in `trt`'s plugin registry; keep the returned creators alive while building."""
    check_loader()
    creators = [_creator_class(trt)(name) for name in SPECS]
    registry = trt.get_plugin_registry()
    for creator in creators:
        if registry.get_creator(creator.name, "1", DOMAIN) is None:
            registry.register_creator(creator, DOMAIN)
    return creators


def _plugin_class(trt):
    class BuildOnlyPlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, name: str, aot: int = 1):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.plugin_name, self.plugin_namespace, self.plugin_version = name, DOMAIN, "1"
            self.spec = SPECS[name]
            self.num_outputs = len(self.spec["outputs"])
            self.aot = aot

        def get_capability_interface(self, type):
            return self

        def clone(self):
            return BuildOnlyPlugin(self.plugin_name, self.aot)

        def get_output_data_types(self, input_types):
            return [getattr(trt.DataType, t) for t in self.spec["outputs"]]

        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            shapes = []
            for picks in self.spec["dims"]:
                if picks[0][1] is None:  # all dims of one input
                    shapes.append(trt.DimsExprs(inputs[picks[0][0]]))
                    continue
                dims = trt.DimsExprs(len(picks))
                for i, (source, axis) in enumerate(picks):
                    dims[i] = inputs[source][axis]
                shapes.append(dims)
            return shapes

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            types = self.spec["inputs"] + self.spec["outputs"]
            return desc.format == trt.TensorFormat.LINEAR and desc.type == getattr(trt.DataType, types[pos])

        def configure_plugin(self, inputs, outputs):
            pass

        def get_workspace_size(self, inputs, outputs):
            return 0

        def get_valid_tactics(self):
            return []

        def on_shape_change(self, inputs, outputs):
            pass

        def set_tactic(self, tactic):
            pass

        def attach_to_context(self, resource_context):
            return self.clone()

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection([trt.PluginField("aot", np.array([self.aot], np.int32),
                                                              trt.PluginFieldType.INT32)])

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            raise RuntimeError(f"{DOMAIN}::{self.plugin_name} here is a build-only twin; run plans built with the "
                               "real plugins (datacenter TensorRT, plugins/qdp.py)")

    return BuildOnlyPlugin


def _creator_class(trt):
    plugin = _plugin_class(trt)

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self, name: str):
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_namespace, self.plugin_version = name, DOMAIN, "1"
            self.field_names = trt.PluginFieldCollection(
                [trt.PluginField("aot", np.array([], np.int32), trt.PluginFieldType.INT32)])

        def create_plugin(self, name, field_collection, phase):
            fields = {f.name: int(np.asarray(f.data).reshape(-1)[0]) for f in field_collection}
            return plugin(self.name, fields.get("aot", 1))

    return Creator
