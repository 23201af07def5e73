"""Every TensorRT API our code touches exists, with a parameter list that fits the call, in the TensorRT versions
that run it; nothing removed in TensorRT 11 is used.

Every module that calls into `tensorrt`, `tensorrt_rtx`, `tensorrt_lean` or `tensorrt.plugin` is checked (the
first test proves none is left out), each against the bindings it runs with:
- names: member lists read from the real wheels (tests/data/trt*_api.json; tests/data/README.md says how);
- calls: positional count and keyword names against the pybind11 signatures recorded from the same wheels'
  docstrings (tests/data/trt_signatures.json, written by tests/data/extract_signatures.py), overloads included.
Objects are recognised by the names our code gives them (OBJECTS). What this cannot see: calls on objects it
does not recognise, argument types, and the methods TensorRT calls on our own plugin classes (plugins/rtx_build.py
runs through TensorRT-RTX's real builder in CI; plugins/qdp.py through NVIDIA's tensorrt.plugin in tests/test_qdp.py).
"""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
TABLES = {"11": ("trt11_api.json", "tensorrt 11.4.0.106"), "10": ("trt10_api.json", "tensorrt 10.16.1.11"),
          "lean": ("trt_lean_api.json", "tensorrt_lean 11.4.0.106"), "rtx": ("trt_rtx_api.json", "tensorrt_rtx 1.7.1.116")}
CODE = {  # module → the bindings it runs with
    "builder/trt_build.py": ("11", "10", "rtx"),
    "builder/compare.py": ("11", "10"),
    "runtime/trt_shim.py": ("11", "10", "rtx", "lean"),
    "runtime/backends/trt.py": ("11", "10", "lean", "rtx"),
    "runtime/backends/trt_encoder.py": ("11", "10", "lean", "rtx"),
    "runtime/cli/doctor.py": ("11", "10", "rtx", "lean"),
    "plugins/qdp.py": ("11", "10"),
    "plugins/rtx_build.py": ("rtx",),
}
OBJECTS = {  # how our code names TensorRT objects → their class
    "builder": "Builder", "network": "INetworkDefinition", "config": "IBuilderConfig", "parser": "OnnxParser",
    "profile": "IOptimizationProfile", "cache": "ITimingCache", "runtime": "Runtime", "loaded": "ICudaEngine",
    "lm_engine": "ICudaEngine", "codec_engine": "ICudaEngine", "trt_engine": "ICudaEngine",
    "encoder_engine": "ICudaEngine", "ctx": "IExecutionContext", "lm_context": "IExecutionContext",
    "codec_context": "IExecutionContext", "encoder_context": "IExecutionContext", "trt_context": "IExecutionContext",
    "layer": "ILayer", "registry": "IPluginRegistry", "boundary": "IAttentionBoundaryLayer", "attention": "IAttention",
    "inspector": "EngineInspector",
}
RTX_ONLY = {"num_compute_capabilities", "set_compute_capability", "ComputeCapability"}  # trt_shim.set_target
REMOVED_IN_11 = [r"set_output_type", r"EXPLICIT_BATCH", r"int8_calibrator", r"BuilderFlag\.(FP16|BF16|INT8|FP8|INT4|FP4)",
                 r"PRECISION_CONSTRAINTS", r"\.precision\s*=", r"platform_has_fast", r"max_workspace_size",
                 r"set_dynamic_range", r"create_execution_context_without_device_memory", r"IInt8"]
PACKAGES = ["builder", "runtime", "plugins", "calibration"]


def api(name):
    return json.loads((DATA / name).read_text())


SIGNATURES = json.loads((DATA / "trt_signatures.json").read_text())


