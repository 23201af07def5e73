"""Triton kernels of the GPU engine (runtime/gpu/engine.py): the decoder's GEMMs, RMSNorm and the per-slot step state,
and the codec's Snake. The plugin ops (rope.py, attention.py, codebook.py) are the GPU engine's too; these have no
TensorRT twin.

Batch invariance is the rule: a row's result never depends on which other rows share the launch, so a request
decodes to the same codes alone or inside any batch. The linear kernel therefore computes every row with one fixed
K order per weight shape, decode and prefill alike: the ranges of K and their order are chosen per weight shape,
never per batch size; the batch rows sit on the MMA's N side, where they do not change a row's sums; the ranges'
sums are added in range order, by the program that finishes last (no float atomics) or by one program that runs
them all.

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
"""

import triton
import triton.language as tl

from .primitives import await_inputs, launch_next, mma, quantize


@triton.jit
def _x_tile(x, x_desc, m0, r, k0, M, K: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
            X_FP8: tl.constexpr, x_scale, TMA: tl.constexpr):
    """Rows m0 + r of x [M, K] at columns k0.. k0 + BLOCK_K: bf16, or FP8 codes (loaded as they are with X_FP8, else
    quantized here); zero rows past M and columns past K (TMA: one bulk copy, the descriptor's bounds zero-fill)."""
    if TMA:
        tile = x_desc.load([m0, k0])
    else:
        rows, k = m0 + r, k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(x + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
    if FP8 and not X_FP8:
        tile = quantize(tile.to(tl.float32), x_scale)
    return tile


@triton.jit
def _w_tile(w, w_desc, n0, w_rows, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """The W tile [BLOCK_N, BLOCK_K] of rows w_rows (n0 on) at columns k0 on; unmasked when K is a multiple of
    BLOCK_K. TMA: one bulk copy through the weight's descriptor, rows past N and columns past K zero-filled."""
    if TMA:
        tile = w_desc.load([n0, k0])
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        ptr = w + w_rows[:, None] * K + k[None, :]
        if K % BLOCK_K == 0:
            tile = tl.load(ptr)
        else:
            tile = tl.load(ptr, mask=k[None, :] < K, other=0.0)
    return tile


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
        y = quantize(y.to(tl.bfloat16).to(tl.float32), out_scale)
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
    sigmoid = (1.0 / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)  # the graph's Sigmoid, then its Mul
    return (g * sigmoid).to(tl.bfloat16).to(tl.float32) * u


@triton.jit
def _epilogue(y, u, rows, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N: tl.constexpr,
              FP8: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, OUT_F32: tl.constexpr,
              OUT_FP8: tl.constexpr):
    """Rows [ROWS, BLOCK_N] of the sums: silu(gate)·up when gated, the FP8 scales, residual, store."""
    if GATED:
        y = _gated(y, u, n, w_scale, w_up_scale, x_scale, N, FP8)
    _finish(y, rows, n, M, out, res, w_scale, x_scale, out_scale, N, FP8 and not GATED, RESIDUAL, OUT_F32, OUT_FP8)


@triton.jit
def linear(x, w, w_up, w_scale, w_up_scale, out, res, partials, tickets,
           M, x_scale, out_scale,
           N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
           ROWS: tl.constexpr, FP8: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
           OUT_F32: tl.constexpr, SPLITS_IN_PROGRAM: tl.constexpr = False, PDL: tl.constexpr = False,
           FP8_SPAN: tl.constexpr = 0, X_FP8: tl.constexpr = False, OUT_FP8: tl.constexpr = False,
           PERSISTENT: tl.constexpr = False, x_desc=None, w_desc=None, w_up_desc=None, TMA: tl.constexpr = False,
           LATE_LAUNCH: tl.constexpr = False):
    """Grid (programs over M, N / BLOCK_N, SPLIT_K or 1). Each product is W·xᵀ for a weight tile [BLOCK_N, BLOCK_K]
    and ROWS rows of x (16 to 64 in a decode step, up to 256 in a prefill): the weight rows sit on the MMA's M side,
    so BLOCK_N ≥ 64 uses Hopper's wgmma, and the batch rows on its N side, where each output element is the same
    chain of K steps whatever N is (a row's numbers do not depend on ROWS; tests/test_gpu_engine.py checks it bit for
    bit on the GPU).

    K is summed in SPLIT_K ranges, each from zero, and the ranges' sums added in range order. The ranges go to
    programs of their own (grid dimension 2: parallelism for a few rows; the last program to finish adds them up),
    or with SPLITS_IN_PROGRAM one after another in one program (many rows: no partial sums through memory). Both
    give the same numbers, so the choice may follow the number of rows. Row chunk c goes to program c mod the M
    programs, which come first so that those reading one weight tile run together and share it in L2. Split
    programs need M ≤ ROWS.

    PERSISTENT (split programs only, M ≤ ROWS): a 1-D grid of fewer programs than (weight tile, K range) units, each
    taking every num_programs-th unit in one loop that the compiler flattens with the K loop, so its loads run on
    into the next unit's instead of each unit paying a program's start and its first loads' latency. The same
    units, sums and reduction as split programs: the same numbers. FP8_SPAN: see plugins/kernels.mma.

    TMA: x, W (and W_up) tiles come by Hopper's bulk tensor copies through the descriptors x_desc ([M, K], blocks
    [ROWS, BLOCK_K]) and w_desc, w_up_desc ([N, K], blocks [BLOCK_N, BLOCK_K]): the same tiles, the same sums.

    LATE_LAUNCH (PDL): the next kernel's programs launch as this one's finish, not as soon as all of its programs
    have started (TileConfig.late_launch): launch order only, the same numbers."""
    await_inputs(PDL, LAUNCH_NEXT=not LATE_LAUNCH)
    K_SPLIT: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # a range's columns
    if PERSISTENT:
        r = tl.arange(0, ROWS)
        units = tl.cdiv(N, BLOCK_N) * SPLIT_K
        for unit in tl.range(tl.program_id(0), units, tl.num_programs(0), flatten=True):
            pid_n = unit // SPLIT_K
            s = unit % SPLIT_K
            n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            y, u = _k_range(x, w, w_up, x_desc, w_desc, w_up_desc, pid_n * BLOCK_N, tl.where(n < N, n, 0), 0, r, s,
                            M, x_scale, K, K_SPLIT, BLOCK_N, BLOCK_K, ROWS, FP8, X_FP8, GATED, FP8_SPAN, TMA)
            _store_unit(y, u, pid_n, s, n, 0, r, M, out, res, partials, tickets, w_scale, w_up_scale, x_scale,
                        out_scale, N, SPLIT_K, ROWS, FP8, GATED, RESIDUAL, OUT_F32, OUT_FP8)
    else:
        _tiles(x, w, w_up, x_desc, w_desc, w_up_desc, w_scale, w_up_scale, out, res, partials, tickets, M, x_scale,
               out_scale, N, K, K_SPLIT, BLOCK_N, BLOCK_K, SPLIT_K, ROWS, FP8, GATED, RESIDUAL, OUT_F32,
               SPLITS_IN_PROGRAM, FP8_SPAN, X_FP8, OUT_FP8, TMA)
    if LATE_LAUNCH:
        launch_next(PDL)


@triton.jit
def _tiles(x, w, w_up, x_desc, w_desc, w_up_desc, w_scale, w_up_scale, out, res, partials, tickets, M, x_scale,
           out_scale, N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr, GATED: tl.constexpr,
           RESIDUAL: tl.constexpr, OUT_F32: tl.constexpr, SPLITS_IN_PROGRAM: tl.constexpr, FP8_SPAN: tl.constexpr,
           X_FP8: tl.constexpr, OUT_FP8: tl.constexpr, TMA: tl.constexpr):
    """One program per (row chunk, weight tile, K range) of the grid, or per (row chunk, weight tile) with the
    ranges in the program."""
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    w_rows = tl.where(n < N, n, 0)  # columns past N read row 0 and are never stored
    for m0 in range(tl.program_id(0) * ROWS, M, tl.num_programs(0) * ROWS):
        if SPLITS_IN_PROGRAM:
            # -0.0 + s == s for every s, so the first range's sum passes unchanged, as the split reduction's does
            y = tl.full([ROWS, BLOCK_N], -0.0, tl.float32)
            u = tl.full([ROWS, BLOCK_N], -0.0, tl.float32)
            for s in tl.range(0, SPLIT_K, flatten=True):
                a, b = _k_range(x, w, w_up, x_desc, w_desc, w_up_desc, pid_n * BLOCK_N, w_rows, m0, r, s, M, x_scale,
                                K, K_SPLIT, BLOCK_N, BLOCK_K, ROWS, FP8, X_FP8, GATED, FP8_SPAN, TMA)
                y += a
                u += b
            _epilogue(y, u, m0 + r, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N, FP8, GATED, RESIDUAL,
                      OUT_F32, OUT_FP8)
        else:
            y, u = _k_range(x, w, w_up, x_desc, w_desc, w_up_desc, pid_n * BLOCK_N, w_rows, m0, r, tl.program_id(2),
                            M, x_scale, K, K_SPLIT, BLOCK_N, BLOCK_K, ROWS, FP8, X_FP8, GATED, FP8_SPAN, TMA)
            _store_unit(y, u, pid_n, tl.program_id(2), n, m0, r, M, out, res, partials, tickets, w_scale, w_up_scale,
                        x_scale, out_scale, N, SPLIT_K, ROWS, FP8, GATED, RESIDUAL, OUT_F32, OUT_FP8)


@triton.jit
def _k_range(x, w, w_up, x_desc, w_desc, w_up_desc, n0, w_rows, m0, r, s, M, x_scale, K: tl.constexpr,
             K_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
             FP8: tl.constexpr, X_FP8: tl.constexpr, GATED: tl.constexpr, FP8_SPAN: tl.constexpr, TMA: tl.constexpr):
    """Σ over K range s of W·xᵀ (and of the up projection's when gated) for x rows m0 + r and weight rows w_rows
    (n0 on), from zero, as [ROWS, BLOCK_N]."""
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
    up = tl.zeros([BLOCK_N, ROWS], tl.float32)
    for k0 in range(s * K_SPLIT, tl.minimum((s + 1) * K_SPLIT, K), BLOCK_K):
        xt = tl.trans(_x_tile(x, x_desc, m0, r, k0, M, K, BLOCK_K, FP8, X_FP8, x_scale, TMA))
        acc = mma(_w_tile(w, w_desc, n0, w_rows, k0, K, BLOCK_K, TMA), xt, acc, FP8_SPAN)
        if GATED:
            up = mma(_w_tile(w_up, w_up_desc, n0, w_rows, k0, K, BLOCK_K, TMA), xt, up, FP8_SPAN)
    return tl.trans(acc), tl.trans(up)


@triton.jit
def _store_unit(y, u, pid_n, s, n, m0, r, M, out, res, partials, tickets, w_scale, w_up_scale, x_scale, out_scale,
                N: tl.constexpr, SPLIT_K: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr, GATED: tl.constexpr,
                RESIDUAL: tl.constexpr, OUT_F32: tl.constexpr, OUT_FP8: tl.constexpr):
    """The sums of one (weight tile, K range) unit for rows m0 + r: through the epilogue when K is one range, else
    into the split reduction (split programs hold every row: m0 = 0)."""
    if SPLIT_K == 1:
        _epilogue(y, u, m0 + r, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N, FP8, GATED, RESIDUAL,
                  OUT_F32, OUT_FP8)
    else:
        _split_k_reduce(y, u, pid_n, s, n, r, M, out, res, partials, tickets, w_scale, w_up_scale, x_scale, out_scale,
                        N, SPLIT_K, ROWS, FP8, GATED, RESIDUAL, OUT_F32, OUT_FP8)


@triton.jit
def _sum_partials(partials, rows, n, real, N: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Σ over splits in split order (L2 reads: the other programs' partials are not in this SM's L1)."""
    y = tl.load(partials + rows[:, None] * N + n[None, :], mask=real, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        y += tl.load(partials + s * ROWS * N + rows[:, None] * N + n[None, :], mask=real, other=0.0,
                     cache_modifier=".cg")
    return y


@triton.jit
def _split_k_reduce(y, u, pid_n, pid_k, n, r, M, out, res, partials, tickets, w_scale, w_up_scale, x_scale,
                    out_scale, N: tl.constexpr, SPLIT_K: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr,
                    GATED: tl.constexpr, RESIDUAL: tl.constexpr, OUT_F32: tl.constexpr, OUT_FP8: tl.constexpr):
    """Each split stores its partial [ROWS, BLOCK_N] (gated: the gate's, then the up projection's), rows below M
    only (at M=1 a 16-row tile would otherwise write, and its reducer read, 16× the bytes); the last to finish sums
    them in split order and applies the epilogue."""
    real = (n[None, :] < N) & (r[:, None] < M)
    at = r[:, None] * N + n[None, :]
    tl.store(partials + pid_k * ROWS * N + at, y, mask=real)
    if GATED:
        tl.store(partials + (SPLIT_K + pid_k) * ROWS * N + at, u, mask=real)
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken (release below)
    ticket = tl.atomic_add(tickets + pid_n, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT_K - 1:
        tl.debug_barrier()
        y = _sum_partials(partials, r, n, real, N, ROWS, SPLIT_K)
        if GATED:
            u = _sum_partials(partials + SPLIT_K * ROWS * N, r, n, real, N, ROWS, SPLIT_K)
        _epilogue(y, u, r, n, M, out, res, w_scale, w_up_scale, x_scale, out_scale, N, FP8, GATED, RESIDUAL, OUT_F32,
                  OUT_FP8)
        tl.atomic_xchg(tickets + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def rms_norm(x, weight, out, eps, out_scale, H: tl.constexpr, BLOCK: tl.constexpr, OUT_FP8: tl.constexpr = False,
             PDL: tl.constexpr = False):
    """One program per row: weight · bf16(x / rms(x)), statistics in fp32 (as the reference RMSNorm); OUT_FP8: that
    bf16 value quantized at out_scale, the input of an FP8 linear."""
    row = tl.program_id(0)
    h = tl.arange(0, BLOCK)
    inside = h < H
    w = tl.load(weight + h, mask=inside, other=0.0).to(tl.float32)  # before the wait: no kernel writes weights
    await_inputs(PDL)
    v = tl.load(x + row * H + h, mask=inside, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
    y = (w * (v * inv).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
    if OUT_FP8:
        tl.store(out + row * H + h, quantize(y.to(tl.float32), out_scale), mask=inside)
    else:
        tl.store(out + row * H + h, y, mask=inside)


@triton.jit
def quantize_rows(x, out, scale, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out = x [rows, N] (bf16) as FP8 codes at scale, the quantization an FP8 linear applies to bf16 input. Grid
    (rows, ⌈N / BLOCK⌉). A prefill's attention output, quantized once for the FP8 o projection (in its own prologue
    o would re-quantize every row for each weight tile, several times the work at prefill sizes)."""
    await_inputs(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + row * N + c, mask=c < N, other=0.0)
    tl.store(out + row * N + c, quantize(v.to(tl.float32), scale), mask=c < N)


# Launched on slices that start at any slot and for any number of slots (a run of joins): unspecialized on both, as
# Triton would otherwise compile a variant per pointer alignment and count (~0.5 s each, on the request path).
@triton.jit(do_not_specialize=["n"],
            do_not_specialize_on_alignment=["write_pos", "row_index", "end_frame", "end_next", "active", "limit"])
def advance_slots(write_pos, row_index, end_frame, end_next, active, limit, n, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    """After a step (or a prefill's first row): every active slot moves to its next row; its end frame takes what
    the step found. Positions saturate at the last of the slot's `limit` positions (the cache it holds), so a slot
    whose stop the host has not yet read keeps rewriting one row instead of running past its cache."""
    await_inputs(PDL)
    b = tl.arange(0, BLOCK)
    inside = b < n
    on = tl.load(active + b, mask=inside, other=0) != 0
    keep = inside & on
    tl.store(end_frame + b, tl.load(end_next + b, mask=keep), mask=keep)
    tl.store(row_index + b, tl.load(row_index + b, mask=keep) + 1, mask=keep)
    pos = tl.load(write_pos + b, mask=keep)
    tl.store(write_pos + b, tl.minimum(pos + 1, tl.load(limit + b, mask=keep) - 1), mask=keep)


@triton.jit
def snake(x, alpha, bias, out, batch_stride, n, C, inner, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """The codec's Snake activation in one pass (eager torch makes five passes over the tensor): v + sin(αv)² / (α +
    1e-9), α per channel, v = x (+ bias per channel, a convolution's bias not yet added), computed in fp32 (x, bias
    and out fp32, or fp16: CodecDecoder.fp16). Each of the B batch items holds n elements from x + b·batch_stride on
    (out: packed), channel (i // inner) % C: inner = T for [B, C, T], 1 for channels last [B, T, C]. Grid (B,
    ⌈n / BLOCK⌉)."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    c = (i // inner) % C
    a = tl.load(alpha + c)
    v = tl.load(x + b * batch_stride + i, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias + c).to(tl.float32)
    s = tl.sin(a * v)  # libdevice sinf, not an approximation (checked in the PTX)
    tl.store(out + b * n + i, v + (1.0 / (a + 1e-9)) * (s * s), mask=inside)
