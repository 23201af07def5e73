"""TensorRT runner of `codec_encoder.plan` (reference audio → codes), driven like backends/trt.py drives codec.plan.

A runner of its own so that encoding a reference loads only this plan. Buffers are made per call: a reference is
encoded once (runtime/audio.py caches the codes) and its length varies from call to call.

Not run on any machine available to this project: datacenter TensorRT cannot be installed here and TensorRT-RTX
does not run on Hopper. Checked statically (tests/test_trt_api.py) and the plan is built by TensorRT-RTX in CI.
"""

import numpy as np

from higgs_trt.runtime import cuda, trt_shim
from higgs_trt.runtime.audio import engine_identity
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.manifest import EngineDir

from .trt import flavour_for


class TrtEncoder:
    name = "trt"

    def __init__(self, engine: EngineDir, flavour: str = "tensorrt"):
        m = engine.manifest
        if "codec_encoder" not in m.get("engines", {}):
            raise HiggsError(f"{engine.path}: no codec_encoder.plan; build the engines with `higgs-trt build`")
        trt = trt_shim.load(flavour_for(m["build"], flavour))
        if cuda.device_count() == 0:
            raise HiggsError("the TensorRT backend needs an NVIDIA GPU (none visible to CUDA)")
        self.io = engine.graph("codec_encoder")
        self.geometry = self.io["geometry"]
        self.identity = engine_identity(self.name, engine)
        self.logger = trt_shim.make_logger(trt)
        runtime = trt.Runtime(self.logger)
        self.encoder_engine = runtime.deserialize_cuda_engine((engine.path / m["engines"]["codec_encoder"]["file"]).read_bytes())
        if self.encoder_engine is None:
            raise HiggsError(f"{engine.path}: cannot load codec_encoder.plan ({'; '.join(self.logger.errors) or 'unknown error'})")
        names = {self.encoder_engine.get_tensor_name(i) for i in range(self.encoder_engine.num_io_tensors)}
        if names != {t["name"] for t in self.io["inputs"] + self.io["outputs"]}:
            raise HiggsError(f"{engine.path}: codec_encoder plan I/O {sorted(names)} differs from the manifest's")
        self.encoder_context = self.encoder_engine.create_execution_context()
        self.stream = cuda.Stream()

    def encode(self, audio_24k: np.ndarray, audio_16k: np.ndarray) -> np.ndarray:
        ctx, keep = self.encoder_context, []
        for name, value in (("audio_24k", audio_24k), ("audio_16k", audio_16k)):
            host, device = cuda.PinnedArray(value.shape, np.float32), cuda.DeviceArray(value.shape, np.float32)
            host.array[...] = value
            cuda.copy_async(device.ptr, host.ptr, device.nbytes, self.stream)
            if not ctx.set_input_shape(name, value.shape):
                raise HiggsError(f"codec_encoder.plan: {name} of shape {value.shape} is outside its profile (1–30 s)")
            ctx.set_tensor_address(name, device.ptr)
            keep += [host, device]
        out = self.io["outputs"][0]["name"]
        shape = tuple(ctx.get_tensor_shape(out))
        codes, host = cuda.DeviceArray(shape, np.int32), cuda.PinnedArray(shape, np.int32)
        ctx.set_tensor_address(out, codes.ptr)
        if not ctx.execute_async_v3(self.stream.ptr):
            raise HiggsError(f"codec_encoder.plan: enqueue failed ({'; '.join(self.logger.errors) or 'unknown error'})")
        cuda.copy_async(host.ptr, codes.ptr, codes.nbytes, self.stream)
        self.stream.synchronize()  # also keeps `keep` alive until the copies and the engine are done
        return host.array.copy()
