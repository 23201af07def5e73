"""TensorRT backend: `lm.plan` (profile 0 prefill, profile 1 decode step) and `codec.plan`, driven through
cuda-python on one non-default stream.

An engine graph for runtime/stepper.py: `lm(feeds, slot=None)` runs a prefill into slot `slot` (batch 1, the cache
bound at that slot's address) or a step over the first B slots. Buffers are allocated once, for max_batch slots (the
caller's number, at most the plan's): device inputs sized for the longest prompt, pinned host staging for inputs and
outputs, and the KV caches (`KvCaches`: one buffer per cache when the plan aliases `present_*` to `past_*`, two in
ping-pong when it does not). A decode step is captured in a CUDA graph per batch size and cache side (host→device
copies of the step inputs, the enqueue, device→host copies of logits and codes), replayed with one launch; when
capture is refused the step falls back to a plain enqueue. The stepper chooses each row on the host (greedy codes
come from the graph; sampling needs the logits), so a step ends with one stream synchronisation. The codec decodes
windows of at most CODEC_MAX_FRAMES frames, up to max_batch of them at once.

Not run on any machine available to this project: datacenter TensorRT cannot be installed here and
TensorRT-RTX does not run on Hopper. See README, "Verified / not verified here".
"""

import sys

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
    """The lm's KV caches, [slots, Hkv, S_max, D] each, and how they are bound on an execution context.

    Aliased: the plan reports `present_*` as an alias of `past_*` (TensorRT's KV-cache layer does, and then needs
    both at one address: NvInfer.h, addKVCacheUpdate). One buffer per cache, bound to both names, updated in place.
    Not aliased: plugin plans. TensorRT reports no alias for plugin I/O (getAliasedInputTensor names operations such
    as KVCacheUpdate; NvInferRuntime.h) and, for an aliased plugin input, "may insert copies"
    (IPluginV3OneBuildV2::getAliasedInput), so `present_*` is an output like any other. Two buffers per cache:
    `past_*` reads one, `present_*` is written to the other, and the slots a step wrote then live on that side
    (ping-pong). Slots are tracked one by one, so steps over different slot ranges stay consistent.

    A step binds a range of slots [first, first + count): addresses offset by `first` whole slots, batch `count`.
    `alloc` and `copy` are the CUDA layer (runtime/cuda.py); tests pass recording stand-ins.
    """

    def __init__(self, names: list[str], shape: tuple, dtype, aliased: bool, alloc=None, copy=None):
        alloc = alloc or cuda.DeviceArray
        self.names, self.shape, self.aliased = list(names), tuple(shape), aliased
        self.slot_bytes = int(np.prod(self.shape[1:])) * np.dtype(dtype).itemsize
        self.buffers = {n: [alloc(self.shape, dtype) for _ in range(1 if aliased else 2)] for n in self.names}
        self.side = np.zeros(self.shape[0], np.int64)  # per slot: the buffer that holds its cache
        self.copy = copy or cuda.copy_async
        self._bound = self._written = None

    def zero(self, stream) -> None:
        for sides in self.buffers.values():
            for buffer in sides:
                buffer.zero(stream)
        self.side[:] = 0

    def bind(self, ctx, stream, first: int = 0, count: int | None = None, force: bool = False) -> int:
        """Bind `past_*` / `present_*` of slots [first, first + count) on `ctx` (skipped when nothing changed and
        not `force`, e.g. after a profile switch). Returns the side read, which a captured CUDA graph depends on."""
        count = self.shape[0] - first if count is None else count
        if not (0 <= first and 0 < count and first + count <= self.shape[0]):
            raise HiggsError(f"KV cache slots {first}..{first + count - 1} outside 0..{self.shape[0] - 1}")
        read = int(self.side[first])
        for slot in np.nonzero(self.side[first:first + count] != read)[0] + first:
            self._move(int(slot), read, stream)  # a slot last written on the other side joins this range's side
        write = read if self.aliased else 1 - read
        key = (id(ctx), first, count, read)
        if force or key != self._bound:
            offset, shape = first * self.slot_bytes, (count, *self.shape[1:])
            for name in self.names:
                present = name.replace("past_", "present_")
                ctx.set_tensor_address(name, self.buffers[name][read].ptr + offset)
                ctx.set_tensor_address(present, self.buffers[name][write].ptr + offset)
                if not ctx.set_input_shape(name, shape):
                    raise HiggsError(f"lm.plan: cache {name} of shape {shape} is outside the active profile")
            self._bound = key
        self._written = (first, count, write)
        return read

    def advance(self) -> None:
        """After the bound step ran: its slots' caches are where it wrote them."""
        first, count, write = self._written
        self.side[first:first + count] = write

    def _move(self, slot: int, to: int, stream) -> None:
        at = slot * self.slot_bytes
        for sides in self.buffers.values():
            self.copy(sides[to].ptr + at, sides[1 - to].ptr + at, self.slot_bytes, stream)
        self.side[slot] = to


