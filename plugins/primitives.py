"""Building blocks the Triton kernels share: the tensor-core product, programmatic dependent launch, FP8 rounding,
L2 prefetch. Argument order of every plugin entry is TensorRT's for AOT plugins: tensor inputs, then int32 scalars,
then tensor outputs (rope_kv_write's cache outputs are bound at their inputs' addresses: docs/tensorrt.md)."""

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Triton's interpreter (CI runs the kernels with TRITON_INTERPRET=1) multiplies bf16 and fp8 tiles as raw integers in
# tl.dot, and its fp32 → fp8 cast loses a rounding that carries into the exponent (127.2 → 64, not 128). Under it,
# `mma` widens the operands to fp32 first (the same exact products) and `to_fp8` rounds in fp32 arithmetic first.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
FP8_MAX = tl.constexpr(448.0)
NEG = tl.constexpr(-1.0e30)  # a running max that no real score is below, and exp(NEG - NEG) = 1 stays finite


@triton.jit
def mma(a, b, acc, FP8_SPAN: tl.constexpr = 0):
    """acc + a @ b on the tensor cores (fp32 accumulation). FP8_SPAN (FP8 operands only): how many products Hopper's
    FP8 wgmma may sum in the tensor core's reduced precision before the sum is added into the fp32 accumulator.
    0: Triton does not use FP8 wgmma at all; it widens the operands to f16 and multiplies with mma.sync (exact
    products, fp32 sums). 32: one wgmma instruction's K, each instruction's sum added into fp32. Triton's own
    default on Hopper sums a whole K loop in reduced precision, visibly off at unit scale."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, max_num_imprecise_acc=FP8_SPAN)


@triton.jit
def await_inputs(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """GPU path under programmatic dependent launch (Hopper on): this kernel may start while the previous one still
    runs, so wait for its writes here, first; then let the next kernel launch its programs early (they wait in
    turn) unless not LAUNCH_NEXT (the kernel calls launch_next at its end). Every kernel launched that way must call
    this before it reads anything another kernel wrote."""
    if PDL:
        gdc_wait()
    if LAUNCH_NEXT:
        launch_next(PDL)


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel launch its programs now (for a kernel that waited with LAUNCH_NEXT=False)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, nbytes, on):
    """Where `on`: Hopper's bulk copy engine fetches `nbytes` from each address into L2 (cp.async.bulk.prefetch.L2:
    no registers filled, nothing to wait for; addresses and sizes multiples of 16). The interpreter has no such
    instruction: nothing there."""
    if not INTERPRETED:
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $3, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t}"
            "\n\tmov.u32 $0, 0;", "=r,l,r,r", [ptrs.to(tl.int64, bitcast=True), nbytes, on.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_async_proxy():
    """This thread's global writes before it are ordered before later bulk copies' reads (fence.proxy.async: TMA
    reads through the async proxy, plain stores write through the generic one). Nothing under the interpreter."""
    if not INTERPRETED:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [tl.program_id(0)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def to_fp8(v):
    """fp32 [−448, 448] → float8e4nv, round to nearest even."""
    if INTERPRETED:
        a = tl.abs(v)
        exponent = tl.minimum(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0), 8.0)
        step = tl.exp2(exponent - 3.0)  # 3 mantissa bits; below 2^-6 the subnormal spacing 2^-9
        y = a / step
        r = tl.floor(y + 0.5)
        r = tl.where((r - y == 0.5) & (r % 2 == 1), r - 1.0, r)
        v = tl.where(v < 0, -r * step, r * step)
    return v.to(tl.float8e4nv)


@triton.jit
def quantize(v, scale):
    """fp32 → FP8 codes as QuantizeLinear does: v / scale, saturated, round to nearest even."""
    return to_fp8(tl.clamp(v / scale, -FP8_MAX, FP8_MAX))
