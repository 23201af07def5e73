"""plugins/qdp.py through NVIDIA's own `tensorrt.plugin` Python code, as TensorRT's builder would call it.

The package is taken unchanged from the `tensorrt-cu13-bindings` wheels on PyPI (11.4 and 10.16; fetched with pip
into a cache, checked against the sha256 recorded in tests/data/trt11_api.json / trt10_api.json). Its native
module cannot load here (no libnvinfer), so tests/trt_standin.py stands in for that module alone: enums, plain
descriptors, symbolic dimensions and the registry. Everything a QDP definition can get wrong is decided by
NVIDIA's Python: decorator validation, create_plugin in STRICT_AOT, output types, shape expressions, aliases, the
default format/tactic combination, launch parameters, extra scalar arguments and the kernel lookup.
"""

import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import trt_standin

from higgs_trt.plugins import qdp
from higgs_trt.plugins.rtx_build import SPECS
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.manifest import EngineDir

DATA = Path(__file__).parent / "data"
WHEELS = {"11.4.0.106": "trt11_api.json", "10.16.1.11": "trt10_api.json"}  # version → the data file naming its sha256
CACHE = Path(os.environ.get("HIGGS_WHEEL_CACHE", Path.home() / ".cache" / "higgs-trt" / "wheels"))


def plugin_package(version: str) -> Path:
    """A folder holding `plugin/`: the wheel's tensorrt_bindings/plugin/*.py, byte for byte."""
    recorded = json.loads((DATA / WHEELS[version]).read_text())
    where = CACHE / version
    wheel = where / recorded["__wheel__"]
    if not wheel.exists():
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                            "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation",
                            "cp", "-d", str(where), f"tensorrt-cu13-bindings=={version}"],
                           capture_output=True, text=True)
        assert r.returncode == 0 and wheel.exists(), f"cannot fetch {wheel.name} from PyPI: {r.stderr[-2000:]}"
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == recorded["__wheel_sha256__"], wheel
    parent = where / "pkg"
    with zipfile.ZipFile(wheel) as z:
        files = [n for n in z.namelist() if n.startswith("tensorrt_bindings/plugin/") and n.endswith(".py")]
        assert len(files) >= 8, files
        for name in files:
            target = parent / "plugin" / Path(name).name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
    return parent


@pytest.fixture(params=sorted(WHEELS), ids=lambda v: f"tensorrt-{v}")
def tensorrt_plugin(request, monkeypatch):
    """(stand-in native module, NVIDIA's tensorrt.plugin) for one wheel; qdp.py's registration state reset."""
    parent = plugin_package(request.param)
    for name in [n for n in sys.modules if n == "tensorrt" or n.startswith("tensorrt.")]:
        monkeypatch.delitem(sys.modules, name)
    trt = trt_standin.install(str(parent))
    trtp = importlib.import_module("tensorrt.plugin")
    assert Path(trtp.__file__).parent == parent / "plugin"  # NVIDIA's code, not ours
    monkeypatch.setattr(qdp, "_REGISTERED", False)
    monkeypatch.setattr(qdp, "_KERNELS", {})
    yield trt, trtp
    for name in [n for n in sys.modules if n == "tensorrt" or n.startswith("tensorrt.")]:
        del sys.modules[name]


B, S, HQ, HKV, D, SMAX, POS = "batch", "seq", 4, 2, 16, 160, 160  # the tiny engine's dimensions (tests/conftest.py)
K, V, HIDDEN = 8, 1026, 64


