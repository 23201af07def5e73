"""ONNX Runtime backend: the fp32 reference twin (`lm.ref.onnx`, or `lm.fp8.ref.onnx`) and the codec, on the CPU, as an
engine graph for runtime/stepper.py. It is the reference that runs anywhere; on a GPU use `--backend trt` or `torch`.

Sessions, I/O bindings and the KV caches [max_batch, Hkv, S_max, D] are made once. A call binds views of the caches:
one slot's for a prefill, the first B slots' for a step. Each cache is bound as both the input (`past_*`) and the
output (`present_*`): ONNX Runtime's TensorScatter copies its input to its output and writes the new rows, which on
one buffer leaves the cache updated in place (tests/test_export.py checks the rows against torch).
"""

import numpy as np

from .errors import HiggsError
from .manifest import EngineDir


class OrtBackend:
    name = "ort"

    def __init__(self, engine: EngineDir, threads: int = 0, graph: str | None = None, max_batch: int | None = None):
        import onnxruntime as ort

        self.engine = engine
        limits = engine.manifest["limits"]
        self.max_seq, self.max_prompt = limits["max_seq"], limits["max_prompt"]
        self.max_batch = min(max_batch or limits["max_batch"], limits["max_batch"])
        self.codec_strides = tuple(engine.manifest["codec"]["strides"])
        providers = ["CPUExecutionProvider"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3  # TensorScatter warns on every call that it copies the cache
        self._ort = ort
        graph = graph or ("lm_fp8_ref" if engine.manifest["precision"] == "fp8" else "lm_ref")
        self.lm_session = self._session(engine, graph, options, providers)
        self.codec_session = self._session(engine, "codec", options, providers)
        io = engine.graph(graph)
        self.cache_names = [t["name"] for t in io["inputs"] if t["name"].startswith("past_")]
        cache_shape = next(t["shape"] for t in io["inputs"] if t["name"].startswith("past_"))[1:]
        self.caches = [np.zeros((self.max_batch, *cache_shape), np.float32) for _ in self.cache_names]
        self.binding = self.lm_session.io_binding()

    def _session(self, engine: EngineDir, graph: str, options, providers):
        try:
            session = self._ort.InferenceSession(str(engine.file(graph)), options, providers=providers)
        except Exception as e:  # onnxruntime's own exception types; a sealed manifest does not prove a loadable graph
            raise HiggsError(f"{engine.file(graph)}: ONNX Runtime cannot load it ({str(e).splitlines()[0]})") from None
        expected = engine.graph(graph)
        for kind, actual in (("inputs", session.get_inputs()), ("outputs", session.get_outputs())):
            got = [t.name for t in actual]
            want = [t["name"] for t in expected[kind]]
            if got != want:
                raise HiggsError(f"{engine.file(graph)}: {kind} {got} differ from the manifest's {want}")
        return session

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

    def codec(self, codes: np.ndarray) -> np.ndarray:
        return self.codec_session.run(None, {"codes": codes.astype(np.int32)})[0]
