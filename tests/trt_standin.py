"""A stand-in for the *native* TensorRT module (`tensorrt_bindings/tensorrt.so`), just enough for NVIDIA's own
pure-Python `tensorrt.plugin` package (taken unchanged from the bindings wheel) to run on a machine without TensorRT.

It replaces only what lives in the C++ library:
- enums: DataType (and the module aliases int32, int64, float32, bfloat16), TensorFormat, DimensionOperation,
  PluginFieldType, PluginArgType, PluginArgDataType, TensorRTPhase, QuickPluginCreationRequest;
- plain value types: Dims, DimsExprs, PluginField, PluginFieldCollection, PluginTensorDesc,
  DynamicPluginTensorDesc, KernelLaunchParams and ISymExprs (what the builder passes to get_launch_params);
- the interfaces the package subclasses (IPluginV3, IPluginV3Quick*, IPluginCreatorV3Quick, ISymExpr): empty;
- IDimensionExpr / IExprBuilder: TensorRT's symbolic dimensions. Here an expression is a function of named symbols
  (batch, sequence, …), evaluated by `evaluate` with the values TensorRT would know at enqueue;
- the plugin registry (`get_plugin_registry`), Logger and ITensor.

Every name it defines exists in the real module (tests/test_qdp.py checks that against tests/data/trt11_api.json
and trt10_api.json), and the expression builder's methods have the real arity (checked against the recorded
signatures). It computes nothing the package under test computes: it records calls and evaluates expressions.
"""

import enum
import sys
import types


def _enum(name, members):
    return enum.Enum(name, [(m, i) for i, m in enumerate(members)])


DataType = _enum("DataType", ["FLOAT", "HALF", "INT8", "INT32", "BOOL", "UINT8", "FP8", "BF16", "INT64", "INT4",
                              "FP4", "E8M0"])
TensorFormat = _enum("TensorFormat", ["LINEAR", "CHW2", "HWC8", "CHW4", "CHW16", "CHW32", "DHWC8", "CDHW32", "HWC",
                                      "DLA_LINEAR", "DLA_HWC4", "HWC16", "DHWC"])
DimensionOperation = _enum("DimensionOperation", ["SUM", "PROD", "MAX", "MIN", "SUB", "EQUAL", "LESS", "FLOOR_DIV",
                                                  "CEIL_DIV"])
PluginFieldType = _enum("PluginFieldType", ["FLOAT16", "FLOAT32", "FLOAT64", "INT8", "INT16", "INT32", "CHAR",
                                            "DIMS", "UNKNOWN", "BF16", "INT64", "FP8", "INT4", "FP4"])
PluginArgType = _enum("PluginArgType", ["INT"])
PluginArgDataType = _enum("PluginArgDataType", ["INT8", "INT16", "INT32"])
TensorRTPhase = _enum("TensorRTPhase", ["BUILD", "RUNTIME"])
QuickPluginCreationRequest = _enum("QuickPluginCreationRequest", ["UNKNOWN", "PREFER_JIT", "PREFER_AOT",
                                                                  "STRICT_JIT", "STRICT_AOT"])
float32, int32, int64, bfloat16 = DataType.FLOAT, DataType.INT32, DataType.INT64, DataType.BF16


class Logger:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def log(self, severity, msg):
        pass


class Dims(tuple):
    MAX_DIMS = 8

    def __new__(cls, shape=()):
        return super().__new__(cls, () if isinstance(shape, int) else shape)


class DimsExprs(list):
    def __init__(self, n_or_exprs=0):
        super().__init__([None] * n_or_exprs if isinstance(n_or_exprs, int) else n_or_exprs)


class PluginField:
    def __init__(self, name="", data=None, type=None):
        self.name, self.data, self.type = name, data, type


class PluginFieldCollection(list):
    pass


class PluginTensorDesc:
    def __init__(self, type=None, format=TensorFormat.LINEAR, dims=Dims(), scale=-1.0):
        self.type, self.format, self.dims, self.scale = type, format, dims, scale


class DynamicPluginTensorDesc:
    def __init__(self, desc: PluginTensorDesc):
        self.desc, self.min, self.opt, self.max = desc, desc.dims, desc.dims, desc.dims


