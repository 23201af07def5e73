"""Launch a plugin kernel's AOT PTX through the CUDA driver with TensorRT's argument order (tensor inputs,
int32 scalars, tensor outputs): what a TensorRT AOT plugin does at enqueue, minus TensorRT. Used by the GPU tests
and the kernel benchmark; needs cuda-python and a GPU (and a current CUDA context, e.g. from torch)."""

import ctypes

from higgs_trt.runtime.cuda import check


class PtxKernel:
    def __init__(self, ptx: str, entry: str, threads: int, shared: int):
        from cuda.bindings import driver

        self.driver = driver
        self.module = check(driver.cuModuleLoadData(ptx.encode() + b"\0"), "cuModuleLoadData")
        self.function = check(driver.cuModuleGetFunction(self.module, entry.encode()), "cuModuleGetFunction")
        self.threads, self.shared = threads, shared

    def __call__(self, grid: tuple[int, int, int], pointers_in: list[int], scalars: list[int], pointers_out: list[int],
                 stream: int = 0) -> None:
        values = [*pointers_in, *scalars, *pointers_out]
        types = ([ctypes.c_void_p] * len(pointers_in) + [ctypes.c_int32] * len(scalars)
                 + [ctypes.c_void_p] * len(pointers_out))
        check(self.driver.cuLaunchKernel(self.function, *grid, self.threads, 1, 1, self.shared,
                                         self.driver.CUstream(stream), (tuple(values), tuple(types)), 0),
              "cuLaunchKernel")
