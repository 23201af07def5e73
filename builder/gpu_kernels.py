"""Triton kernels of the GPU decode path (builder/gpu_engine.py): the decoder's GEMMs, RMSNorm and the per-slot
step state. The two plugin ops (and decode attention) live in plugins/kernels.py; these have no TensorRT twin.

Batch invariance is the rule: a row's result never depends on which other rows share the launch, so a request
decodes to the same codes alone or inside any batch. The linear kernel therefore computes every row in fixed
16-row tiles with one fixed K order per weight shape (tile sizes and the split of K are chosen per weight shape,
never per batch size), and a split-K partial sum is reduced in split order by the program that finishes last
(no float atomics). A prefill never splits K, so its rows do not depend on how many prompts share the call.

Every kernel here takes PDL: launched with programmatic dependent launch, it waits for the previous kernel's writes
first (plugins/kernels.await_inputs).

linear: y = x Wᵀ for W [N, K] (the checkpoint's layout, read once per step: decode is bound by this read).
  - FP8: W is float8e4m3 with one scale per output row; x is quantized with the static per-tensor activation scale
    (x/s, saturated to ±448, round to nearest even: the FP8 engine's Q/DQ semantics), by the kernel that produced x
    (X_FP8: rms_norm, or the gated linear before down) or else in this kernel's prologue, tile by tile.
  - OUT_FP8: the output written as FP8 codes at out_scale (the next linear's activation scale), the same numbers as
    writing bf16 and quantizing in the next kernel.
  - GATED: two weights (gate, up) → silu(x Gᵀ) · (x Uᵀ), the MLP's first half in one pass.
  - RESIDUAL: out = res + bf16(y) (out may be res: the residual stream updated in place).
  - SWAP: the weight rows on the MMA's M side (W·xᵀ per 16-row tile), so 64-row weight tiles use Hopper's wgmma.
"""

import triton
import triton.language as tl

from higgs_trt.plugins.kernels import await_inputs, mma, to_fp8

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _quantize(v, scale):
    """fp32 → FP8 codes as QuantizeLinear does: v / scale, saturated, round to nearest even."""
    return to_fp8(tl.clamp(v / scale, -FP8_MAX, FP8_MAX))


@triton.jit
def _x_tile(x, rows, k, M, K: tl.constexpr, FP8: tl.constexpr, X_FP8: tl.constexpr, x_scale):
    """Rows `rows` [16] of x [M, K] at columns k: bf16, or FP8 codes (loaded as they are with X_FP8, else quantized
    here); zero rows past M and columns past K."""
    tile = tl.load(x + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
    if FP8 and not X_FP8:
        tile = _quantize(tile.to(tl.float32), x_scale)
    return tile


@triton.jit
def _w_tile(w, w_rows, k, K: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr):
    """The W tile [BLOCK_N, BLOCK_K] of rows w_rows (SWAP), else Wᵀ [BLOCK_K, BLOCK_N]; unmasked when K is a
    multiple of BLOCK_K."""
    if SWAP:
        ptr, inside = w + w_rows[:, None] * K + k[None, :], k[None, :] < K
    else:
        ptr, inside = w + w_rows[None, :] * K + k[:, None], k[:, None] < K
    if K % BLOCK_K == 0:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=inside, other=0.0)


@triton.jit
def _dot(x_tile, w_tile, acc, SWAP: tl.constexpr, FP8_SPAN: tl.constexpr):
    """acc + one 16-row x tile times the weight tile: [16, BLOCK_N] = x·Wᵀ, or with SWAP [BLOCK_N, 16] = W·xᵀ
    (the weight rows on the MMA's M side, so BLOCK_N ≥ 64 can use Hopper's wgmma, which needs 64-row tiles)."""
    if SWAP:
        return mma(w_tile, tl.trans(x_tile), acc, FP8_SPAN)
    else:
        return mma(x_tile, w_tile, acc, FP8_SPAN)


