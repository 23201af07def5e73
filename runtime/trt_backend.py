"""TensorRT backend: `lm.plan` (profile 0 prefill, profile 1 decode step) and `codec.plan`, driven through
cuda-python on one non-default stream.

Buffers are allocated once per batch size: device inputs sized for the longest prompt, pinned host staging
for inputs and outputs, and one device buffer per KV cache bound to both its input (`past_*`) and its aliased
output (`present_*`), so TensorRT's KV-cache layer updates it in place. A decode step is captured in a CUDA
graph per batch size (host→device copies of the step inputs, the enqueue, device→host copies of logits and
codes), replayed with one launch; when capture is refused the step falls back to a plain enqueue. The loop reads
each row's codes on the host (its stopping rules need them), so a step ends with one stream synchronisation.

Not run on any machine available to this project: datacenter TensorRT cannot be installed here and
TensorRT-RTX does not run on Hopper. See README, "Verified / not verified here".
"""

import numpy as np

from . import cuda, trt_shim
from .decoding import NUM_CODEBOOKS, SAMPLES_PER_FRAME
from .errors import HiggsError
from .manifest import EngineDir

NUMPY = {"int32": np.int32, "int64": np.int64, "bool": np.bool_, "float32": np.float32, "bfloat16": np.uint16}


def flavour_for(build: dict, requested: str) -> str:
    if build["builder"] == "tensorrt-rtx":
        return "rtx"  # RTX plans run only in TensorRT-RTX (consumer GPUs of the target's compute capability)
    if requested == "lean" and not build["lean"]:
        raise HiggsError("these plans were not built with --lean; tensorrt_lean cannot load them")
    return requested


