"""The plugins for datacenter TensorRT as ahead-of-time QDP plugins (`tensorrt.plugin`), namespace `higgs`.

The engine directory carries each kernel's PTX (compiled at export, plugins/aot.py); `aot_impl` hands it to
TensorRT, which embeds it in the plan, so a plan loads and runs with no Python plugin code. Step-varying values
(positions, row index, end frame) are device tensors; the only scalars are shape expressions (SymInt32).
rope_kv_write's cache outputs declare no alias: for an aliased plugin output TensorRT "may insert copies"
(NvInferRuntime.h, IPluginV3OneBuildV2::getAliasedInput), a whole cache per layer and step. Its kernel writes only
the new rows through them, so the runtime binds each `present_*` at its `past_*`'s address and the cache is
updated in place (docs/tensorrt.md).

What runs here: tests/test_qdp.py feeds these definitions to NVIDIA's own `tensorrt.plugin` Python code (from the
`tensorrt-cu13-bindings` wheels) over a stand-in for its native module, and walks the calls TensorRT's builder
makes (create_plugin in STRICT_AOT, output types and shapes, aliases, launch parameters, kernel lookup). What does
not: TensorRT itself (it cannot be installed here). The same PTX is launched with TensorRT's argument order by the
GPU tests (tests/test_plugin_kernels.py).

No `from __future__ import annotations` here: `tensorrt.plugin` validates the annotations as objects.
"""

from pathlib import Path
from typing import Tuple

from higgs_trt.runtime import cuda
from higgs_trt.runtime.errors import HiggsError

_KERNELS: dict = {}  # op → (ptx, manifest entry) of the engine directory being built
_REGISTERED = False


def register(engine_dir: Path, manifest: dict) -> list:
    """Define the plugins in `tensorrt.plugin` (once per process) with this engine directory's PTX."""
    global _REGISTERED
    for op, info in manifest["plugins"].items():
        _KERNELS[op] = ((Path(engine_dir) / info["file"]).read_text(), info)
    if not _REGISTERED:
        try:
            import tensorrt as trt
            import tensorrt.plugin as trtp
        except Exception as e:  # ImportError, or the native library failing to load
            raise HiggsError(f"--ops plugin needs NVIDIA's tensorrt.plugin (the `tensorrt` package, 10.15+): "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        _define(trt, trtp)
        _REGISTERED = True
    return []


def check_ptx(manifest: dict, capability: tuple[int, int], driver: int) -> None:
    """Refuse a build whose plugin PTX this GPU (compute capability) or driver (CUDA version) cannot JIT-compile."""
    for op, info in manifest["plugins"].items():
        problem = cuda.ptx_problem(info.get("target", "?"), info.get("ptx_version", "?"), capability, driver)
        if problem:
            raise HiggsError(f"plugin {op}: {problem}; re-export the engine directory (`higgs-trt build`)")


def _define(trt, trtp) -> None:
    @trtp.register("higgs::rope_kv_write")
    def rope_kv_write(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, cos: trtp.TensorDesc,
                      sin: trtp.TensorDesc, write_pos: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                      v_cache: trtp.TensorDesc) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return q.like(), k_cache.like(), v_cache.like()

    @trtp.aot_impl("higgs::rope_kv_write")
    def rope_kv_write_aot(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, cos: trtp.TensorDesc,
                          sin: trtp.TensorDesc, write_pos: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                          v_cache: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
                          ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        ptx, info = _KERNELS["rope_kv_write"]
        launch = _launch(trtp, info)
        launch.grid_x = q.shape_expr[0] * q.shape_expr[2]  # batch · new positions
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(q.shape_expr[2]), trtp.SymInt32(k_cache.shape_expr[2])])
        return info["entry"], ptx, launch, extra

    @trtp.register("higgs::delayed_codebook_step")
    def delayed_codebook_step(logits: trtp.TensorDesc, row_index: trtp.TensorDesc, end_frame: trtp.TensorDesc,
                              table: trtp.TensorDesc) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        codes = trtp.from_shape_expr((logits.shape_expr[0], logits.shape_expr[1]), dtype=trt.int32)
        embedding = trtp.from_shape_expr((logits.shape_expr[0], table.shape_expr[1]), dtype=table.dtype)
        return codes, embedding

    @trtp.aot_impl("higgs::delayed_codebook_step")
    def delayed_codebook_step_aot(logits: trtp.TensorDesc, row_index: trtp.TensorDesc, end_frame: trtp.TensorDesc,
                                  table: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
                                  ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        ptx, info = _KERNELS["delayed_codebook_step"]
        launch = _launch(trtp, info)
        launch.grid_x = logits.shape_expr[0]  # batch rows × slices of the hidden size
        launch.grid_y = -(-info["constants"]["HIDDEN"] // info["constants"]["BLOCK_H"])
        return info["entry"], ptx, launch, trtp.SymIntExprs(0)


    @trtp.register("higgs::decode_attention")
    def decode_attention(q: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                         write_pos: trtp.TensorDesc) -> Tuple[trtp.TensorDesc]:
        return q.like()

    @trtp.aot_impl("higgs::decode_attention")
    def decode_attention_aot(q: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                             write_pos: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
                             ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        ptx, info = _KERNELS["decode_attention"]
        c = info["constants"]
        launch = _launch(trtp, info)
        launch.grid_x = q.shape_expr[0]  # batch rows × KV heads × blocks of (new position, query head) pairs
        launch.grid_y = c["KV_HEADS"]
        launch.grid_z = (q.shape_expr[2] * (c["Q_HEADS"] // c["KV_HEADS"]) + (c["BLOCK_Q"] - 1)) // c["BLOCK_Q"]
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(q.shape_expr[2]), trtp.SymInt32(k_cache.shape_expr[2])])
        return info["entry"], ptx, launch, extra


def _launch(trtp, info: dict):
    launch = trtp.KernelLaunchParams()
    launch.block_x = info["threads"]
    launch.shared_mem = info["shared"]
    return launch