class TrtBackend:
    name = "trt"

    def __init__(self, engine: EngineDir, flavour: str = "tensorrt", max_batch: int | None = None):
        m = engine.manifest
        if "engines" not in m:
            raise HiggsError(f"{engine.path}: no TensorRT engines; build them with `higgs-trt build`")
        if m["build"].get("plugins", "").startswith("build-only"):
            raise HiggsError(f"{engine.path}: its plugins are TensorRT-RTX build-only twins (a CI build check); "
                             "build with datacenter TensorRT to run --ops plugin engines")
        self.trt = trt = trt_shim.load(flavour_for(m["build"], flavour))
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
        self.lm_io = m["graphs"][m["engines"]["lm"]["graph"]]
        profiles = [p["name"] for p in m["engines"]["lm"]["profiles"]]
        self.prefill_profile, self.decode_profile = profiles.index("prefill"), profiles.index("decode")
        self.codec_io = m["graphs"]["codec"]
        self.lm_engine = self._load(engine, "lm", self.lm_io)
        self.codec_engine = self._load(engine, "codec", self.codec_io)
        self.lm_context = self.lm_engine.create_execution_context()
        self.codec_context = self.codec_engine.create_execution_context()
        self.caches = [t["name"] for t in self.lm_io["inputs"] if t["name"].startswith("past_")]
        reported = [self.lm_engine.get_aliased_input_tensor(n.replace("past_", "present_")) == n for n in self.caches]
        if any(reported) and not all(reported):
            raise HiggsError(f"{engine.path}: lm.plan aliases only some present_* to their past_*; rebuild")
        self.aliased = all(reported)
        if not self.aliased:
            cache = next(t for t in self.lm_io["inputs"] if t["name"] in self.caches)
            per_slot = len(self.caches) * int(np.prod(cache["shape"][1:])) * np.dtype(NUMPY[cache["dtype"]]).itemsize
            print(f"warning: lm.plan does not alias present_* to past_* (plugin I/O): the KV caches ping-pong "
                  f"between two buffers ({per_slot / 2**20:.0f} MiB more per sequence) and TensorRT may copy each "
                  "whole cache every step", file=sys.stderr)
        self._lm_buffers()
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

    # ---- lm ---------------------------------------------------------------------------------------------------

    def _lm_buffers(self) -> None:
        """Device inputs sized for the longest prompt, pinned staging, caches, outputs: once, for every slot."""
        sizes = {"batch": self.max_batch, "seq": self.max_prompt}
        self.inputs, self.staging = {}, {}
        for t in self.lm_io["inputs"]:
            if t["name"] in self.caches:
                continue
            shape = tuple(d if isinstance(d, int) else sizes[d] for d in t["shape"])
            self.inputs[t["name"]] = cuda.DeviceArray(shape, NUMPY[t["dtype"]])
            self.staging[t["name"]] = cuda.PinnedArray(shape, NUMPY[t["dtype"]])
        cache = next(t for t in self.lm_io["inputs"] if t["name"] in self.caches)
        self.kv = KvCaches(self.caches, (self.max_batch, *cache["shape"][1:]), NUMPY[cache["dtype"]], self.aliased)
        self.kv.zero(self.stream)
        self.outputs, self.results = {}, {}
        for t in self.lm_io["outputs"]:
            if t["name"].startswith("present_"):
                continue
            shape = (self.max_batch, *t["shape"][1:])
            self.outputs[t["name"]] = cuda.DeviceArray(shape, NUMPY[t["dtype"]])
            self.results[t["name"]] = cuda.PinnedArray(shape, NUMPY[t["dtype"]])
        self.profile, self.shapes = None, {}
        self.graphs: dict[tuple[int, int], cuda.Graph] = {}  # (batch, cache side) → decode step
        self.graph_refused = False

    def _bind(self, profile: int, feeds: dict[str, np.ndarray], first: int, count: int) -> int:
        """Addresses and shapes for this call on slots [first, first + count); returns the cache side read."""
        ctx = self.lm_context
        switched = profile != self.profile
        if switched:
            if not ctx.set_optimization_profile_async(profile, self.stream.ptr):
                raise HiggsError(f"lm.plan: cannot select optimization profile {profile}")
            self.profile, self.shapes = profile, {}
            for name, buffer in {**self.inputs, **self.outputs}.items():
                ctx.set_tensor_address(name, buffer.ptr)
        for name, value in feeds.items():
            if self.shapes.get(name) != value.shape:
                if not ctx.set_input_shape(name, value.shape):
                    raise HiggsError(f"lm.plan: input {name} of shape {value.shape} is outside profile {profile}")
                self.shapes[name] = value.shape
        return self.kv.bind(ctx, self.stream, first, count, force=switched)

    def _enqueue_step(self, feeds: dict[str, np.ndarray], rows: int) -> bool:
        """Copies in, the engine, copies out of `rows` rows: all async on our stream (capturable)."""
        for name, value in feeds.items():
            cuda.copy_async(self.inputs[name].ptr, self.staging[name].ptr, value.nbytes, self.stream)
        if not self.lm_context.execute_async_v3(self.stream.ptr):
            return False
        for name, buffer in self.outputs.items():
            cuda.copy_async(self.results[name].ptr, buffer.ptr, buffer.nbytes // self.max_batch * rows, self.stream)
        return True

    def lm(self, feeds: dict[str, np.ndarray], slot: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One call on slot `slot` (batch 1, its cache bound at that slot's address), or on the first B slots."""
        b, seq = feeds["input_ids"].shape
        if seq > self.max_prompt:
            raise HiggsError(f"prompt of {seq} tokens; this engine's prefill takes at most {self.max_prompt}")
        decode = seq == 1 and slot is None
        profile = self.decode_profile if seq == 1 else self.prefill_profile
        for name, value in feeds.items():  # staged in pinned memory, packed as the engine sees [B, S, ...]
            self.staging[name].array.reshape(-1)[: value.size] = value.reshape(-1)
        side = self._bind(profile, feeds, 0 if slot is None else slot, b)
        if decode and (b, side) in self.graphs:
            self.graphs[b, side].launch()
        elif not self._enqueue_step(feeds, b):
            raise HiggsError(f"lm.plan: enqueue failed ({'; '.join(self.logger.errors) or 'unknown error'})")
        elif decode and not self.graph_refused:
            self._capture(b, side, feeds)  # after one plain enqueue at these shapes, as trtexec does
        self.kv.advance()
        self.stream.synchronize()
        return self.results["logits"].array[:b], self.results["codes"].array[:b]

    def _capture(self, batch: int, side: int, feeds: dict[str, np.ndarray]) -> None:
        """The graph freezes the addresses it saw: one per batch and cache side (ping-pong alternates them)."""
        self.stream.synchronize()
        try:
            self.graphs[batch, side] = cuda.Graph(self.stream, lambda: self._enqueue_step(feeds, batch))
        except HiggsError:
            self.graph_refused = True  # plain enqueue from now on

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
