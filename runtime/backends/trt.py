"""TensorRT backend: `lm.plan` (profile 0 prefill, profile 1 decode step) and `codec.plan`, driven through
cuda-python on one non-default stream.

An engine graph for runtime/stepper.py: `lm(feeds, slot=None)` runs a prefill into slot `slot` (batch 1, the cache
bound at that slot's address) or a step over the first B slots. Buffers are allocated once, for max_batch slots (the
caller's number, at most the plan's): device inputs sized for the longest prompt, pinned host staging for inputs and
outputs, and the KV caches (`KvCaches`: one buffer per cache, updated in place). A decode step is captured in a CUDA
graph per batch size (host→device copies of the step inputs, the enqueue, device→host copies of logits and codes),
replayed with one launch; when capture is refused the step falls back to a plain enqueue. The stepper chooses each
row on the host (greedy codes come from the graph; sampling needs the logits), so a step ends with one stream
synchronisation. The codec decodes windows of at most CODEC_MAX_FRAMES frames, up to max_batch of them at once.

Not run on any machine available to this project: datacenter TensorRT cannot be installed here and
TensorRT-RTX does not run on Hopper. docs/tensorrt.md says what is exercised and how.
"""

import numpy as np

from higgs_trt.runtime import cuda, trt_shim
from higgs_trt.runtime.decoding import CODEC_MAX_FRAMES, NUM_CODEBOOKS, SAMPLES_PER_FRAME
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.manifest import EngineDir

NUMPY = {"int32": np.int32, "int64": np.int64, "bool": np.bool_, "float32": np.float32, "bfloat16": np.uint16}


def flavour_for(build: dict, requested: str) -> str:
    if build["builder"] == "tensorrt-rtx":
        return "rtx"  # RTX plans run only in TensorRT-RTX (consumer GPUs of the target's compute capability)
    if requested == "lean" and not build["lean"]:
        raise HiggsError("these plans were not built with --lean; tensorrt_lean cannot load them")
    return requested


class KvCaches:
    """The lm's KV caches, [slots, Hkv, S_max, D] each: one buffer per cache, bound to both `past_*` and
    `present_*`, so every step updates it in place.

    The native path's KV-cache layer requires that: the cache and its output "must share the same device memory
    address" (NvInfer.h, addKVCacheUpdate). The plugin path's rope_kv_write never reads its cache inputs and writes
    only the new rows through its `present_*` outputs, which declare no alias (a declared alias lets TensorRT copy
    the whole cache: docs/tensorrt.md), so bound at `past_*`'s address it updates the cache in place too, as
    TensorRT-Edge-LLM binds its attention plugin's caches.

    A step binds a range of slots [first, first + count): addresses offset by `first` whole slots, batch `count`.
    `alloc` is the CUDA layer's allocation (runtime/cuda.py); tests pass a recording stand-in.
    """

    def __init__(self, names: list[str], shape: tuple, dtype, alloc=None):
        alloc = alloc or cuda.DeviceArray
        self.names, self.shape = list(names), tuple(shape)
        self.slot_bytes = int(np.prod(self.shape[1:])) * np.dtype(dtype).itemsize
        self.buffers = {n: alloc(self.shape, dtype) for n in self.names}
        self._bound = None

    def zero(self, stream) -> None:
        for buffer in self.buffers.values():
            buffer.zero(stream)

    def bind(self, ctx, first: int = 0, count: int | None = None, force: bool = False) -> None:
        """Bind `past_*` and `present_*` of slots [first, first + count) on `ctx` (skipped when nothing changed and
        not `force`, e.g. after a profile switch)."""
        count = self.shape[0] - first if count is None else count
        if not (0 <= first and 0 < count and first + count <= self.shape[0]):
            raise HiggsError(f"KV cache slots {first}..{first + count - 1} outside 0..{self.shape[0] - 1}")
        key = (id(ctx), first, count)
        if not force and key == self._bound:
            return
        offset, shape = first * self.slot_bytes, (count, *self.shape[1:])
        for name in self.names:
            ctx.set_tensor_address(name, self.buffers[name].ptr + offset)
            ctx.set_tensor_address(name.replace("past_", "present_"), self.buffers[name].ptr + offset)
            if not ctx.set_input_shape(name, shape):
                raise HiggsError(f"lm.plan: cache {name} of shape {shape} is outside the active profile")
        self._bound = key


