"""ONNX Runtime backend: the fp32 reference twin (`lm.ref.onnx`, or `lm.fp8.ref.onnx`) and the codec, on the CPU, as an
engine graph for runtime/stepper.py; and the codec encoder (`codec_encoder.onnx`, reference audio → codes) as a runner
of its own, so encoding a reference never loads the LM. It is the reference that runs anywhere; on a GPU use
`--backend trt` or `torch`.

Sessions, I/O bindings and the KV caches [max_batch, Hkv, S_max, D] are made once. A call binds views of the caches:
one slot's for a prefill, the first B slots' for a step. Each cache is bound as both the input (`past_*`) and the
output (`present_*`): ONNX Runtime's TensorScatter copies its input to its output and writes the new rows, which on
one buffer leaves the cache updated in place (tests/test_export.py checks the rows against torch).
"""

import numpy as np

from higgs_trt.runtime.audio import engine_identity
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.manifest import EngineDir


def _options(ort, threads: int):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3  # TensorScatter warns on every call that it copies the cache
    return options


def _session(ort, engine: EngineDir, graph: str, options):
    try:
        session = ort.InferenceSession(str(engine.file(graph)), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own exception types; a sealed manifest does not prove a loadable graph
        raise HiggsError(f"{engine.file(graph)}: ONNX Runtime cannot load it ({str(e).splitlines()[0]})") from None
    expected = engine.graph(graph)
    for kind, actual in (("inputs", session.get_inputs()), ("outputs", session.get_outputs())):
        got = [t.name for t in actual]
        want = [t["name"] for t in expected[kind]]
        if got != want:
            raise HiggsError(f"{engine.file(graph)}: {kind} {got} differ from the manifest's {want}")
    return session


class OrtBackend:
    name = "ort"

    def __init__(self, engine: EngineDir, threads: int = 0, graph: str | None = None, max_batch: int | None = None):
        import onnxruntime as ort

        self.engine = engine
        limits = engine.manifest["limits"]
        self.max_seq, self.max_prompt = limits["max_seq"], limits["max_prompt"]
        self.max_batch = min(max_batch or limits["max_batch"], limits["max_batch"])
        self.codec_strides = tuple(engine.manifest["codec"]["strides"])
        self._ort = ort
        options = _options(ort, threads)
        graph = graph or ("lm_fp8_ref" if engine.manifest["precision"] == "fp8" else "lm_ref")
        self.lm_session = _session(ort, engine, graph, options)
        self.codec_session = _session(ort, engine, "codec", options)
        io = engine.graph(graph)
        self.cache_names = [t["name"] for t in io["inputs"] if t["name"].startswith("past_")]
        cache_shape = next(t["shape"] for t in io["inputs"] if t["name"].startswith("past_"))[1:]
        rows = next(t.shape[2] for t in self.lm_session.get_inputs() if t.name.startswith("past_"))
        if rows != self.max_seq:  # a resealed manifest's limits: the graph's caches and RoPE table are fixed
            raise HiggsError(f"{engine.file(graph)}: its caches hold {rows} positions, but the manifest's max_seq is "
                             f"{self.max_seq}")
        self.caches = [np.zeros((self.max_batch, *cache_shape), np.float32) for _ in self.cache_names]
        self.binding = self.lm_session.io_binding()

    def lm(self, feeds: dict[str, np.ndarray], slot: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One graph call on slot `slot` (batch 1), or on the first B slots."""
        rows = slice(slot, slot + 1) if slot is not None else slice(0, len(feeds["write_pos"]))
        b = self.binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        for name, value in feeds.items():
            b.bind_cpu_input(name, value)
        b.bind_output("logits")
        b.bind_output("codes")
        for name, cache in zip(self.cache_names, self.caches):
            view = self._ort.OrtValue.ortvalue_from_numpy(cache[rows])  # wraps the numpy memory, no copy
            b.bind_ortvalue_input(name, view)
            b.bind_ortvalue_output(name.replace("past_", "present_"), view)
        self.lm_session.run_with_iobinding(b)
        logits, codes = b.get_outputs()[:2]
        return logits.numpy(), codes.numpy()

    def read_cache(self, slot: int, positions: int) -> list[np.ndarray]:
        """A copy of the keys and values of cache rows [0, positions) of `slot`."""
        return [cache[slot, :, :positions].copy() for cache in self.caches]

    def write_cache(self, slot: int, rows: list[np.ndarray]) -> None:
        for cache, kept in zip(self.caches, rows):
            cache[slot, :, :kept.shape[1]] = kept

    def swap_cache(self, a: int, b: int) -> None:
        for cache in self.caches:
            cache[[a, b]] = cache[[b, a]]

    def codec(self, codes: np.ndarray) -> np.ndarray:
        """Windows [N, 8, T] → audio [N, 1, 960·T], one window per session run: ONNX Runtime's CPU convolutions
        round differently (~1e-7) by batch size, and one at a time each window's audio is bit-exact whatever else
        the scheduler decodes with it (a request's audio equals its solo run; the GPU engines batch the windows)."""
        codes = codes.astype(np.int32)
        return np.concatenate([self.codec_session.run(None, {"codes": window[None]})[0] for window in codes])


class OrtEncoder:
    """codec_encoder.onnx: audio_24k [1,1,N], audio_16k [1,1,M] float32 → codes [1,8,T] int32 (runtime/audio.py
    resamples and pads the inputs)."""

    name = "ort"

    def __init__(self, engine: EngineDir, threads: int = 0):
        import onnxruntime as ort

        io = engine.graph("codec_encoder")
        self.session = _session(ort, engine, "codec_encoder", _options(ort, threads))
        self.geometry = io["geometry"]
        self.identity = engine_identity(self.name, engine)

    def encode(self, audio_24k: np.ndarray, audio_16k: np.ndarray) -> np.ndarray:
        feeds = {"audio_24k": audio_24k.astype(np.float32), "audio_16k": audio_16k.astype(np.float32)}
        return self.session.run(None, feeds)[0]