class TrtBackend:
    name = "trt"

    def __init__(self, engine: EngineDir, flavour: str = "tensorrt"):
        m = engine.manifest
        if "engines" not in m:
            raise HiggsError(f"{engine.path}: no TensorRT engines; build them with `higgs-trt build`")
        if m["build"].get("plugins", "").startswith("build-only"):
            raise HiggsError(f"{engine.path}: its plugins are TensorRT-RTX build-only twins (a CI build check); "
                             "build with datacenter TensorRT to run --ops plugin engines")
        self.trt = trt = trt_shim.load(flavour_for(m["build"], flavour))
        if cuda.device_count() == 0:
            raise HiggsError("the TensorRT backend needs an NVIDIA GPU (none visible to CUDA)")
        self.max_seq, self.max_batch = m["limits"]["max_seq"], m["limits"]["max_batch"]
        self.max_prompt = m["limits"]["max_prompt"]
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
        for name in self.caches:
            out = name.replace("past_", "present_")
            if self.lm_engine.get_aliased_input_tensor(out) != name:
                raise HiggsError(f"{engine.path}: {out} is not aliased to {name} in lm.plan; rebuild")
        self.batch = None
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

    def start(self, batch: int) -> None:
        if batch != self.batch:
            self._lm_buffers(batch)
        for buffer in self.cache_buffers.values():
            buffer.zero(self.stream)
        self.profile = None
        self.shapes: dict[str, tuple] = {}
        self.graph = None  # captured afresh for each utterance, after the prefill's profile switch

    def _lm_buffers(self, batch: int) -> None:
        """Device inputs sized for the longest prompt, pinned staging, caches, outputs: once per batch size."""
        sizes = {"batch": batch, "seq": self.max_prompt}
        self.inputs, self.staging = {}, {}
        for t in self.lm_io["inputs"]:
            if t["name"] in self.caches:
                continue
            shape = tuple(d if isinstance(d, int) else sizes[d] for d in t["shape"])
            self.inputs[t["name"]] = cuda.DeviceArray(shape, NUMPY[t["dtype"]])
            self.staging[t["name"]] = cuda.PinnedArray(shape, NUMPY[t["dtype"]])
        cache = next(t for t in self.lm_io["inputs"] if t["name"] in self.caches)
        shape = (batch, *cache["shape"][1:])
        self.cache_buffers = {n: cuda.DeviceArray(shape, NUMPY[cache["dtype"]]) for n in self.caches}
        self.outputs, self.results = {}, {}
        for t in self.lm_io["outputs"]:
            if t["name"].startswith("present_"):
                continue
            shape = (batch, *t["shape"][1:])
            self.outputs[t["name"]] = cuda.DeviceArray(shape, NUMPY[t["dtype"]])
            self.results[t["name"]] = cuda.PinnedArray(shape, NUMPY[t["dtype"]])
        self.graph_refused = False
        self.batch = batch

    def _bind(self, profile: int, feeds: dict[str, np.ndarray]) -> None:
        ctx = self.lm_context
        if profile != self.profile:
            if not ctx.set_optimization_profile_async(profile, self.stream.ptr):
                raise HiggsError(f"lm.plan: cannot select optimization profile {profile}")
            self.profile, self.shapes = profile, {}
            for name, buffer in {**self.inputs, **self.outputs}.items():
                ctx.set_tensor_address(name, buffer.ptr)
            for name, buffer in self.cache_buffers.items():
                ctx.set_tensor_address(name, buffer.ptr)
                ctx.set_tensor_address(name.replace("past_", "present_"), buffer.ptr)  # aliased: updated in place
        for name, value in feeds.items():
            if self.shapes.get(name) != value.shape:
                if not ctx.set_input_shape(name, value.shape):
                    raise HiggsError(f"lm.plan: input {name} of shape {value.shape} is outside profile {profile}")
                self.shapes[name] = value.shape
        for name, buffer in self.cache_buffers.items():
            if name not in self.shapes:
                ctx.set_input_shape(name, buffer.shape)
                self.shapes[name] = buffer.shape

    def _enqueue_step(self, feeds: dict[str, np.ndarray]) -> bool:
        """Copies in, the engine, copies out: all async on our stream (capturable)."""
        for name, value in feeds.items():
            cuda.copy_async(self.inputs[name].ptr, self.staging[name].ptr, value.nbytes, self.stream)
        if not self.lm_context.execute_async_v3(self.stream.ptr):
            return False
        for name, buffer in self.outputs.items():
            cuda.copy_async(self.results[name].ptr, buffer.ptr, buffer.nbytes, self.stream)
        return True

    def lm(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        seq = feeds["input_ids"].shape[1]
        if seq > self.max_prompt:
            raise HiggsError(f"prompt of {seq} tokens; this engine's prefill takes at most {self.max_prompt}")
        decode = seq == 1
        profile = self.decode_profile if decode else self.prefill_profile
        for name, value in feeds.items():  # staged in pinned memory, packed as the engine sees [B, S, ...]
            self.staging[name].array.reshape(-1)[: value.size] = value.reshape(-1)
        self._bind(profile, feeds)
        if decode and self.graph is not None:
            self.graph.launch()
        elif not self._enqueue_step(feeds):
            raise HiggsError(f"lm.plan: enqueue failed ({'; '.join(self.logger.errors) or 'unknown error'})")
        elif decode and not self.graph_refused:
            self._capture(feeds)  # after one plain enqueue at these shapes, as trtexec does
        self.stream.synchronize()
        return self.results["logits"].array, self.results["codes"].array

    def _capture(self, feeds: dict[str, np.ndarray]) -> None:
        self.stream.synchronize()
        try:
            self.graph = cuda.Graph(self.stream, lambda: self._enqueue_step(feeds))
        except HiggsError:
            self.graph_refused = True  # plain enqueue from now on

    # ---- codec ------------------------------------------------------------------------------------------------

    def _codec_buffers(self) -> None:
        codes, samples = (self.max_batch, NUM_CODEBOOKS, self.max_seq), (self.max_batch, 1, SAMPLES_PER_FRAME * self.max_seq)
        self.codec_in, self.codec_in_host = cuda.DeviceArray(codes, np.int32), cuda.PinnedArray(codes, np.int32)
        self.codec_out, self.codec_out_host = cuda.DeviceArray(samples, np.float32), cuda.PinnedArray(samples, np.float32)
        out = self.codec_io["outputs"][0]["name"]
        self.codec_context.set_tensor_address("codes", self.codec_in.ptr)
        self.codec_context.set_tensor_address(out, self.codec_out.ptr)

    def codec(self, codes: np.ndarray) -> np.ndarray:
        b, n, t = codes.shape
        if b > self.max_batch or t > self.max_seq:
            raise HiggsError(f"codec input {codes.shape} exceeds the engine's bounds "
                             f"({self.max_batch}, {NUM_CODEBOOKS}, {self.max_seq})")
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
