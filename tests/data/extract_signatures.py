"""Record the call signatures of the TensorRT Python bindings (pybind11 docstrings) for tests/test_trt_api.py.

    python tests/data/extract_signatures.py   # writes tests/data/trt_signatures.json; needs gcc and PyPI

pybind11 writes each function's signature into its __doc__ ("name(self: T, a: int, b: str = …) -> R", and
"1. …", "2. …" for overloads), so the docstrings of an imported module carry every parameter list. The
datacenter wheels (`tensorrt-cu13-bindings` 11.4.0.106 and 10.16.1.11, fetched with pip) are imported on this
CPU-only machine against stub libnvinfer / libnvinfer_plugin / libnvonnxparser libraries that export the nine
entry points the module links to (each returns 0 and none is called during import). The `tensorrt-lean-cu13-bindings`
11.4.0.106 wheel gets a stub libnvinfer_lean the same way; TensorRT-RTX 1.7 (installed) imports as it is.
"""

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).parent
WHEELS = {  # key → (pip requirement, module inside the wheel, stub libraries, symbols they export)
    "tensorrt 11.4.0.106": ("tensorrt-cu13-bindings==11.4.0.106", "tensorrt_bindings", 11),
    "tensorrt 10.16.1.11": ("tensorrt-cu13-bindings==10.16.1.11", "tensorrt_bindings", 10),
    "tensorrt_lean 11.4.0.106": ("tensorrt-lean-cu13-bindings==11.4.0.106", "tensorrt_lean_bindings", 11),
}
SYMBOLS = ["createInferBuilder_INTERNAL", "createInferRefitter_INTERNAL", "createInferRuntime_INTERNAL",
           "createNvOnnxParserRefitter_INTERNAL", "createNvOnnxParser_INTERNAL", "getBuilderPluginRegistry",
           "getNvOnnxParserVersion", "getPluginRegistry", "initLibNvInferPlugins"]

DUMP = r'''
import importlib, inspect, json, sys
m = importlib.import_module(sys.argv[1])
out = {"__version__": getattr(m, "__version__", None) or m.__name__}
def docs(obj):
    doc = getattr(obj, "__doc__", None) or ""
    return [l.strip() for l in doc.splitlines() if "(" in l and ")" in l and "->" in l]
for name in dir(m):
    obj = getattr(m, name)
    if name.startswith("_"):
        continue
    if inspect.isclass(obj):
        entry = {}
        for member in ["__init__"] + [n for n in dir(obj) if not n.startswith("_")]:
            attr = inspect.getattr_static(obj, member, None)
            if isinstance(attr, property) or type(attr).__name__ in ("property", "getset_descriptor"):
                continue
            sigs = [s for s in docs(getattr(obj, member, None)) if re.match(r"^(\d+\. )?" + re.escape(member) + r"\(", s)]
            if sigs:
                entry[member] = sigs
        out[name] = entry
    elif callable(obj):
        sigs = [s for s in docs(obj) if re.match(r"^(\d+\. )?" + re.escape(name) + r"\(", s)]
        if sigs:
            out.setdefault("__module__", {})[name] = sigs
print(json.dumps(out))
'''.replace("import importlib", "import importlib, re")


def stubs(where: Path, major: int, lean: bool) -> None:
    src = where / "stub.c"
    src.write_text("".join(f"void* {s}(void) {{ return 0; }}\n" for s in SYMBOLS))
    names = [f"libnvinfer_lean.so.{major}"] if lean else \
        [f"libnvinfer.so.{major}", f"libnvinfer_plugin.so.{major}", f"libnvonnxparser.so.{major}"]
    for name in names:
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(where / name), str(src)], check=True)


def extract(key: str, tmp: Path) -> dict:
    requirement, module, major = WHEELS[key]
    where = tmp / key.replace(" ", "-")
    where.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp",
                    "-d", str(where), requirement], check=True)
    wheel = next(where.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(where / "site")
    stubs(where, major, "lean" in key)
    env = {**os.environ, "LD_LIBRARY_PATH": str(where), "PYTHONPATH": str(where / "site")}
    r = subprocess.run([sys.executable, "-c", DUMP, module], capture_output=True, text=True, env=env, check=True)
    table = json.loads(r.stdout)
    table["__wheel__"] = wheel.name
    table["__wheel_sha256__"] = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return table


def main() -> None:
    tables = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in WHEELS:
            tables[key] = extract(key, Path(tmp))
    r = subprocess.run([sys.executable, "-c", DUMP, "tensorrt_rtx_bindings"], capture_output=True, text=True, check=True)
    rtx = json.loads(r.stdout)
    tables[f"tensorrt_rtx {rtx['__version__']}"] = rtx
    (HERE / "trt_signatures.json").write_text(json.dumps(tables, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