@triton.jit
def _zeros(BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        return tl.zeros([BLOCK_N, 16], tl.float32)
    else:
        return tl.zeros([16, BLOCK_N], tl.float32)


@triton.jit
def _rows_first(acc, SWAP: tl.constexpr):
    """The accumulator as [16 rows, BLOCK_N] for the epilogue."""
    if SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _finish(y, rows, n, M, out, res, w_scale, x_scale, out_scale,
            N: tl.constexpr, FP8: tl.constexpr, RESIDUAL: tl.constexpr, OUT_F32: tl.constexpr, OUT_FP8: tl.constexpr):
    if FP8:
        y = y * (x_scale * tl.load(w_scale + n, mask=n < N, other=0.0))[None, :]
    mask = (rows[:, None] < M) & (n[None, :] < N)
    if RESIDUAL:
        r = tl.load(res + rows[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
        y = r + y.to(tl.bfloat16).to(tl.float32)
    if OUT_F32:
        tl.store(out + rows[:, None] * N + n[None, :], y, mask=mask)
    elif OUT_FP8:
        y = _quantize(y.to(tl.bfloat16).to(tl.float32), out_scale)
        tl.store(out + rows[:, None] * N + n[None, :], y, mask=mask)
    else:
        tl.store(out + rows[:, None] * N + n[None, :], y.to(tl.bfloat16), mask=mask)


@triton.jit
def _gated(g, u, n, g_scale, u_scale, x_scale, N: tl.constexpr, FP8: tl.constexpr):
    if FP8:
        g = g * (x_scale * tl.load(g_scale + n, mask=n < N, other=0.0))[None, :]
        u = u * (x_scale * tl.load(u_scale + n, mask=n < N, other=0.0))[None, :]
    g = g.to(tl.bfloat16).to(tl.float32)  # the reference rounds each projection to bf16 before the product
    u = u.to(tl.bfloat16).to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32) * u


@triton.jit
def linear(x, w, w_up, w_scale, w_up_scale, out, res, partials, tickets,
           M, x_scale, out_scale,
           N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
           TILES: tl.constexpr, FP8: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
           OUT_F32: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr = False, FP8_SPAN: tl.constexpr = 0,
           X_FP8: tl.constexpr = False, OUT_FP8: tl.constexpr = False):
    """Grid (programs over M, N / BLOCK_N, SPLIT_K). Rows are taken TILES·16 at a time (TILES ≤ 4), chunk c by
    program c mod the M programs; every row goes through the same 16-row dot, so results do not depend on M. The M
    programs come first so that those reading one weight tile run together and share it in L2 (a prefill's rows).
    SPLIT_K > 1 needs M ≤ TILES·16 (decode). FP8_SPAN: see plugins/kernels.mma."""
    await_inputs(PDL)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    K_SPLIT: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    w_rows = tl.where(n < N, n, 0)  # columns past N read row 0 and are never stored
    for m0 in range(tl.program_id(0) * 16 * TILES, M, tl.num_programs(0) * 16 * TILES):
        a0 = _zeros(BLOCK_N, SWAP)
        a1 = _zeros(BLOCK_N, SWAP)
        a2 = _zeros(BLOCK_N, SWAP)
        a3 = _zeros(BLOCK_N, SWAP)
        u0 = _zeros(BLOCK_N, SWAP)
        u1 = _zeros(BLOCK_N, SWAP)
        u2 = _zeros(BLOCK_N, SWAP)
        u3 = _zeros(BLOCK_N, SWAP)
        for k0 in range(pid_k * K_SPLIT, tl.minimum((pid_k + 1) * K_SPLIT, K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            wt = _w_tile(w, w_rows, k, K, BLOCK_K, SWAP)
            if GATED:
                ut = _w_tile(w_up, w_rows, k, K, BLOCK_K, SWAP)
            else:
                ut = wt
            a0, u0 = _tile_dots(x, m0 + r16, k, M, x_scale, wt, ut, a0, u0, K, FP8, X_FP8, GATED, SWAP, FP8_SPAN)
            if TILES > 1:
                a1, u1 = _tile_dots(x, m0 + 16 + r16, k, M, x_scale, wt, ut, a1, u1, K, FP8, X_FP8, GATED, SWAP,
                                    FP8_SPAN)
            if TILES > 2:
                a2, u2 = _tile_dots(x, m0 + 32 + r16, k, M, x_scale, wt, ut, a2, u2, K, FP8, X_FP8, GATED, SWAP,
                                    FP8_SPAN)
            if TILES > 3:
                a3, u3 = _tile_dots(x, m0 + 48 + r16, k, M, x_scale, wt, ut, a3, u3, K, FP8, X_FP8, GATED, SWAP,
                                    FP8_SPAN)
        if SPLIT_K == 1:
            _epilogue(a0, u0, m0 + r16, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N, FP8, GATED,
                      RESIDUAL, OUT_F32, OUT_FP8, SWAP)
            if TILES > 1:
                _epilogue(a1, u1, m0 + 16 + r16, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N, FP8,
                          GATED, RESIDUAL, OUT_F32, OUT_FP8, SWAP)
            if TILES > 2:
                _epilogue(a2, u2, m0 + 32 + r16, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N, FP8,
                          GATED, RESIDUAL, OUT_F32, OUT_FP8, SWAP)
            if TILES > 3:
                _epilogue(a3, u3, m0 + 48 + r16, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N, FP8,
                          GATED, RESIDUAL, OUT_F32, OUT_FP8, SWAP)
        else:
            _split_k_reduce(a0, a1, a2, a3, u0, u1, u2, u3, pid_n, pid_k, n, r16, M, out, res, partials, tickets,
                            w_scale, w_up_scale, x_scale, out_scale, N, SPLIT_K, TILES, FP8, GATED, RESIDUAL, OUT_F32,
                            OUT_FP8, SWAP)


@triton.jit
def _tile_dots(x, rows, k, M, x_scale, wt, ut, a, u, K: tl.constexpr, FP8: tl.constexpr, X_FP8: tl.constexpr,
               GATED: tl.constexpr, SWAP: tl.constexpr, FP8_SPAN: tl.constexpr):
    """One 16-row x tile times the weight tile (and the up tile when gated), added to the accumulators (a, u)."""
    xt = _x_tile(x, rows, k, M, K, FP8, X_FP8, x_scale)
    a = _dot(xt, wt, a, SWAP, FP8_SPAN)
    if GATED:
        u = _dot(xt, ut, u, SWAP, FP8_SPAN)
    return a, u


@triton.jit
def _epilogue(a, u, rows, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N: tl.constexpr,
              FP8: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, OUT_F32: tl.constexpr,
              OUT_FP8: tl.constexpr, SWAP: tl.constexpr):
    """One 16-row tile's output when K is not split: silu(gate)·up when gated, the FP8 scales, residual, store."""
    y = _rows_first(a, SWAP)
    if GATED:
        y = _gated(y, _rows_first(u, SWAP), n, w_scale, w_up_scale, x_scale, N, FP8)
    _finish(y, rows, n, M, out, res, w_scale, x_scale, out_scale, N, FP8 and not GATED, RESIDUAL, OUT_F32, OUT_FP8)


@triton.jit
def _store_partial(part, r16, n, cols, M, a0, a1, a2, a3, N: tl.constexpr, TILES: tl.constexpr):
    """Rows below M only: at M=1 a 16-row tile would otherwise write (and its reducer read) 16× the partial bytes."""
    tl.store(part + r16[:, None] * N + n[None, :], a0, mask=cols & (r16[:, None] < M))
    if TILES > 1:
        tl.store(part + (16 + r16)[:, None] * N + n[None, :], a1, mask=cols & ((16 + r16)[:, None] < M))
    if TILES > 2:
        tl.store(part + (32 + r16)[:, None] * N + n[None, :], a2, mask=cols & ((32 + r16)[:, None] < M))
    if TILES > 3:
        tl.store(part + (48 + r16)[:, None] * N + n[None, :], a3, mask=cols & ((48 + r16)[:, None] < M))


@triton.jit
def _sum_partials(partials, rows, n, real, N: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Σ over splits in split order (L2 reads: the other programs' partials are not in this SM's L1)."""
    y = tl.load(partials + rows[:, None] * N + n[None, :], mask=real, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        y += tl.load(partials + s * ROWS * N + rows[:, None] * N + n[None, :], mask=real, other=0.0,
                     cache_modifier=".cg")
    return y


@triton.jit
def _split_k_reduce(a0, a1, a2, a3, u0, u1, u2, u3, pid_n, pid_k, n, r16, M, out, res, partials, tickets, w_scale,
                    w_up_scale, x_scale, out_scale, N: tl.constexpr, SPLIT_K: tl.constexpr, TILES: tl.constexpr,
                    FP8: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, OUT_F32: tl.constexpr,
                    OUT_FP8: tl.constexpr, SWAP: tl.constexpr):
    """Each split stores its partial [16·TILES, BLOCK_N] (gated: the gate's, then the up projection's); the last to
    finish sums them in split order and applies the epilogue."""
    ROWS: tl.constexpr = 16 * TILES
    cols = n[None, :] < N
    a0, a1, a2, a3 = _rows_first(a0, SWAP), _rows_first(a1, SWAP), _rows_first(a2, SWAP), _rows_first(a3, SWAP)
    u0, u1, u2, u3 = _rows_first(u0, SWAP), _rows_first(u1, SWAP), _rows_first(u2, SWAP), _rows_first(u3, SWAP)
    _store_partial(partials + pid_k * ROWS * N, r16, n, cols, M, a0, a1, a2, a3, N, TILES)
    if GATED:
        _store_partial(partials + (SPLIT_K + pid_k) * ROWS * N, r16, n, cols, M, u0, u1, u2, u3, N, TILES)
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken (release below)
    ticket = tl.atomic_add(tickets + pid_n, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT_K - 1:
        tl.debug_barrier()
        for t in tl.static_range(TILES):
            rows = 16 * t + r16
            real = cols & (rows[:, None] < M)
            y = _sum_partials(partials, rows, n, real, N, ROWS, SPLIT_K)
            if GATED:
                u = _sum_partials(partials + SPLIT_K * ROWS * N, rows, n, real, N, ROWS, SPLIT_K)
                y = _gated(y, u, n, w_scale, w_up_scale, x_scale, N, FP8)
            _finish(y, rows, n, M, out, res, w_scale, x_scale, out_scale, N, FP8 and not GATED, RESIDUAL, OUT_F32,
                    OUT_FP8)
        tl.atomic_xchg(tickets + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def rms_norm(x, weight, out, eps, out_scale, H: tl.constexpr, BLOCK: tl.constexpr, OUT_FP8: tl.constexpr = False,
             PDL: tl.constexpr = False):
    """One program per row: weight · bf16(x / rms(x)), statistics in fp32 (as the reference RMSNorm); OUT_FP8: that
    bf16 value quantized at out_scale, the input of an FP8 linear."""
    await_inputs(PDL)
    row = tl.program_id(0)
    h = tl.arange(0, BLOCK)
    inside = h < H
    v = tl.load(x + row * H + h, mask=inside, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
    w = tl.load(weight + h, mask=inside, other=0.0).to(tl.float32)
    y = (w * (v * inv).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
    if OUT_FP8:
        tl.store(out + row * H + h, _quantize(y.to(tl.float32), out_scale), mask=inside)
    else:
        tl.store(out + row * H + h, y, mask=inside)


@triton.jit
def advance_slots(write_pos, row_index, end_frame, end_next, active, n, max_seq, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    """After a step (or a prefill's first row): every active slot moves to its next row; its end frame takes what
    the step found. Positions saturate at the cache's last row, so a slot whose stop the host has not yet read
    keeps rewriting one row instead of running past the cache."""
    await_inputs(PDL)
    b = tl.arange(0, BLOCK)
    inside = b < n
    on = tl.load(active + b, mask=inside, other=0) != 0
    keep = inside & on
    tl.store(end_frame + b, tl.load(end_next + b, mask=keep), mask=keep)
    tl.store(row_index + b, tl.load(row_index + b, mask=keep) + 1, mask=keep)
    pos = tl.load(write_pos + b, mask=keep)
    tl.store(write_pos + b, tl.minimum(pos + 1, max_seq - 1), mask=keep)
