"""How the TensorRT backend binds the KV caches and orders its work, without TensorRT or a GPU.

A real execution context cannot run here, so these tests drive the backend against thin fake contexts that only
record what they are given: the addresses and shapes (`KvCaches`), and the order of profile switches, enqueues and
CUDA-graph launches (`TrtBackend.lm`). This is the one place a fake is right: what is checked is what a context is
told, which it takes as given. The CUDA layer is replaced by recording stand-ins.
"""

import numpy as np
import pytest

from higgs_trt.runtime.backends.trt import KvCaches
from higgs_trt.runtime.errors import HiggsError

NAMES = ["past_key_0", "past_value_0", "past_key_1", "past_value_1"]
SHAPE = (4, 2, 160, 16)  # slots, Hkv, S_max, D
SLOT = 2 * 160 * 16 * 2  # bytes of one slot of one bf16 cache


class FakeContext:
    def __init__(self):
        self.addresses, self.shapes, self.calls = {}, {}, 0

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        self.calls += 1
        return True

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True


class Allocations:
    """Recording stand-in for cuda.DeviceArray: distinct fake addresses."""

    def __init__(self):
        self.next, self.zeroed = 1 << 32, []

    def alloc(self, shape, dtype):
        me = self

        class Buffer:
            ptr = me.next

            def zero(self, stream):
                me.zeroed.append(self.ptr)

        self.next += 1 << 30
        return Buffer()


def caches():
    mem = Allocations()
    return KvCaches(NAMES, SHAPE, np.uint16, alloc=mem.alloc), mem


def test_past_and_present_are_bound_to_one_buffer_per_cache():
    kv, _ = caches()
    ctx = FakeContext()
    seen = []
    for _ in range(3):
        kv.bind(ctx, 0, 4)
        seen.append(dict(ctx.addresses))
    for name in NAMES:
        present = name.replace("past_", "present_")
        assert len({s[name] for s in seen}) == 1  # the same buffer every step
        assert all(s[present] == s[name] for s in seen)  # present_* at past_*'s address: updated in place
        assert ctx.shapes[name] == SHAPE
    assert len({seen[0][n] for n in NAMES}) == len(NAMES)
    assert ctx.calls == 2 * len(NAMES)  # bound once: unchanged bindings are not set again


def test_a_slot_range_is_an_address_offset_and_a_batch():
    kv, _ = caches()
    ctx = FakeContext()
    kv.bind(ctx, 0, 4)
    base = dict(ctx.addresses)
    kv.bind(ctx, 2, 1)  # e.g. a prefill into slot 2
    for name in NAMES:
        assert ctx.addresses[name] == ctx.addresses[name.replace("past_", "present_")] == base[name] + 2 * SLOT
        assert ctx.shapes[name] == (1, *SHAPE[1:])
    with pytest.raises(HiggsError, match="outside 0..3"):
        kv.bind(ctx, 3, 2)


def test_a_forced_bind_sets_the_addresses_again_and_zero_clears_every_buffer():
    kv, mem = caches()
    ctx = FakeContext()
    kv.bind(ctx, 0, 4)
    kv.bind(ctx, 0, 4, force=True)  # after a profile switch the context needs them again
    assert ctx.calls == 4 * len(NAMES)
    kv.zero(None)
    assert sorted(mem.zeroed) == sorted(b.ptr for b in kv.buffers.values())


# ---- the lm's execution order across profile switches, through TrtBackend with TensorRT and CUDA stood in ----------

CACHE = [1, 2, 16, 8]  # batch, Hkv, S_max, D
LM_IO = {"inputs": [{"name": "input_ids", "dtype": "int32", "shape": ["batch", "seq"]},
                    {"name": "audio_codes", "dtype": "int32", "shape": ["batch", "seq", 8]},
                    {"name": "is_audio", "dtype": "bool", "shape": ["batch", "seq"]},
                    *({"name": n, "dtype": "int64", "shape": ["batch"]}
                      for n in ("write_pos", "new_len", "row_index", "end_frame")),
                    *({"name": n, "dtype": "bfloat16", "shape": ["batch", *CACHE[1:]]}
                      for n in ("past_key_0", "past_value_0"))],
         "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 8, 1026]},
                     {"name": "codes", "dtype": "int32", "shape": ["batch", 8]},
                     *({"name": n, "dtype": "bfloat16", "shape": ["batch", *CACHE[1:]]}
                       for n in ("present_key_0", "present_value_0"))]}
CODEC_IO = {"inputs": [{"name": "codes", "dtype": "int32", "shape": ["batch", 8, "frames"]}],
            "outputs": [{"name": "audio", "dtype": "float32", "shape": ["batch", 1, "samples"]}]}


class Calls(list):
    """What the execution context and the CUDA graphs were asked to do, in order."""
    capturing = False


