"""compare's TensorRT runner binds the plan's in-place KV caches at one address, without TensorRT or a GPU.

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


results = {}
for aliased in (True, False):
    runner = cache_bound_trt_runner()(None)
    runner.engine, runner.context, runner.stream = Engine(aliased), Context(), Stream()  # what activate() sets up
    runner.device_input_buffers, runner.host_output_buffers = OrderedDict(), OrderedDict()
    runner.input_tensor_addresses, runner._active_debug_listener = OrderedDict(), None
    runner.output_allocator = _make_output_allocator()
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


def test_a_plan_that_aliases_its_caches_gets_one_address_per_cache(bindings):
    b = bindings["True"]
    assert b["runs"] == 2
    for cache in ("key_0", "value_0"):
        assert b["addresses"][f"present_{cache}"] == b["addresses"][f"past_{cache}"]  # read and written in place
        assert b["out"][f"present_{cache}"] == b["addresses"][f"past_{cache}"]  # the updated cache comes back
    assert b["allocators"] == ["logits", "logits"]  # only the plain output gets its own buffer


def test_a_plan_that_does_not_alias_them_writes_present_apart(bindings):
    b = bindings["False"]  # a plugin plan: TensorRT reports no alias, the output is an ordinary one
    assert set(b["allocators"]) == {"logits", "present_key_0", "present_value_0"}
    assert "present_key_0" not in b["addresses"] and b["out"]["present_key_0"] != b["addresses"]["past_key_0"]


class Recorded:
    def __init__(self, addresses, aliases):
        self.addresses, self.aliases = addresses, aliases

    def get_tensor_address(self, name):
        return self.addresses[name]

    def get_aliased_input_tensor(self, name):
        return self.aliases.get(name)


def test_a_runner_that_binds_an_aliased_cache_apart_is_refused():
    both = Recorded({"past_key_0": 0x5000, "present_key_0": 0x7000}, {"present_key_0": "past_key_0"})
    with pytest.raises(HiggsError, match="bound present_key_0 apart from past_key_0, which the plan aliases"):
        check_cache_binding(both, both, ["past_key_0"])
    plugin = Recorded({"past_key_0": 0x5000, "present_key_0": 0x7000}, {})
    check_cache_binding(plugin, plugin, ["past_key_0"])  # not aliased: apart is right
