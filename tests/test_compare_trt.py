"""compare's TensorRT runner, without TensorRT or a GPU: it binds the plan's KV caches in place at one address, and
it passes through Polygraphy's Comparator with the plan's bf16 caches.

Polygraphy's own TrtRunner code (`_infer_impl`, the version installed) runs against a thin fake engine and
execution context that record addresses: the one place a fake is right, since what is checked is the binding a
context is given. Polygraphy needs a `tensorrt` module for its enums and its output-allocator base class; the
TensorRT-RTX bindings (installed, importable without a GPU) provide them through Polygraphy's own switch
(POLYGRAPHY_USE_TENSORRT_RTX), in a subprocess so the switch touches no other test. Inputs are Polygraphy device
arrays over fake addresses (no copies are made: they are "on the GPU" already) and outputs stay on the device.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("polygraphy")  # before compare's import, which needs it (the GPU host has no Polygraphy)
if os.environ.get("HIGGS_REQUIRE_RTX") != "1":
    pytest.importorskip("tensorrt_rtx_bindings")

from higgs_trt.builder.compare import check_cache_binding  # noqa: E402
from higgs_trt.runtime.errors import HiggsError  # noqa: E402

SCRIPT = r'''
import json, os, sys
os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"
import tensorrt_rtx_bindings as trt
sys.modules["tensorrt_rtx"] = trt
from collections import OrderedDict
from polygraphy import cuda
from polygraphy.backend.trt import TrtRunner
from polygraphy.backend.trt.runner import _make_output_allocator
from polygraphy.datatype import DataType
from higgs_trt.builder.compare import cache_bound_trt_runner

I, O = trt.TensorIOMode.INPUT, trt.TensorIOMode.OUTPUT
IO = {"input_ids": (I, trt.int64), "past_key_0": (I, trt.bfloat16), "past_value_0": (I, trt.bfloat16),
      "logits": (O, trt.float32), "present_key_0": (O, trt.bfloat16), "present_value_0": (O, trt.bfloat16)}


class Engine:
    def __init__(self, aliased):
        self.aliases = {"present_key_0": "past_key_0", "present_value_0": "past_value_0"} if aliased else {}
        self.num_io_tensors = len(IO)
    def get_tensor_name(self, i): return list(IO)[i]
    def get_tensor_mode(self, name): return IO[name][0]
    def get_tensor_dtype(self, name): return IO[name][1]
    def is_shape_inference_io(self, name): return False
    def get_aliased_input_tensor(self, name): return self.aliases.get(name)
    def get_tensor_format(self, name, profile=None): return trt.TensorFormat.LINEAR


class Context:  # records what it is given; its output shapes are what TensorRT's shape inference would say
    active_optimization_profile = 0
    def __init__(self): self.addresses, self.shapes, self.allocators, self.runs = {}, {}, [], 0
    def set_input_shape(self, name, shape): self.shapes[name] = tuple(shape); return True
    def get_tensor_shape(self, name): return self.shapes.get(name, self.shapes.get(name.replace("present_", "past_")))
    def set_tensor_address(self, name, ptr): self.addresses[name] = ptr; return True
    def get_tensor_address(self, name): return self.addresses.get(name, 0)
    def set_output_allocator(self, name, allocator): self.allocators.append(name); return True
    def execute_async_v3(self, stream): self.runs += 1; return True


class Stream:
    ptr = 1
    def synchronize(self): pass


def device(ptr, shape, dtype):  # a Polygraphy device array over a fake address: nothing is allocated
    a = cuda.DeviceArray.__new__(cuda.DeviceArray)
    cuda.DeviceView.__init__(a, ptr, shape, dtype)
    a.allocated_nbytes = a.nbytes
    return a


def activate(self):  # what TrtRunner.activate_impl sets up, over the stand-in engine
    self.engine, self.context, self.stream = Engine(self.aliased), Context(), Stream()
    self.device_input_buffers, self.host_output_buffers = OrderedDict(), OrderedDict()
    self.input_tensor_addresses, self._active_debug_listener = OrderedDict(), None
    self.output_allocator = _make_output_allocator()


TrtRunner.activate_impl = activate
results = {}
for aliased in (True, False):
    runner = cache_bound_trt_runner()(None)
    runner.aliased = aliased
    runner.activate_impl()
    for i, name in enumerate(["logits", "present_key_0", "present_value_0"]):  # as if TensorRT had asked for them
        runner.output_allocator.buffers[name] = device(0x9000000 + i * 0x100000, (4096,), DataType.UINT8)
        runner.output_allocator.shapes[name] = (1, 2, 16, 8) if name != "logits" else (1, 8)
    feeds = {"input_ids": device(0x1000, (1, 3), DataType.INT64),
             "past_key_0": device(0x5000000, (1, 2, 16, 8), DataType.BFLOAT16),
             "past_value_0": device(0x6000000, (1, 2, 16, 8), DataType.BFLOAT16)}
    for step in range(2):
        out = runner._infer_impl(feeds, False, False)
    results[str(aliased)] = {"addresses": runner.context.addresses, "allocators": runner.context.allocators,
                             "out": {k: v.ptr for k, v in out.items()}, "runs": runner.context.runs}
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def bindings():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("aliased", ["True", "False"], ids=["native plan", "plugin plan"])
def test_every_plan_gets_one_address_per_cache(bindings, aliased):
    """A native plan reports its caches as aliased (TensorRT's KV-cache layer); a plugin plan reports none, and its
    rope_kv_write writes only the new rows through present_*: both are bound in place."""
    b = bindings[aliased]
    assert b["runs"] == 2
    for cache in ("key_0", "value_0"):
        assert b["addresses"][f"present_{cache}"] == b["addresses"][f"past_{cache}"]  # read and written in place
        assert b["out"][f"present_{cache}"] == b["addresses"][f"past_{cache}"]  # the updated cache comes back
    assert b["allocators"] == ["logits", "logits"]  # only the plain output gets its own buffer


class Recorded:
    def __init__(self, addresses):
        self.addresses = addresses

    def get_tensor_address(self, name):
        return self.addresses[name]


def test_a_runner_that_binds_a_cache_apart_is_refused():
    with pytest.raises(HiggsError, match="bound present_key_0 apart from past_key_0, which the plan updates in place"):
        check_cache_binding(Recorded({"past_key_0": 0x5000, "present_key_0": 0x7000}), ["past_key_0"])
    check_cache_binding(Recorded({"past_key_0": 0x5000, "present_key_0": 0x5000}), ["past_key_0"])

def test_the_plan_runner_passes_polygraphys_comparator_with_bf16_caches(tiny_engine, monkeypatch, tmp_path):
    """compare --runners ort,trt as Polygraphy runs it: Comparator.run and BaseRunner.infer drive TrtPlanRunner, whose
    inner runner stands in for TrtRunner: the plan's input metadata (bf16 caches, read off the engine as TrtRunner
    does) and, for torch feeds, torch outputs on the host; ONNX Runtime on the fp32 twin computes them. The saved
    outputs keep the plan's codes int32."""
    import numpy as np
    import onnxruntime
    import torch
    from polygraphy.backend.base import BaseRunner
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.common import TensorMetadata
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.datatype import DataType

    from higgs_trt.builder import compare
    from higgs_trt.runtime.manifest import EngineDir
    from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt

    onnxruntime.set_default_logger_severity(3)  # TensorScatter warns on every call that it copies the cache
    engine = EngineDir(tiny_engine)
    io, twin = engine.graph("lm_ref"), str(engine.file("lm_ref"))
    caches = [t["name"] for t in io["inputs"] if t["name"].startswith("past_")]

    class StandInTrtRunner(BaseRunner):
        def __init__(self, engine_loader, optimization_profile):
            super().__init__(name="inner")

        def activate_impl(self):
            self.session = onnxruntime.InferenceSession(twin, providers=["CPUExecutionProvider"])

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for t in io["inputs"]:
                dtype = DataType.BFLOAT16 if t["name"] in caches else DataType.from_dtype(np.dtype(t["dtype"]))
                meta.add(t["name"], dtype, [d if isinstance(d, int) else -1 for d in t["shape"]])
            return meta

        def infer_impl(self, feed_dict):
            assert all(feed_dict[n].dtype == torch.bfloat16 for n in caches)  # what the plan's bindings take
            feeds = {k: v.float().numpy() if torch.is_tensor(v) else v for k, v in feed_dict.items()}
            names = [o.name for o in self.session.get_outputs()]
            out = dict(zip(names, self.session.run(None, feeds)))
            self.inference_time = 0.0
            return {k: torch.from_numpy(v).to(torch.bfloat16 if k.startswith("present_") else torch.from_numpy(v).dtype)
                    for k, v in out.items()}

        def deactivate_impl(self):
            del self.session

    monkeypatch.setattr(compare, "cache_bound_trt_runner", lambda: StandInTrtRunner)
    plan = tmp_path / "lm.plan"
    plan.write_bytes(b"a plan")
    prompt = build_prompt(HiggsTokenizer(tiny_engine / "tokenizer.json"), "Hello world.")
    feeds = compare.reference_feeds(engine, None, [prompt], 2)
    runners = [OnnxrtRunner(SessionFromOnnx(twin, providers=["cpu"]), name="ort"), compare.TrtPlanRunner(plan)]
    results = Comparator.run(runners, data_loader=feeds)
    results.save(str(tmp_path / "outputs.json"))
    saved = RunResults.load(str(tmp_path / "outputs.json"))
    assert len(saved["trt"]) == len(feeds) == 3
    for ort_out, trt_out in zip(saved["ort"], saved["trt"]):
        assert trt_out["codes"].dtype == np.int32 and np.array_equal(trt_out["codes"], ort_out["codes"])
        assert trt_out["logits"].dtype == trt_out["present_key_0"].dtype == np.float32
        rounded = torch.from_numpy(ort_out["present_key_0"]).bfloat16().float().numpy()
        assert np.array_equal(trt_out["present_key_0"], rounded)  # the plan's bf16 caches, widened for comparison