class TrtLm:
    """lm.plan on one execution context: prefills on its prefill profile, decode steps on its decode profile.

    After every profile switch the first call is a plain enqueue, never a graph replay: the switch "will trigger
    layer resource updates on the next call of executeV2()/enqueueV3()" (NvInferRuntime.h,
    IExecutionContext::setOptimizationProfileAsync), and a graph launch is not such a call. One context (one
    activation memory block) rather than one per profile as TensorRT-Edge-LLM's runner keeps: the price is one
    ungraphed step after each prefill.
    """

    def __init__(self, lm_engine, io: dict, profiles: list[str], max_batch: int, max_prompt: int, stream, logger):
        self.stream, self.logger = stream, logger
        self.max_batch, self.max_prompt = max_batch, max_prompt
        self.prefill_profile, self.decode_profile = profiles.index("prefill"), profiles.index("decode")
        self.lm_context = lm_engine.create_execution_context()
        self.caches = [t["name"] for t in io["inputs"] if t["name"].startswith("past_")]
        sizes = {"batch": max_batch, "seq": max_prompt}
        self.inputs, self.staging = {}, {}
        for t in io["inputs"]:
            if t["name"] in self.caches:
                continue
            shape = tuple(d if isinstance(d, int) else sizes[d] for d in t["shape"])
            self.inputs[t["name"]] = cuda.DeviceArray(shape, NUMPY[t["dtype"]])
            self.staging[t["name"]] = cuda.PinnedArray(shape, NUMPY[t["dtype"]])
        cache = next(t for t in io["inputs"] if t["name"] in self.caches)
        self.kv = KvCaches(self.caches, (max_batch, *cache["shape"][1:]), NUMPY[cache["dtype"]])
        self.kv.zero(stream)
        self.outputs, self.results = {}, {}
        for t in io["outputs"]:
            if t["name"].startswith("present_"):
                continue
            shape = (max_batch, *t["shape"][1:])
            self.outputs[t["name"]] = cuda.DeviceArray(shape, NUMPY[t["dtype"]])
            self.results[t["name"]] = cuda.PinnedArray(shape, NUMPY[t["dtype"]])
        self.profile, self.shapes, self.switched = None, {}, False
        self.graphs: dict[int, cuda.Graph] = {}  # batch → decode step
        self.graph_refused = False

    def _bind(self, profile: int, feeds: dict[str, np.ndarray], first: int, count: int) -> None:
        """Profile, addresses and shapes for this call on slots [first, first + count)."""
        ctx = self.lm_context
        switch = profile != self.profile
        if switch:
            if not ctx.set_optimization_profile_async(profile, self.stream.ptr):
                raise HiggsError(f"lm.plan: cannot select optimization profile {profile}")
            self.profile, self.shapes, self.switched = profile, {}, True
            for name, buffer in {**self.inputs, **self.outputs}.items():
                ctx.set_tensor_address(name, buffer.ptr)
        for name, value in feeds.items():
            if self.shapes.get(name) != value.shape:
                if not ctx.set_input_shape(name, value.shape):
                    raise HiggsError(f"lm.plan: input {name} of shape {value.shape} is outside profile {profile}")
                self.shapes[name] = value.shape
        self.kv.bind(ctx, first, count, force=switch)

    def _enqueue_step(self, feeds: dict[str, np.ndarray], rows: int) -> bool:
        """Copies in, the engine, copies out of `rows` rows: all async on our stream (capturable)."""
        for name, value in feeds.items():
            cuda.copy_async(self.inputs[name].ptr, self.staging[name].ptr, value.nbytes, self.stream)
        if not self.lm_context.execute_async_v3(self.stream.ptr):
            return False
        for name, buffer in self.outputs.items():
            cuda.copy_async(self.results[name].ptr, buffer.ptr, buffer.nbytes // self.max_batch * rows, self.stream)
        return True

    def run(self, feeds: dict[str, np.ndarray], slot: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One call on slot `slot` (batch 1, its cache bound at that slot's address), or on the first B slots."""
        b, seq = feeds["input_ids"].shape
        if seq > self.max_prompt:
            raise HiggsError(f"prompt of {seq} tokens; this engine's prefill takes at most {self.max_prompt}")
        decode = seq == 1 and slot is None
        for name, value in feeds.items():  # staged in pinned memory, packed as the engine sees [B, S, ...]
            self.staging[name].array.reshape(-1)[: value.size] = value.reshape(-1)
        self._bind(self.decode_profile if seq == 1 else self.prefill_profile, feeds, 0 if slot is None else slot, b)
        if decode and b in self.graphs and not self.switched:
            self.graphs[b].launch()
        elif not self._enqueue_step(feeds, b):
            raise HiggsError(f"lm.plan: enqueue failed ({'; '.join(self.logger.errors) or 'unknown error'})")
        else:
            self.switched = False
            if decode and b not in self.graphs and not self.graph_refused:
                self._capture(b, feeds)  # after one plain enqueue at these shapes, as trtexec does
        self.stream.synchronize()
        return self.results["logits"].array[:b], self.results["codes"].array[:b]

    def _capture(self, batch: int, feeds: dict[str, np.ndarray]) -> None:
        """The graph freezes the addresses it saw: one per batch size (the caches of slots 0..batch-1)."""
        self.stream.synchronize()
        try:
            self.graphs[batch] = cuda.Graph(self.stream, lambda: self._enqueue_step(feeds, batch))
        except HiggsError:
            self.graph_refused = True  # plain enqueue from now on


class TrtBackend:
    name = "trt"

    def __init__(self, engine: EngineDir, flavour: str = "tensorrt", max_batch: int | None = None):
        m = engine.manifest
        if "engines" not in m:
            raise HiggsError(f"{engine.path}: no TensorRT engines; build them with `higgs-trt build`")
        if m["build"].get("plugins", "").startswith("build-only"):
            raise HiggsError(f"{engine.path}: its plugins are TensorRT-RTX build-only twins (a CI build check); "
                             "build with datacenter TensorRT to run --ops plugin engines")
        trt = trt_shim.load(flavour_for(m["build"], flavour))
        problem = cuda.gpu_problem()
        if problem:
            raise HiggsError(f"the TensorRT backend needs an NVIDIA GPU: {problem}")
        limits = m["limits"]
        self.max_seq, self.max_batch = limits["max_seq"], min(max_batch or limits["max_batch"], limits["max_batch"])
        self.max_prompt = limits["max_prompt"]
        self.codec_strides = tuple(m["codec"]["strides"])
        self.stream = cuda.Stream()
        self.logger = trt_shim.make_logger(trt)
        self.runtime = trt.Runtime(self.logger)
        lm_io = m["graphs"][m["engines"]["lm"]["graph"]]
        self.codec_io = m["graphs"]["codec"]
        self.lm_engine = self._load(engine, "lm", lm_io)
        self.codec_engine = self._load(engine, "codec", self.codec_io)
        self.codec_context = self.codec_engine.create_execution_context()
        self.lm_runner = TrtLm(self.lm_engine, lm_io, [p["name"] for p in m["engines"]["lm"]["profiles"]],
                               self.max_batch, self.max_prompt, self.stream, self.logger)
        self._codec_buffers()

    def _load(self, engine: EngineDir, key: str, io: dict):
        plan = (engine.path / engine.manifest["engines"][key]["file"]).read_bytes()
        loaded = self.runtime.deserialize_cuda_engine(plan)
        if loaded is None:
            raise HiggsError(f"{engine.path}: cannot load {key} plan ({'; '.join(self.logger.errors) or 'unknown error'}); "
                             "built by another TensorRT version or for another GPU?")
        want = {t["name"]: t["dtype"] for t in io["inputs"] + io["outputs"]}
        got = {loaded.get_tensor_name(i) for i in range(loaded.num_io_tensors)}
        if got != set(want):
            raise HiggsError(f"{engine.path}: {key} plan I/O {sorted(got)} differs from the manifest's")
        return loaded

    def lm(self, feeds: dict[str, np.ndarray], slot: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.lm_runner.run(feeds, slot)

    # ---- codec ------------------------------------------------------------------------------------------------

    def _codec_buffers(self) -> None:
        frames = CODEC_MAX_FRAMES
        codes, samples = (self.max_batch, NUM_CODEBOOKS, frames), (self.max_batch, 1, SAMPLES_PER_FRAME * frames)
        self.codec_in, self.codec_in_host = cuda.DeviceArray(codes, np.int32), cuda.PinnedArray(codes, np.int32)
        self.codec_out, self.codec_out_host = cuda.DeviceArray(samples, np.float32), cuda.PinnedArray(samples, np.float32)
        out = self.codec_io["outputs"][0]["name"]
        self.codec_context.set_tensor_address("codes", self.codec_in.ptr)
        self.codec_context.set_tensor_address(out, self.codec_out.ptr)

    def codec(self, codes: np.ndarray) -> np.ndarray:
        b, n, t = codes.shape
        if t > CODEC_MAX_FRAMES:
            raise HiggsError(f"codec call of {t} frames; codec.plan decodes windows of at most {CODEC_MAX_FRAMES} "
                             "frames (CODEC_MAX_FRAMES)")
        if b > self.max_batch:
            raise HiggsError(f"codec call of {b} windows; buffers hold {self.max_batch}")
        packed = self.codec_in_host.array.reshape(-1)[: codes.size].reshape(codes.shape)
        packed[...] = codes
        cuda.copy_async(self.codec_in.ptr, self.codec_in_host.ptr, codes.nbytes, self.stream)
        if not self.codec_context.set_input_shape("codes", codes.shape):
            raise HiggsError(f"codec.plan: input shape {codes.shape} is outside its profile")
        if not self.codec_context.execute_async_v3(self.stream.ptr):
            raise HiggsError(f"codec.plan: enqueue failed ({'; '.join(self.logger.errors) or 'unknown error'})")
        samples = b * SAMPLES_PER_FRAME * t
        cuda.copy_async(self.codec_out_host.ptr, self.codec_out.ptr, samples * 4, self.stream)
        self.stream.synchronize()
        return self.codec_out_host.array.reshape(-1)[:samples].reshape(b, 1, SAMPLES_PER_FRAME * t).copy()