def _owner(v):
    """The TensorRT class (or 'module' / 'plugin') an attribute's value stands for, or None."""
    if isinstance(v, ast.Name):
        return {"trt": "module", "trtp": "plugin"}.get(v.id) or OBJECTS.get(v.id)
    if isinstance(v, ast.Attribute):
        if isinstance(v.value, ast.Name) and v.value.id == "self" and v.attr in OBJECTS:
            return OBJECTS[v.attr]
        if isinstance(v.value, ast.Name) and v.value.id == "trt":
            return v.attr
        if isinstance(v.value, ast.Attribute) and isinstance(v.value.value, ast.Name) and v.value.value.id == "trt":
            return f"{v.value.attr}.{v.attr}"
    return None


def uses(path: str):
    """(owner, member) for trt.X, trt.X.Y, trtp.X and <known object>.member in one file."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Attribute) and _owner(node.value):
            found.add((_owner(node.value), node.attr))
    return found


def calls(path: str):
    """(owner, member, positional count, keyword names, line) of each call on a TensorRT object or class."""
    out = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue  # *args / **kwargs: not checkable
        owner, member = _owner(node.func.value), node.func.attr
        if owner in (None, "plugin"):
            continue  # tensorrt.plugin is pure Python: tests/test_qdp.py runs it
        if owner == "module" or (isinstance(node.func.value, ast.Name) and node.func.value.id == "trt"):
            out.append(("module", member, len(node.args), [k.arg for k in node.keywords], node.lineno))
        else:
            bound = 0 if member == "__init__" else 1  # trt.Cls.__init__(self) passes self itself
            out.append((owner, member, len(node.args) + bound, [k.arg for k in node.keywords], node.lineno))
    return out


def parameters(signature: str):
    """[(name, has_default)] of a pybind11 signature line, or None for *args/**kwargs."""
    inner = re.sub(r"^(\d+\. )?\w+\(", "", signature)
    depth, part, parts = 0, "", []
    for ch in inner:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts = [p.strip() for p in parts + [part] if p.strip()]
    if any(p.startswith("*") for p in parts):
        return None
    return [(p.split(":")[0].split("=")[0].strip(), "=" in p) for p in parts]


def fits(signature: str, positional: int, keywords: list[str]) -> bool:
    params = parameters(signature)
    if params is None:
        return True
    if positional > len(params):
        return False
    given = {n for n, _ in params[:positional]}
    rest = {n for n, _ in params[positional:]}
    return all(k in rest for k in keywords) and all(n in given or n in keywords or d for n, d in params)


def _members(table: dict, name: str) -> dict:
    entry = table.get(name)
    return entry if isinstance(entry, dict) else {}


def signatures_of(table: dict, owner: str, member: str):
    if owner == "module":
        return _members(table, member).get("__init__") or table["__module__"].get(member)
    return _members(table, owner).get(member)


def bad_calls(path: str, key: str) -> list[str]:
    table, bad = SIGNATURES[TABLES[key][1]], []
    for owner, member, positional, keywords, line in calls(path):
        if key != "rtx" and (member in RTX_ONLY or owner in RTX_ONLY):
            continue
        sigs = signatures_of(table, owner, member)
        if sigs is None:
            continue  # a property, an enum value or a name the name check reports
        if owner == "module" and "__init__" in _members(table, member):
            positional += 1  # trt.Cls(...) fills __init__'s self
        if not any(fits(s, positional, keywords) for s in sigs):
            bad.append(f"{path}:{line} {owner}.{member}: {positional} positional {keywords} fits none of {sigs}")
    return bad


def missing(found, names):
    bad = []
    for owner, member in found:
        if member in RTX_ONLY or owner in RTX_ONLY or member.startswith("__") or owner.startswith("__"):
            continue
        if owner == "module":
            ok = member in names["__module__"] or member in names
        elif owner == "plugin":
            ok = member in names["__submodules__"]["plugin"]
        else:
            ok = member in names.get(owner, [])
        if not ok:
            bad.append(f"{'trt' if owner == 'module' else 'trtp' if owner == 'plugin' else owner}.{member}")
    return sorted(bad)


def touches_tensorrt(path: Path) -> bool:
    """Imports a TensorRT module, loads one through trt_shim, or works on one named trt / trtp."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n.split(".")[0].startswith("tensorrt") for n in names):
                return True
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trt_shim" \
                and node.attr in ("load", "try_load"):
            return True
        if isinstance(node, ast.Name) and node.id in ("trt", "trtp"):
            return True
    return False


def test_every_module_that_touches_tensorrt_is_checked():
    touching = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if touches_tensorrt(p)}
    assert touching == set(CODE)


@pytest.mark.parametrize("path, key", [(p, k) for p, keys in CODE.items() for k in keys])
def test_names_exist(path, key):
    found = uses(path)
    if key == "lean" and path == "runtime/trt_shim.py":  # build-side helpers there are not called with lean
        found = {(o, m) for o, m in found if o not in ("IBuilderConfig",)}
    assert missing(found, api(TABLES[key][0])) == []


@pytest.mark.parametrize("path, key", [(p, k) for p, keys in CODE.items() for k in keys])
def test_calls_fit_the_recorded_signatures(path, key):
    assert bad_calls(path, key) == []


def test_the_walks_see_our_tensorrt_calls():
    checked = {(o, m) for p in CODE for o, m, *_ in calls(p)}
    for owner, member in [("Builder", "build_serialized_network"), ("IOptimizationProfile", "set_shape"),
                          ("IExecutionContext", "set_tensor_address"), ("IExecutionContext", "set_input_shape"),
                          ("ICudaEngine", "get_aliased_input_tensor"), ("module", "OnnxParser"),
                          ("module", "PluginField"), ("IPluginRegistry", "register_creator")]:
        assert (owner, member) in checked
    assert len(checked) > 35
    used = {u for p in CODE for u in uses(p)}  # attributes set or read, not called: checked by name
    assert {("IAttentionBoundaryLayer", "attention"), ("IAttention", "decomposable"),
            ("IBuilderConfig", "profiling_verbosity"), ("ICudaEngine", "create_engine_inspector")} <= used
    for key in TABLES:  # every recorded table has these signatures
        assert signatures_of(SIGNATURES[TABLES[key][1]], "IExecutionContext", "set_tensor_address")


def test_rtx_only_calls_exist_in_rtx_and_stay_in_the_shim():
    rtx = api("trt_rtx_api.json")
    assert {"num_compute_capabilities", "set_compute_capability"} <= set(rtx["IBuilderConfig"])
    assert "ComputeCapability" in rtx and "ComputeCapability" not in api("trt11_api.json")
    for path in CODE:
        if path != "runtime/trt_shim.py":
            assert not RTX_ONLY & {m for _, m in uses(path)}, path


def test_nothing_removed_in_tensorrt_11_is_used():
    t11, t10 = api("trt11_api.json"), api("trt10_api.json")
    assert "FP16" in t10["__enum_values__"]["BuilderFlag"] and "FP16" not in t11["__enum_values__"]["BuilderFlag"]
    for path in CODE:
        text = (ROOT / path).read_text()
        for pattern in REMOVED_IN_11:
            assert not re.search(pattern, text), (path, pattern)


def test_the_checks_catch_a_removed_name_and_a_wrong_call(tmp_path):
    found = {("IBuilderConfig", "int8_calibrator"), ("BuilderFlag", "FP16"), ("plugin", "int32")}
    assert missing(found, api("trt11_api.json")) == ["BuilderFlag.FP16", "IBuilderConfig.int8_calibrator", "trtp.int32"]
    assert missing(found, api("trt10_api.json")) == ["trtp.int32"]
    table = SIGNATURES[TABLES["11"][1]]
    set_address = signatures_of(table, "IExecutionContext", "set_tensor_address")
    assert any(fits(s, 3, []) for s in set_address) and not any(fits(s, 2, []) for s in set_address)
    assert any(fits(s, 2, ["memory"]) for s in set_address) and not any(fits(s, 2, ["ptr"]) for s in set_address)
    assert not any(fits(s, 1 + 2, []) for s in signatures_of(table, "module", "Runtime"))  # trt.Runtime(logger, x)
