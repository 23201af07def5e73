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


# The cu13 TensorRT and cuda-python wheels need a driver that runs CUDA 13.0: R580 or newer.
MIN_DRIVER_CUDA = 13000


def driver_version() -> int:
    """The CUDA version the installed driver supports, as 1000·major + 10·minor (0: no driver or no cuda-python)."""
    try:
        err, version = _rt().cudaDriverGetVersion()
        return version if int(err) == 0 else 0
    except HiggsError:
        return 0


def capability(device: int = 0) -> tuple[int, int]:
    rt = _rt()
    major = check(rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute")
    minor = check(rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute")
    return int(major), int(minor)


def gpu_problem() -> str | None:
    """Why CUDA cannot be used here (None when it can). An old driver is named as such, not as a missing GPU."""
    try:
        _rt()
    except HiggsError:
        return "cuda-python is not installed: pip install 'higgs-trt[trt]'"
    driver = driver_version()
    if driver == 0:
        return "no NVIDIA driver is installed (or it cannot be loaded)"
    if driver < MIN_DRIVER_CUDA:
        return (f"the NVIDIA driver supports CUDA {driver // 1000}.{driver % 1000 // 10}; the cu13 TensorRT and "
                "cuda-python wheels need CUDA 13.0, i.e. driver R580 or newer: update the driver")
    if device_count() == 0:
        return "no NVIDIA GPU is visible to CUDA"
    return None


def ptx_isa_cuda(isa: str) -> int:
    """The first CUDA version (its driver) that JIT-compiles PTX of this ISA version (PTX ISA release history:
    7.x = CUDA 11.x, 8.0-8.5 = 12.0-12.5, 8.6 = 12.7, 8.7 = 12.8, 8.8 = 12.9, 9.x = 13.x)."""
    major, minor = (int(x) for x in isa.split("."))
    if major == 7:
        return 11000 + 10 * minor
    if major == 8:
        return 12000 + 10 * (minor if minor <= 5 else minor + 1)
    if major == 9:
        return 13000 + 10 * minor
    raise ValueError(isa)


def ptx_problem(target: str, isa: str, capability: tuple[int, int], driver: int) -> str | None:
    """Why PTX of `.target` `target` and `.version` `isa` cannot be JIT-compiled for this GPU and driver, or None.
    Plain targets (sm_80) run on that compute capability and every later one; arch-specific ones (sm_90a) only on
    their own."""
    try:
        specific = target.endswith("a")
        want = int(target.removeprefix("sm_").removesuffix("a"))
        need_cuda = ptx_isa_cuda(isa)
    except ValueError:
        return f"unknown PTX target {target!r} / version {isa!r}"
    have = capability[0] * 10 + capability[1]
    if (specific and have != want) or have < want:
        return (f"its PTX targets {target}, which a GPU of compute capability {capability[0]}.{capability[1]} "
                "cannot run")
    if driver < need_cuda:
        return (f"its PTX is ISA {isa}, which needs a driver for CUDA {need_cuda // 1000}.{need_cuda % 1000 // 10}+ "
                f"(this one supports {driver // 1000}.{driver % 1000 // 10})")
    return None


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
