"""ONNX Runtime backend: the fp32 reference twin (`lm.ref.onnx`) and the codec, on CPU or the CUDA EP; and the
codec encoder (`codec_encoder.onnx`, reference audio → codes) as a runner of its own, so encoding a reference
never loads the LM.

Sessions and buffers are made once. The KV caches are two sets of OrtValues used in turn (one is read while
the other is written), so a step never allocates or copies a cache on the host side.
"""

import numpy as np

from .audio import engine_identity
from .errors import HiggsError
from .manifest import EngineDir


def _setup(ort, device: str, threads: int):
    """(device, providers, session options) for --device auto|cpu|cuda."""
    available = ort.get_available_providers()
    if device == "auto":
        device = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise HiggsError("--device cuda needs onnxruntime-gpu and an NVIDIA GPU")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3  # TensorScatter warns on every call that it copies the cache
    return device, providers, options


def _session(ort, engine: EngineDir, graph: str, options, providers):
    session = ort.InferenceSession(str(engine.file(graph)), options, providers=providers)
    expected = engine.graph(graph)
    for kind, actual in (("inputs", session.get_inputs()), ("outputs", session.get_outputs())):
        got = [t.name for t in actual]
        want = [t["name"] for t in expected[kind]]
        if got != want:
            raise HiggsError(f"{engine.file(graph)}: {kind} {got} differ from the manifest's {want}")
    return session


class OrtBackend:
    name = "ort"

    def __init__(self, engine: EngineDir, device: str = "auto", threads: int = 0, graph: str | None = None):
        import onnxruntime as ort

        self.engine = engine
        limits = engine.manifest["limits"]
        self.max_seq, self.max_batch = limits["max_seq"], limits["max_batch"]
        self.device, providers, options = _setup(ort, device, threads)
        self._ort = ort
        graph = graph or ("lm_fp8_ref" if engine.manifest["precision"] == "fp8" else "lm_ref")
        self.lm_session = _session(ort, engine, graph, options, providers)
        self.codec_session = _session(ort, engine, "codec", options, providers)
        io = engine.graph(graph)
        self.cache_inputs = [t["name"] for t in io["inputs"] if t["name"].startswith("past_")]
        self.cache_outputs = [t["name"] for t in io["outputs"] if t["name"].startswith("present_")]
        self.cache_shape = next(t["shape"] for t in io["inputs"] if t["name"].startswith("past_"))[1:]
        self.logits_shape = next(t["shape"] for t in io["outputs"] if t["name"] == "logits")[1:]
        self.batch = None

    def _zeros(self, shape, dtype) -> "object":
        return self._ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype), self.device, 0)

    def start(self, batch: int) -> None:
        if batch != self.batch:  # buffers are per batch size, made once
            shape = (batch, *self.cache_shape)
            self.caches = [[self._zeros(shape, np.float32) for _ in self.cache_inputs] for _ in range(2)]
            self.logits = self._zeros((batch, *self.logits_shape), np.float32)
            self.codes = self._zeros((batch, self.logits_shape[0]), np.int32)
            self.binding = self.lm_session.io_binding()
            self.batch = batch
        else:  # stale rows are harmless (masked, then overwritten) but start from a clean state anyway
            for value in self.caches[0]:
                value.update_inplace(np.zeros(value.shape(), np.float32))
        self.current = 0

    def lm(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        b = self.binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        for name, value in feeds.items():
            b.bind_cpu_input(name, value)
        read, write = self.caches[self.current], self.caches[1 - self.current]
        for name, value in zip(self.cache_inputs, read):
            b.bind_ortvalue_input(name, value)
        for name, value in zip(self.cache_outputs, write):
            b.bind_ortvalue_output(name, value)
        b.bind_ortvalue_output("logits", self.logits)
        b.bind_ortvalue_output("codes", self.codes)
        self.lm_session.run_with_iobinding(b)
        self.current = 1 - self.current
        return self.logits.numpy(), self.codes.numpy()

    def codec(self, codes: np.ndarray) -> np.ndarray:
        return self.codec_session.run(None, {"codes": codes.astype(np.int32)})[0]


class OrtEncoder:
    """codec_encoder.onnx: audio_24k [1,1,N], audio_16k [1,1,M] float32 → codes [1,8,T] int32 (runtime/audio.py
    resamples and pads the inputs)."""

    name = "ort"

    def __init__(self, engine: EngineDir, device: str = "auto", threads: int = 0):
        import onnxruntime as ort

        io = engine.graph("codec_encoder")
        self.device, providers, options = _setup(ort, device, threads)
        self.session = _session(ort, engine, "codec_encoder", options, providers)
        self.geometry = io["geometry"]
        self.identity = engine_identity(self.name, engine)

    def encode(self, audio_24k: np.ndarray, audio_16k: np.ndarray) -> np.ndarray:
        feeds = {"audio_24k": audio_24k.astype(np.float32), "audio_16k": audio_16k.astype(np.float32)}
        return self.session.run(None, feeds)[0]
