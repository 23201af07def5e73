"""The runtime runs with torch, onnx and polygraphy absent: a deployment installs only its own needs."""

import pkgutil
import subprocess
import sys

import higgs_trt.runtime

BLOCKER = """
import sys, importlib.abc
BLOCKED = {"torch", "onnx", "onnxscript", "onnx_ir", "polygraphy", "safetensors", "transformers", "ml_dtypes"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True)


# The GPU engine and the benchmarks bring torch; everything else under runtime/ is the deploy path.
TORCH_BOUND = ("higgs_trt.runtime.gpu", "higgs_trt.runtime.bench")


def test_every_deploy_path_module_imports_without_torch_onnx_polygraphy():
    modules = [m.name for m in pkgutil.walk_packages(higgs_trt.runtime.__path__, "higgs_trt.runtime.")
               if not m.name.startswith(TORCH_BOUND) and not m.name.endswith(".__main__")]
    assert {"higgs_trt.runtime.cli", "higgs_trt.runtime.cli.run", "higgs_trt.runtime.decoding",
            "higgs_trt.runtime.backends.ort", "higgs_trt.runtime.backends.trt", "higgs_trt.runtime.server.app",
            "higgs_trt.runtime.prompt", "higgs_trt.runtime.wav"} <= set(modules)
    r = run_blocked("import importlib\n" + "".join(f"importlib.import_module('{m}')\n" for m in modules)
                    + "assert not any(n.split('.')[0] in BLOCKED for n in sys.modules)\nprint('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_blocker_blocks():
    r = run_blocked("import torch")
    assert r.returncode != 0 and "blocked in this test" in r.stderr


def test_ort_run_end_to_end_without_torch(tiny_engine, tmp_path):
    out = tmp_path / "out.wav"
    r = run_blocked(f"from higgs_trt.runtime.cli import main\nmain(['run', '--engine', r'{tiny_engine}', "
                    f"'--text', 'Hello.', '--out', r'{out}', '--temperature', '0'])")
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 44
