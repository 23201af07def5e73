"""Ahead-of-time PTX for the plugin kernels, specialised to one model's dimensions.

Triton compiles for a named GPU target without needing one (checked on CPU-only CI). The PTX goes into the engine
directory beside the graphs; TensorRT's AOT plugins embed it in the plan, and the GPU tests launch the very same
PTX through the CUDA driver with TensorRT's argument order.

Target: plain sm_80, PTX ISA 8.0. Triton names every capability ≥ 9.0 arch-specifically (sm_90a: Hopper only, see
`sm_arch_from_capability` in triton/backends/nvidia/compiler.py) and, unless told, stamps the ISA of the ptxas it
bundles (Triton 3.9: 9.4 for sm_90, which a CUDA 13.0 / R580 driver cannot JIT-compile). PTX for sm_80 / ISA 8.0
is JIT-compiled by any driver since CUDA 12.0 for every GPU from Ampere on, so one export serves whatever GPU the
plan is built on; the build checks the GPU and driver against the PTX (plugins/qdp.py `check_ptx`). The kernels
use no Hopper-only instruction (no wgmma, no TMA; decode_attention's dots are Ampere mma.sync), so sm_80 code is what
Hopper runs too.

Triton ≥ 3.3 appends two scratch-buffer pointers to every kernel's parameters. TensorRT passes only the
plugin's inputs, scalars and outputs, so the two are removed from the PTX entry, after checking that the kernel
never reads them (no global or profile scratch was allocated).
"""

import hashlib
import re
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

from . import attention, codebook, rope

TARGET = ("cuda", 80, 32)  # compute capability 8.0: PTX `.target sm_80`, JIT-compiled for any later GPU
PTX_VERSION = 80  # PTX ISA 8.0 (CUDA 12.0)
SIGNATURES = {
    "rope_kv_write": ({"q": "*bf16", "k": "*bf16", "v": "*bf16", "cos": "*bf16", "sin": "*bf16", "write_pos": "*i64",
                       "k_cache_in": "*bf16", "v_cache_in": "*bf16", "seq": "i32", "max_seq": "i32",
                       "q_out": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16",
                       "Q_HEADS": "constexpr", "KV_HEADS": "constexpr", "HALF": "constexpr"}),
    "delayed_codebook_step": ({"logits": "*fp32", "row_index": "*i64", "end_frame": "*i64", "table": "*bf16",
                               "codes": "*i32", "embedding": "*bf16", "K": "constexpr", "VOCAB": "constexpr",
                               "HIDDEN": "constexpr", "BLOCK_V": "constexpr", "BLOCK_H": "constexpr"}),
    "decode_attention": ({"q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "write_pos": "*i64", "seq": "i32",
                          "max_seq": "i32", "out": "*bf16", "Q_HEADS": "constexpr", "KV_HEADS": "constexpr",
                          "HEAD_DIM": "constexpr", "BLOCK_Q": "constexpr", "BLOCK_S": "constexpr"}),
}
OPS = tuple(SIGNATURES)
KERNELS = {"rope_kv_write": rope.rope_kv_write, "delayed_codebook_step": codebook.delayed_codebook_step,
           "decode_attention": attention.decode_attention}


NUM_WARPS = {"rope_kv_write": 4, "delayed_codebook_step": 8, "decode_attention": 4}


def grid(op: str, constants: dict, batch: int, seq: int = 1) -> tuple[int, int, int]:
    """Launch grid: rope_kv_write (B·S); delayed_codebook_step (B, ⌈hidden / BLOCK_H⌉); decode_attention
    (B, Hkv, ⌈S·G / BLOCK_Q⌉) with G = Hq / Hkv."""
    if op == "rope_kv_write":
        return batch * seq, 1, 1
    if op == "decode_attention":
        group = constants["Q_HEADS"] // constants["KV_HEADS"]
        return batch, constants["KV_HEADS"], -(-seq * group // constants["BLOCK_Q"])
    return batch, -(-constants["HIDDEN"] // constants["BLOCK_H"]), 1


@dataclass(frozen=True)
class CompiledKernel:
    op: str
    entry: str  # the PTX entry name
    ptx: str
    threads: int  # block size
    shared: int  # bytes of dynamic shared memory
    constants: dict

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.ptx.encode()).hexdigest()

    @property
    def target(self) -> str:
        return re.search(r"^\.target\s+(\w+)", self.ptx, re.M).group(1)

    @property
    def ptx_version(self) -> str:
        return re.search(r"^\.version\s+(\d+\.\d+)", self.ptx, re.M).group(1)


def constants_for(op: str, head_dim: int, hidden: int, q_heads: int, kv_heads: int, vocab: int = 1026,
                  codebooks: int = 8) -> dict:
    if op == "rope_kv_write":
        return {"Q_HEADS": q_heads, "KV_HEADS": kv_heads, "HALF": head_dim // 2}
    if op == "decode_attention":
        return {"Q_HEADS": q_heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "BLOCK_Q": 16, "BLOCK_S": 64}
    return {"K": codebooks, "VOCAB": vocab, "HIDDEN": hidden, "BLOCK_V": triton.next_power_of_2(vocab),
            "BLOCK_H": min(triton.next_power_of_2(hidden), 512)}


def compile_kernel(op: str, constants: dict, target=TARGET) -> CompiledKernel:
    source = triton.compiler.ASTSource(fn=KERNELS[op], signature=SIGNATURES[op], constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget(*target),
                              options={"num_warps": NUM_WARPS[op], "ptx_version": PTX_VERSION})
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(f"{op}: kernel needs scratch memory, which a TensorRT plugin launch cannot provide")
    params = sum(1 for t in SIGNATURES[op].values() if t != "constexpr")
    return CompiledKernel(op, meta.name, strip_trailing_params(compiled.asm["ptx"], meta.name, params),
                          meta.num_warps * 32, meta.shared, dict(constants))


def strip_trailing_params(ptx: str, entry: str, keep: int) -> str:
    """Drop the entry's parameters after the first `keep`, refusing if the body reads any of them."""
    head = re.search(rf"\.entry {re.escape(entry)}\(\s*(.*?)\)", ptx, re.S)
    params = [p.strip() for p in head.group(1).split(",")]
    extra = params[keep:]
    names = [p.split()[-1] for p in extra]
    body = ptx[head.end():]
    used = [n for n in names if re.search(rf"\b{re.escape(n)}\b", body)]
    if used:
        raise RuntimeError(f"{entry}: trailing parameters {used} are used by the kernel")
    new_head = head.group(0).replace(head.group(1), ",\n\t".join(params[:keep]) + "\n")
    return ptx[: head.start()] + new_head + body