def io_of(op: str):
    """(input dims, output dims): symbols and constants, as the tiny engine's lm graph gives them."""
    q, cache = [B, HQ, S, D], [B, HKV, SMAX, D]
    if op == "rope_kv_write":
        kv, rope = [B, HKV, S, D], [POS, D // 2]
        return [q, kv, kv, rope, rope, [B], cache, cache], [q, cache, cache]
    if op == "decode_attention":
        return [q, cache, cache, [B]], [q]
    return [[B, K, V], [B], [B], [K * V, HIDDEN]], [[B, K], [B, HIDDEN]]


def exprs(trt, dims):
    builder = trt.IExprBuilder()
    return trt.DimsExprs([trt_standin.symbol(d) if isinstance(d, str) else builder.constant(d) for d in dims])


def concrete(dims, values):
    return tuple(values[d] if isinstance(d, str) else d for d in dims)


@pytest.mark.parametrize("op", ["rope_kv_write", "delayed_codebook_step", "decode_attention"])
def test_qdp_plugins_as_tensorrt_builds_them(tensorrt_plugin, tiny_plugin_engine, op):
    trt, trtp = tensorrt_plugin
    manifest = EngineDir(tiny_plugin_engine).manifest
    qdp.register(tiny_plugin_engine, manifest)  # NVIDIA's decorators validate the definitions here
    info = manifest["plugins"][op]
    ptx = (tiny_plugin_engine / info["file"]).read_text()

    creator = trt.get_plugin_registry().get_creator(op, "1", "higgs")
    assert creator is not None and (creator.name, creator.plugin_namespace) == (op, "higgs")
    assert len(creator.field_names) == 0  # no attributes: nothing the ONNX node's plugin_* / aot fields must fill
    plugin = creator.create_plugin(op, "higgs", trt.PluginFieldCollection([]), trt.TensorRTPhase.BUILD,
                                   trt.QuickPluginCreationRequest.STRICT_AOT)  # what the parser asks for with aot=1
    assert isinstance(plugin, trt.IPluginV3QuickAOTBuild) and not isinstance(plugin, trt.IPluginV3QuickRuntime)

    in_types = [getattr(trt.DataType, t) for t in SPECS[op]["inputs"]]
    out_types = [getattr(trt.DataType, t) for t in SPECS[op]["outputs"]]
    in_dims, out_dims = io_of(op)
    assert plugin.get_output_data_types(in_types, [len(d) for d in in_dims]) == out_types
    # no output aliases an input: for an aliased plugin output TensorRT may copy the input (a whole KV cache per
    # layer and step); rope_kv_write's caches are bound in place by the runtime instead (docs/tensorrt.md)
    assert [plugin.get_aliased_input(i) for i in range(len(out_types))] == [-1] * len(out_types)

    builder = trt.IExprBuilder()
    inputs = [exprs(trt, d) for d in in_dims]
    shapes = plugin.get_output_shapes(inputs, [], builder)
    for values in ({B: 1, S: 1}, {B: 3, S: 7}):
        got = [tuple(trt_standin.evaluate(e, values) for e in dims) for dims in shapes]
        assert got == [concrete(d, values) for d in out_dims], values

    values = {B: 3, S: 7}
    descs = [trt.DynamicPluginTensorDesc(trt.PluginTensorDesc(t, trt.TensorFormat.LINEAR,
                                                              trt.Dims(concrete(d, values))))
             for t, d in zip(in_types + out_types, in_dims + out_dims)]
    combos = plugin.get_supported_format_combinations(descs, len(in_types))
    assert [(c.type, c.format) for c in combos] == [(t, trt.TensorFormat.LINEAR) for t in in_types + out_types]
    plugin.configure_plugin(descs[:len(in_types)], descs[len(in_types):])
    assert plugin.get_valid_tactics() == []  # no custom tactics: TensorRT runs the default one
    plugin.set_tactic(0)
    launch, extra = trt.KernelLaunchParams(), trt.ISymExprs()
    plugin.get_launch_params(inputs, descs, len(in_types), launch, extra, builder)

    def value(expr):
        return trt_standin.evaluate(expr.expr, values)

    assert (value(launch.block_x), value(launch.block_y), value(launch.block_z)) == (info["threads"], 1, 1)
    assert value(launch.shared_mem) == info["shared"]
    if op == "rope_kv_write":  # one program per (batch row, new position); scalars: new positions, cache length
        assert (value(launch.grid_x), value(launch.grid_y), value(launch.grid_z)) == (3 * 7, 1, 1)
        assert extra.nbSymExprs == 2 and [value(extra.exprs[i]) for i in range(2)] == [7, SMAX]
        assert all(extra.exprs[i].dtype == trt.PluginArgDataType.INT32 for i in range(2))
    elif op == "decode_attention":  # (batch row, KV head, block of 16 (position, query head) pairs); same scalars
        assert (value(launch.grid_x), value(launch.grid_y), value(launch.grid_z)) == (3, HKV, -(-7 * (HQ // HKV) // 16))
        assert extra.nbSymExprs == 2 and [value(extra.exprs[i]) for i in range(2)] == [7, SMAX]
    else:
        constants = info["constants"]
        assert (value(launch.grid_x), value(launch.grid_y)) == (3, -(-constants["HIDDEN"] // constants["BLOCK_H"]))
        assert extra.nbSymExprs == 0
    name, code = plugin.get_kernel([d.desc for d in descs[:len(in_types)]], [d.desc for d in descs[len(in_types):]])
    assert name == info["entry"] and code == ptx.encode()
    entry = ptx[ptx.index(f".entry {name}("):]
    assert entry[: entry.index(")")].count(".param") == len(in_types) + extra.nbSymExprs + len(out_types)
    assert plugin.clone().kernel_map == plugin.kernel_map  # TensorRT clones the plugin it serializes


def test_the_stand_in_claims_only_what_the_native_module_has():
    for table in WHEELS.values():
        api = json.loads((DATA / table).read_text())
        for name in trt_standin.NAMES:
            assert name in api or name in api["__module__"], (table, name)
        for enum in ("DataType", "TensorFormat", "DimensionOperation", "PluginFieldType", "PluginArgDataType",
                     "TensorRTPhase", "QuickPluginCreationRequest"):
            assert {m.name for m in getattr(trt_standin, enum)} == set(api["__enum_values__"][enum]), (table, enum)
        assert {"constant", "operation"} <= set(api["IExprBuilder"])
        assert {"is_constant", "get_constant_value"} <= set(api["IDimensionExpr"])
        assert {"grid_x", "block_x", "shared_mem"} <= set(api["KernelLaunchParams"]) and "nbSymExprs" in api["ISymExprs"]


def test_register_without_tensorrt_is_one_error_line(tiny_plugin_engine, monkeypatch):
    monkeypatch.setattr(qdp, "_REGISTERED", False)
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as on this machine: no datacenter TensorRT
    with pytest.raises(HiggsError, match=r"--ops plugin needs NVIDIA's tensorrt.plugin") as e:
        qdp.register(tiny_plugin_engine, EngineDir(tiny_plugin_engine).manifest)
    assert "\n" not in str(e.value)


def test_plugin_ptx_is_checked_against_the_build_gpu(tiny_plugin_engine):
    manifest = EngineDir(tiny_plugin_engine).manifest
    assert {(p["target"], p["ptx_version"]) for p in manifest["plugins"].values()} == {("sm_80", "8.0")}
    qdp.check_ptx(manifest, (9, 0), 13000)  # H200, R580
    qdp.check_ptx(manifest, (12, 0), 13000)  # plain sm_80 PTX runs on later GPUs too
    with pytest.raises(HiggsError, match=r"targets sm_80, which a GPU of compute capability 7.5 cannot run"):
        qdp.check_ptx(manifest, (7, 5), 13000)
    hopper_only = {"plugins": {"x": {"target": "sm_90a", "ptx_version": "9.4"}}}  # what Triton 3.9 emits for sm_90
    with pytest.raises(HiggsError, match=r"ISA 9.4, which needs a driver for CUDA 13.4\+ \(this one supports 13.0\)"):
        qdp.check_ptx(hopper_only, (9, 0), 13000)
    with pytest.raises(HiggsError, match=r"sm_90a, which a GPU of compute capability 10.0 cannot run"):
        qdp.check_ptx(hopper_only, (10, 0), 13040)
    with pytest.raises(HiggsError, match=r"unknown PTX target 'sm_90' / version '\?'"):  # an export from before
        qdp.check_ptx({"plugins": {"x": {"target": "sm_90"}}}, (9, 0), 13000)
    assert re.fullmatch(r"\d+\.\d+", manifest["plugins"]["rope_kv_write"]["ptx_version"])