class KernelLaunchParams:  # what the builder hands to get_launch_params to be filled in
    pass


class ISymExprs:  # the setter for a plugin's extra scalar arguments
    def __init__(self):
        self.nbSymExprs, self.exprs = 0, {}

    def __setitem__(self, index, value):
        self.exprs[index] = value


class ITensor:
    pass


class IPluginV3:  # bases as recorded in trt11_api.json's __bases__ (IVersionedInterface / IPluginCapability left out)
    def __init__(self):
        pass


class IPluginCapability:
    def __init__(self):
        pass


class IPluginV3QuickCore(IPluginCapability):
    pass


class IPluginV3QuickBuild(IPluginCapability):
    pass


class IPluginV3QuickRuntime(IPluginCapability):
    pass


class IPluginV3QuickAOTBuild(IPluginV3QuickBuild):
    pass


class IPluginCreatorV3Quick:
    def __init__(self):
        pass


class ISymExpr:
    def __init__(self):
        pass


# ---- symbolic dimensions ---------------------------------------------------------------------------------------

class IDimensionExpr:
    def __init__(self, fn, constant=None):
        self.fn, self.constant = fn, constant

    def is_constant(self):
        return self.constant is not None

    def get_constant_value(self):
        return self.constant

    def is_size_tensor(self):
        return False


def symbol(name: str) -> IDimensionExpr:
    return IDimensionExpr(lambda values: values[name])


def evaluate(expr, values: dict) -> int:
    """The value TensorRT computes for an expression at enqueue, given the symbols' values."""
    return expr.fn(values)


_OPS = {"SUM": lambda a, b: a + b, "PROD": lambda a, b: a * b, "MAX": max, "MIN": min, "SUB": lambda a, b: a - b,
        "EQUAL": lambda a, b: int(a == b), "LESS": lambda a, b: int(a < b), "FLOOR_DIV": lambda a, b: a // b,
        "CEIL_DIV": lambda a, b: -(-a // b)}


class IExprBuilder:
    def constant(self, value):
        return IDimensionExpr(lambda values: value, value)

    def operation(self, op, first, second):
        f = _OPS[op.name]
        both = first.is_constant() and second.is_constant()
        return IDimensionExpr(lambda values: f(first.fn(values), second.fn(values)),
                              f(first.constant, second.constant) if both else None)

    def declare_size_tensor(self, output_index, opt, upper):
        raise NotImplementedError("our plugins have no data-dependent output shapes")


# ---- the plugin registry ---------------------------------------------------------------------------------------

class IPluginRegistry:
    def __init__(self):
        self.creators = {}

    def register_creator(self, creator, plugin_namespace):
        self.creators[(creator.name, creator.plugin_version, plugin_namespace)] = creator
        return True

    def get_creator(self, name, version, plugin_namespace=""):
        return self.creators.get((name, version, plugin_namespace))


_REGISTRY = IPluginRegistry()


def get_plugin_registry():
    return _REGISTRY


def install(plugin_parent: str) -> types.ModuleType:
    """Put this stand-in into sys.modules as `tensorrt`, with `tensorrt.plugin` importable from `plugin_parent`
    (a folder holding the wheel's `plugin/` package)."""
    module = sys.modules[__name__]
    module.__path__ = [plugin_parent]
    module.__version__ = "stand-in"
    _REGISTRY.creators.clear()
    sys.modules["tensorrt"] = module
    return module


NAMES = ["DataType", "TensorFormat", "DimensionOperation", "PluginFieldType", "PluginArgType", "PluginArgDataType",
         "TensorRTPhase", "QuickPluginCreationRequest", "float32", "int32", "int64", "bfloat16", "Logger", "Dims",
         "DimsExprs", "PluginField", "PluginFieldCollection", "PluginTensorDesc", "DynamicPluginTensorDesc",
         "KernelLaunchParams", "ISymExprs", "ITensor", "IPluginV3", "IPluginV3QuickCore", "IPluginV3QuickBuild",
         "IPluginV3QuickRuntime", "IPluginV3QuickAOTBuild", "IPluginCapability", "IPluginCreatorV3Quick", "ISymExpr",
         "IDimensionExpr", "IExprBuilder", "IPluginRegistry", "get_plugin_registry"]  # what the stand-in claims of the real module
