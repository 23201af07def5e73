"""The CUDA the runtime needs, through cuda-python (no torch): a non-default stream, device and pinned host
buffers allocated once, async copies, and CUDA-graph capture and replay."""

import ctypes

import numpy as np

from .errors import HiggsError


def _rt():
    try:
        from cuda.bindings import runtime
    except ImportError:
        raise HiggsError("the TensorRT backend needs cuda-python: pip install 'higgs-trt[trt]'") from None
    return runtime


def check(result, what: str = "CUDA call"):
    """cuda-python returns (error, *values) for runtime and driver calls alike; raise on error, else the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise HiggsError(f"{what} failed: {getattr(err, 'name', err)}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


def device_count() -> int:
    """GPUs visible through the CUDA runtime (0 without a driver or GPU; never raises)."""
    try:
        err, n = _rt().cudaGetDeviceCount()
        return n if int(err) == 0 else 0
    except HiggsError:
        return 0


class Stream:
    def __init__(self):
        rt = _rt()
        self.handle = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def synchronize(self) -> None:
        check(_rt().cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")


class DeviceArray:
    """A device allocation with a fixed shape and dtype."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self._rt = _rt()  # kept for __del__, which may run while the interpreter shuts down
        self.ptr = int(check(self._rt.cudaMalloc(max(self.nbytes, 1)), "cudaMalloc"))

    def zero(self, stream: Stream) -> None:
        check(self._rt.cudaMemsetAsync(self.ptr, 0, self.nbytes, stream.handle), "cudaMemsetAsync")

    def __del__(self):
        if getattr(self, "ptr", None):
            self._rt.cudaFree(self.ptr)


class PinnedArray:
    """Page-locked host memory viewed as a numpy array (async copies need it)."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self._rt = rt = _rt()
        self.ptr = int(check(rt.cudaHostAlloc(max(self.nbytes, 1), rt.cudaHostAllocDefault), "cudaHostAlloc"))
        raw = (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.ptr)
        self.array = np.frombuffer(raw, dtype=np.uint8)[: self.nbytes].view(self.dtype).reshape(self.shape)

    def __del__(self):
        if getattr(self, "ptr", None):
            self._rt.cudaFreeHost(self.ptr)


def copy_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    rt = _rt()
    check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, stream.handle), "cudaMemcpyAsync")


class Graph:
    """Capture the work that `enqueue()` puts on `stream` once; replay it with one launch."""

    def __init__(self, stream: Stream, enqueue):
        self._rt = rt = _rt()
        self.stream, self.exec = stream, None
        check(rt.cudaStreamBeginCapture(stream.handle, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
              "cudaStreamBeginCapture")
        ok = False
        try:
            ok = enqueue()
        finally:
            graph = check(rt.cudaStreamEndCapture(stream.handle), "cudaStreamEndCapture")
        if not ok:
            rt.cudaGraphDestroy(graph)
            raise HiggsError("the work refused CUDA-graph capture")
        self.graph = graph
        self.exec = check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")

    def launch(self) -> None:
        check(self._rt.cudaGraphLaunch(self.exec, self.stream.handle), "cudaGraphLaunch")

    def __del__(self):
        if getattr(self, "exec", None) is not None:
            self._rt.cudaGraphExecDestroy(self.exec)
            self._rt.cudaGraphDestroy(self.graph)