def stand_ins(monkeypatch, calls: Calls):
    """A `tensorrt` module whose engines hand out recording contexts, and the CUDA layer (runtime/cuda.py) as
    host memory and records: only the order of TensorRT and graph calls is under test."""
    import enum
    import types

    from higgs_trt.runtime import cuda, trt_shim

    class Context:
        def set_optimization_profile_async(self, index, stream):
            calls.append(f"profile {index}")
            return True

        def set_input_shape(self, name, shape):
            return True

        def set_tensor_address(self, name, ptr):
            return True

        def execute_async_v3(self, stream):
            calls.append("capture" if calls.capturing else "enqueue")
            return True

    class Engine:
        def __init__(self, io):
            self.names = [t["name"] for t in io["inputs"] + io["outputs"]]
            self.num_io_tensors = len(self.names)

        def get_tensor_name(self, i):
            return self.names[i]

        def get_aliased_input_tensor(self, name):
            return name.replace("present_", "past_") if name.startswith("present_") else None

        def create_execution_context(self):
            return Context()

    class ILogger:
        Severity = enum.IntEnum("Severity", ["INTERNAL_ERROR", "ERROR", "WARNING", "INFO", "VERBOSE"], start=0)

        def __init__(self):
            pass

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, plan):
            return Engine(LM_IO if plan == b"lm" else CODEC_IO)

    class Memory:
        next = 1 << 32

        def __init__(self, shape, dtype):
            self.array = np.zeros(shape, dtype)
            self.nbytes, self.ptr = self.array.nbytes, Memory.next
            Memory.next += 1 << 30

        def zero(self, stream):
            pass

    class Graph:
        def __init__(self, stream, enqueue):
            calls.capturing = True
            try:
                assert enqueue()
            finally:
                calls.capturing = False

        def launch(self):
            calls.append("replay")

    trt = types.SimpleNamespace(ILogger=ILogger, Runtime=Runtime, __version__="11.4.0.106")
    monkeypatch.setattr(trt_shim, "load", lambda kind: trt)
    monkeypatch.setattr(cuda, "gpu_problem", lambda: None)
    monkeypatch.setattr(cuda, "Stream", lambda: types.SimpleNamespace(ptr=7, synchronize=lambda: None))
    monkeypatch.setattr(cuda, "DeviceArray", Memory)
    monkeypatch.setattr(cuda, "PinnedArray", Memory)
    monkeypatch.setattr(cuda, "copy_async", lambda dst, src, nbytes, stream: None)
    monkeypatch.setattr(cuda, "Graph", Graph)


def engine_dir(tmp_path):
    import types

    (tmp_path / "lm.plan").write_bytes(b"lm")
    (tmp_path / "codec.plan").write_bytes(b"codec")
    manifest = {"engines": {"lm": {"file": "lm.plan", "graph": "lm",
                                   "profiles": [{"name": "prefill"}, {"name": "decode"}]},
                            "codec": {"file": "codec.plan", "graph": "codec"}},
                "build": {"builder": "tensorrt", "lean": False, "target": "local-gpu"},
                "limits": {"max_seq": CACHE[2], "max_batch": 2, "max_prompt": 8},
                "codec": {"strides": [8, 5, 4, 2, 3]}, "graphs": {"lm": LM_IO, "codec": CODEC_IO}}
    return types.SimpleNamespace(path=tmp_path, manifest=manifest)


def test_the_first_step_after_every_profile_switch_is_an_enqueue_never_a_replay(monkeypatch, tmp_path):
    """NvInferRuntime.h, setOptimizationProfileAsync: a switch "will trigger layer resource updates on the next call
    of executeV2()/enqueueV3()"; a CUDA-graph launch is not such a call, so replaying a step captured before a
    prefill would run with the prefill profile's state."""
    from higgs_trt.runtime.backends.trt import TrtBackend
    from higgs_trt.runtime.generate import NO_END, step_feeds

    calls = Calls()
    stand_ins(monkeypatch, calls)
    backend = TrtBackend(engine_dir(tmp_path))
    prefill = {"input_ids": np.zeros((1, 5), np.int32), "audio_codes": np.zeros((1, 5, 8), np.int32),
               "is_audio": np.zeros((1, 5), bool), "write_pos": np.zeros(1, np.int64), "new_len": np.full(1, 5),
               "row_index": np.zeros(1, np.int64), "end_frame": np.full(1, NO_END)}
    order = []
    for row, call in enumerate(["prefill", "step", "step", "prefill", "step", "step"]):
        before = len(calls)
        if call == "prefill":
            backend.lm(prefill, slot=0)
        else:
            backend.lm(step_feeds(np.zeros((1, 8), np.int32), [5 + row], row, [NO_END]))
        order.append((call, calls[before:]))
    assert order == [("prefill", ["profile 0", "enqueue"]), ("step", ["profile 1", "enqueue", "capture"]),
                     ("step", ["replay"]), ("prefill", ["profile 0", "enqueue"]), ("step", ["profile 1", "enqueue"]),
                     ("step", ["replay"])]
