"""Every TensorRT API our code touches exists in TensorRT 11 (and 10.16, for 10.15+), nothing removed in 11 is used.

Names are checked against member lists read from the real wheels (tests/data/README.md says how): the
`tensorrt` 11.4 and 10.16 bindings, `tensorrt_lean` 11.4 (runtime code must work there too) and
TensorRT-RTX 1.7 (the CI builder). Objects are recognised by the names our code gives them.
"""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
BUILD_CODE = ["builder/trt_build.py", "runtime/trt_shim.py"]
RUNTIME_CODE = ["runtime/trt_backend.py", "runtime/trt_encoder.py", "runtime/trt_shim.py"]
OBJECTS = {  # how our code names TensorRT objects → their class
    "builder": "Builder", "network": "INetworkDefinition", "config": "IBuilderConfig", "parser": "OnnxParser",
    "profile": "IOptimizationProfile", "cache": "ITimingCache", "runtime": "Runtime", "loaded": "ICudaEngine",
    "lm_engine": "ICudaEngine", "codec_engine": "ICudaEngine", "ctx": "IExecutionContext",
    "lm_context": "IExecutionContext", "codec_context": "IExecutionContext", "layer": "ILayer",
    "encoder_engine": "ICudaEngine", "encoder_context": "IExecutionContext",
}
RTX_ONLY = {"num_compute_capabilities", "set_compute_capability", "ComputeCapability"}  # trt_shim.set_target
REMOVED_IN_11 = [r"set_output_type", r"EXPLICIT_BATCH", r"int8_calibrator", r"BuilderFlag\.(FP16|BF16|INT8|FP8|INT4|FP4)",
                 r"PRECISION_CONSTRAINTS", r"\.precision\s*=", r"platform_has_fast", r"max_workspace_size",
                 r"set_dynamic_range", r"create_execution_context_without_device_memory", r"IInt8"]


def api(name):
    return json.loads((DATA / name).read_text())


def uses(path: str):
    """(kind, owner, member) for trt.X, trt.X.Y and <known object>.member in one file."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id == "trt":
            found.add(("module", None, node.attr))
        elif isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "trt":
            found.add(("class", v.attr, node.attr))
        elif isinstance(v, ast.Attribute) and isinstance(v.value, ast.Attribute) and isinstance(v.value.value, ast.Name) \
                and v.value.value.id == "trt":
            found.add(("class", f"{v.value.attr}.{v.attr}", node.attr))
        elif isinstance(v, ast.Name) and v.id in OBJECTS:
            found.add(("class", OBJECTS[v.id], node.attr))
        elif isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self" and v.attr in OBJECTS:
            found.add(("class", OBJECTS[v.attr], node.attr))
    return found


def missing(found, names):
    bad = []
    for kind, owner, member in found:
        if member in RTX_ONLY or owner in RTX_ONLY or member.startswith("__"):
            continue
        if kind == "module":
            ok = member in names["__module__"] or member in names
        else:
            ok = member in names.get(owner, [])
        if not ok:
            bad.append(f"{owner + '.' if owner else 'trt.'}{member}")
    return sorted(bad)


@pytest.mark.parametrize("table", ["trt11_api.json", "trt10_api.json", "trt_rtx_api.json"])
def test_build_code_uses_only_existing_names(table):
    found = set().union(*(uses(p) for p in BUILD_CODE))
    assert len(found) > 20  # the walk does see our TensorRT calls
    assert missing(found, api(table)) == []


@pytest.mark.parametrize("table", ["trt11_api.json", "trt10_api.json", "trt_lean_api.json"])
def test_runtime_code_uses_only_existing_names(table):
    found = set().union(*(uses(p) for p in RUNTIME_CODE))
    assert len(found) > 12
    assert missing(found, api(table)) == []


def test_rtx_only_calls_exist_in_rtx_and_stay_in_the_shim():
    rtx = api("trt_rtx_api.json")
    assert {"num_compute_capabilities", "set_compute_capability"} <= set(rtx["IBuilderConfig"])
    assert "ComputeCapability" in rtx and "ComputeCapability" not in api("trt11_api.json")
    for path in set(BUILD_CODE + RUNTIME_CODE):
        if path != "runtime/trt_shim.py":
            assert not RTX_ONLY & {m for _, _, m in uses(path)}, path


def test_nothing_removed_in_tensorrt_11_is_used():
    t11, t10 = api("trt11_api.json"), api("trt10_api.json")
    assert "FP16" in t10["__enum_values__"]["BuilderFlag"] and "FP16" not in t11["__enum_values__"]["BuilderFlag"]
    for path in set(BUILD_CODE + RUNTIME_CODE):
        text = (ROOT / path).read_text()
        for pattern in REMOVED_IN_11:
            assert not re.search(pattern, text), (path, pattern)


def test_the_check_catches_a_removed_name(tmp_path):
    found = {("class", "IBuilderConfig", "int8_calibrator"), ("class", "BuilderFlag", "FP16")}
    assert missing(found, api("trt11_api.json")) == ["BuilderFlag.FP16", "IBuilderConfig.int8_calibrator"]
    assert missing(found, api("trt10_api.json")) == []
