"""Triton kernels of the custom ops. The same source is JIT-launched by the GPU tests and the GPU decode path
(builder/gpu_engine.py) and compiled ahead of time to PTX for TensorRT's AOT plugins (plugins/qdp.py). Argument order
of the plugin entries is TensorRT's for AOT plugins: tensor inputs, then int32 scalars, then tensor outputs (an
aliased output is a separate argument pointing at its input).

rope_kv_write: per (batch row, position), for all heads, NeoX half-split RoPE with the bf16 cos/sin table at position
  write_pos[b] + s, in fp32 with one rounding to bf16: q heads go to q_out, k heads are written into the key cache
  at that position and v rows into the value cache (in place; rows at or past max_seq are dropped).
  qk_norm_rope_kv_write is the GPU path's form for a prefill: it reads the fused q|k|v projection rows and applies
  the per-head q/k RMSNorm first (a decode step does the same inside decode_attention_split).
delayed_codebook_step: per batch row, per codebook: argmax over the 1026 logits (ties to the lowest index) or,
  where temperature[b] > 0, seeded sampling (temperature, top-k, top-p); then the delay mask (BOC before row k,
  EOC from the end frame on); then the next input embedding Σ_k table[k·1026 + code_k], fp32 sum, one bf16 round.
  delayed_codebook_sample is the GPU path's form: it also finds the utterance's end frame from this row's EOCs (the
  rule of runtime/decoding.py) and embeds the row as it is fed back, masked with that end.
decode_attention: causal attention of new rows over a static KV cache [B, Hkv, S_max, D] (GQA), reading only
  each row's valid prefix (keys 0..write_pos[b] + s), q scaled beforehand (as the graph's Attention op takes it).
  decode_attention_split is the GPU path's form for one new row: it starts from the q|k|v projection's row (the
  work of qk_norm_rope_kv_write for that row, then attention), splits the prefix into fixed chunks of CHUNK keys for
  parallelism and combines them in chunk order, so a row's result depends only on its own length, never on the
  batch.
"""

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Triton's interpreter (CI runs the kernels with TRITON_INTERPRET=1) multiplies bf16 and fp8 tiles as raw integers in
# tl.dot, and its fp32 → fp8 cast loses a rounding that carries into the exponent (127.2 → 64, not 128). Under it,
# `mma` widens the operands to fp32 first (the same exact products) and `to_fp8` rounds in fp32 arithmetic first.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
BOC = tl.constexpr(1024)
EOC = tl.constexpr(1025)
FP8_MAX = tl.constexpr(448.0)
NEG = tl.constexpr(-1.0e30)  # a running max that no real score is below, and exp(NEG - NEG) = 1 stays finite


@triton.jit
def mma(a, b, acc, FP8_SPAN: tl.constexpr = 0):
    """acc + a @ b on the tensor cores (fp32 accumulation). FP8_SPAN (FP8 operands only): how many products Hopper's
    FP8 wgmma may sum in the tensor core's reduced precision before the sum is added into the fp32 accumulator.
    0: Triton does not use FP8 wgmma at all; it widens the operands to f16 and multiplies with mma.sync (exact
    products, fp32 sums). 32: one wgmma instruction's K, each instruction's sum added into fp32. Triton's own
    default on Hopper sums a whole K loop in reduced precision (H200: outputs off by up to 1e-2 at unit scale)."""
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
def _fence_async_proxy():
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


@triton.jit
def _rotate(x1, x2, c, sn):
    return x1 * c - x2 * sn, x2 * c + x1 * sn


@triton.jit
def _head_norm(x1, x2, weight, eps, d, HALF: tl.constexpr):
    """Per-head RMSNorm over the two halves [heads, HALF] (fp32 statistics, bf16 rounding as the reference)."""
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(weight + d).to(tl.float32)
    w2 = tl.load(weight + HALF + d).to(tl.float32)
    y1 = (w1 * (x1 * inv).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    y2 = (w2 * (x2 * inv).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    return y1, y2


@triton.jit
def rope_kv_write(q, k, v, cos, sin, write_pos, k_cache_in, v_cache_in,
                  seq, max_seq,
                  q_out, k_cache, v_cache,
                  Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr):
    """One program per (batch row, new position): every head at once, as [heads, D/2] tiles."""
    bs = tl.program_id(0)
    b = bs // seq
    s = bs % seq
    pos = tl.load(write_pos + b) + s
    d = tl.arange(0, HALF)[None, :]
    inside = (d * 0 + pos) < max_seq  # as a [1, HALF] tensor: Triton 3.9's interpreter mishandles scalar masks
    c = tl.load(cos + pos * HALF + d, mask=inside, other=0.0).to(tl.float32)
    sn = tl.load(sin + pos * HALF + d, mask=inside, other=0.0).to(tl.float32)

    hq = tl.arange(0, triton.next_power_of_2(Q_HEADS))[:, None]
    rows = ((b * Q_HEADS + hq) * seq + s) * (2 * HALF)
    heads = hq < Q_HEADS
    y1, y2 = _rotate(tl.load(q + rows + d, mask=heads).to(tl.float32),
                     tl.load(q + rows + HALF + d, mask=heads).to(tl.float32), c, sn)
    tl.store(q_out + rows + d, y1.to(tl.bfloat16), mask=heads)
    tl.store(q_out + rows + HALF + d, y2.to(tl.bfloat16), mask=heads)

    hk = tl.arange(0, triton.next_power_of_2(KV_HEADS))[:, None]
    src = ((b * KV_HEADS + hk) * seq + s) * (2 * HALF)
    dst = ((b * KV_HEADS + hk) * max_seq + pos) * (2 * HALF)
    heads = hk < KV_HEADS
    keep = heads & inside
    y1, y2 = _rotate(tl.load(k + src + d, mask=heads).to(tl.float32),
                     tl.load(k + src + HALF + d, mask=heads).to(tl.float32), c, sn)
    tl.store(k_cache + dst + d, y1.to(tl.bfloat16), mask=keep)
    tl.store(k_cache + dst + HALF + d, y2.to(tl.bfloat16), mask=keep)
    tl.store(v_cache + dst + d, tl.load(v + src + d, mask=heads), mask=keep)
    tl.store(v_cache + dst + HALF + d, tl.load(v + src + HALF + d, mask=heads), mask=keep)


@triton.jit
def qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, write_pos, q_out, k_cache, v_cache, seq, max_seq, eps,
                          Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (batch row, new position). qkv [B·S, (Hq + 2·Hkv)·D] is the fused projection's output;
    q_out [B·S, Hq·D] gets q normalised and rotated; k (normalised, rotated) and v go into the caches."""
    await_inputs(PDL)
    bs = tl.program_id(0)
    b = bs // seq
    s = bs % seq
    D: tl.constexpr = 2 * HALF
    ROW: tl.constexpr = (Q_HEADS + 2 * KV_HEADS) * D
    pos = tl.load(write_pos + b) + s
    d = tl.arange(0, HALF)[None, :]
    inside = (d * 0 + pos) < max_seq
    c = tl.load(cos + pos * HALF + d, mask=inside, other=0.0).to(tl.float32)
    sn = tl.load(sin + pos * HALF + d, mask=inside, other=0.0).to(tl.float32)
    src = qkv + bs * ROW

    hq = tl.arange(0, triton.next_power_of_2(Q_HEADS))[:, None]
    heads = hq < Q_HEADS
    x1, x2 = _head_norm(tl.load(src + hq * D + d, mask=heads, other=0.0).to(tl.float32),
                        tl.load(src + hq * D + HALF + d, mask=heads, other=0.0).to(tl.float32), q_norm, eps, d, HALF)
    y1, y2 = _rotate(x1, x2, c, sn)
    tl.store(q_out + bs * Q_HEADS * D + hq * D + d, y1.to(tl.bfloat16), mask=heads)
    tl.store(q_out + bs * Q_HEADS * D + hq * D + HALF + d, y2.to(tl.bfloat16), mask=heads)

    hk = tl.arange(0, triton.next_power_of_2(KV_HEADS))[:, None]
    heads = hk < KV_HEADS
    keep = heads & inside
    dst = ((b * KV_HEADS + hk) * max_seq + pos) * D
    k_src = src + Q_HEADS * D + hk * D
    x1, x2 = _head_norm(tl.load(k_src + d, mask=heads, other=0.0).to(tl.float32),
                        tl.load(k_src + HALF + d, mask=heads, other=0.0).to(tl.float32), k_norm, eps, d, HALF)
    y1, y2 = _rotate(x1, x2, c, sn)
    tl.store(k_cache + dst + d, y1.to(tl.bfloat16), mask=keep)
    tl.store(k_cache + dst + HALF + d, y2.to(tl.bfloat16), mask=keep)
    v_src = src + (Q_HEADS + KV_HEADS) * D + hk * D
    tl.store(v_cache + dst + d, tl.load(v_src + d, mask=heads), mask=keep)
    tl.store(v_cache + dst + HALF + d, tl.load(v_src + HALF + d, mask=heads), mask=keep)


@triton.jit
def _attend(q_tile, k_rows, v_rows, start, stop, q_pos, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
            LOW_HALF: tl.constexpr = False, k_desc=None, v_desc=None, desc_row=0, TMA: tl.constexpr = False):
    """Online softmax of q_tile [R, D] (pre-scaled, bf16) over keys start..stop-1 of one head's cache rows, key j
    visible to query row r when j ≤ q_pos[r]. Returns (unnormalised output [R, D], running max [R], sum [R]).

    The softmax weights multiply the values as two bf16 parts, p's nearest bf16 and the rest, summed in fp32: as
    exact as fp32 weights (the graph's Attention computes them in fp32 — one bf16 part alone changes a quarter of the
    bf16-rounded outputs at head width 128). LOW_HALF: the tile's lower R/2 rows repeat its upper ones, so one MMA
    takes both parts (upper rows the bf16 part, lower rows the rest; the caller adds the halves); else two MMAs.

    TMA: the key and value blocks come by bulk tensor copies through k_desc and v_desc (the caches as [rows, D], this
    head's keys from row desc_row on): whole blocks, so rows past `stop` hold whatever the cache holds there (zeros
    past its end). Their scores are masked below as the loads' zeros would be; their values are zeroed, as a stale
    inf or NaN times a zero weight would not be: the same numbers as the masked loads."""
    d = tl.arange(0, HEAD_DIM)
    R: tl.constexpr = q_tile.shape[0]
    low = (tl.arange(0, R) >= R // 2)[:, None]
    m = tl.full([R], NEG, tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, HEAD_DIM], tl.float32)
    for s0 in range(start, stop, BLOCK_S):
        j = s0 + tl.arange(0, BLOCK_S)
        inside = j < stop
        if TMA:
            row = (desc_row + s0).to(tl.int32)
            kt = k_desc.load([row, 0])
            vt = v_desc.load([row, 0])
            vt = tl.where(inside[:, None], vt, tl.zeros_like(vt))
        else:
            kt = tl.load(k_rows + j[:, None] * HEAD_DIM + d[None, :], mask=inside[:, None], other=0.0)
            vt = tl.load(v_rows + j[:, None] * HEAD_DIM + d[None, :], mask=inside[:, None], other=0.0)
        scores = mma(q_tile, tl.trans(kt), tl.zeros([R, BLOCK_S], tl.float32))
        scores = tl.where(inside[None, :] & (j[None, :] <= q_pos[:, None]), scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        p_hi = p.to(tl.bfloat16).to(tl.float32)
        if LOW_HALF:
            acc = mma(tl.where(low, p - p_hi, p_hi).to(tl.bfloat16), vt, acc * alpha[:, None])
        else:
            acc = mma(p_hi.to(tl.bfloat16), vt, acc * alpha[:, None])
            acc = mma((p - p_hi).to(tl.bfloat16), vt, acc)
        m = m_new
    return acc, m, l


@triton.jit
def decode_attention(q, k_cache, v_cache, write_pos,
                     seq, max_seq,
                     out,
                     Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_S: tl.constexpr):
    """Plugin form. q [B, Hq, S, D] (RoPE applied, scaled by 1/√D), caches [B, Hkv, max_seq, D] already holding the
    new rows → out [B, Hq, S, D]. Grid (B, Hkv, ⌈S·G / BLOCK_Q⌉), G = Hq / Hkv query heads per KV head."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    G: tl.constexpr = Q_HEADS // KV_HEADS
    r = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    valid = r < seq * G
    s = r // G
    head = g * G + r % G
    q_pos = tl.where(valid, tl.load(write_pos + b) + s, 0)
    d = tl.arange(0, HEAD_DIM)
    rows = ((b * Q_HEADS + head) * seq + s) * HEAD_DIM
    q_tile = tl.load(q + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    cache = (b * KV_HEADS + g) * max_seq * HEAD_DIM
    stop = tl.minimum(tl.max(q_pos, axis=0) + 1, max_seq)
    acc, m, l = _attend(q_tile, k_cache + cache, v_cache + cache, 0, stop, q_pos, HEAD_DIM, BLOCK_S)
    tl.store(out + rows[:, None] + d[None, :], (acc / l[:, None]).to(tl.bfloat16), mask=valid[:, None])


@triton.jit
def decode_attention_split(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, write_pos, out, partials, stats, tickets,
                           max_seq, eps, out_scale,
                           Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK_S: tl.constexpr, MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr = False,
                           OUT_FP8: tl.constexpr = False, PREFETCH: tl.constexpr = False, k_desc=None, v_desc=None,
                           TMA: tl.constexpr = False, LATE_LAUNCH: tl.constexpr = False):
    """GPU path, one new row per batch row, from the fused q|k|v projection's rows qkv [B, (Hq + 2·Hkv)·D]: what
    qk_norm_rope_kv_write does for the row (q and k normalised per head and rotated at position write_pos[b], k and
    v written into the caches there), then attention over the prefix 0..write_pos[b] → out [B, Hq·D]. One kernel
    instead of two: at one row both are latency, not bytes.

    Grid (B, Hkv, MAX_CHUNKS): program c reads keys [c·CHUNK, (c+1)·CHUNK) of the row's prefix. A prefix of several
    chunks is combined, in chunk order, by the program that finishes last (partials [B, Hq, MAX_CHUNKS, D], stats
    [B, Hq, MAX_CHUNKS, 2] fp32).
    OUT_FP8: out holds the bf16 result quantized at out_scale, the FP8 o projection's input (quantized once here,
    not in each of that GEMM's programs: at 64 rows they spent more time quantizing than reading weights).
    LATE_LAUNCH: the next kernel may launch once every program has finished, not once every program has waited.

    Before the wait (PDL: while the q|k|v GEMM runs) it reads only what no kernel of this step writes: the row's
    position (advance_slots, at the end of the previous step), the RoPE table and, with PREFETCH, its chunk's cached
    keys and values, sent to L2 (written by earlier steps; the row at `pos`, rewritten below, is fetched stale
    and never read stale: L2 is where the write goes).

    TMA: keys and values by bulk tensor copies (_attend) through k_desc and v_desc, descriptors of the caches viewed as
    [B·Hkv·max_seq, D] with blocks [BLOCK_S, D]; the same numbers as per-thread loads. The copies read through the
    async proxy, so the new key and value, written here through the generic one, are fenced before them."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    c = tl.program_id(2)
    G: tl.constexpr = Q_HEADS // KV_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.minimum(tl.load(write_pos + b), max_seq - 1)
    length = pos + 1
    chunks = (length + CHUNK - 1) // CHUNK
    half = tl.arange(0, HALF)[None, :]
    co = tl.load(cos + pos * HALF + half).to(tl.float32)  # pos < max_seq, the table's rows
    sn = tl.load(sin + pos * HALF + half).to(tl.float32)
    if PREFETCH:
        _prefetch_chunk(k_cache, v_cache, ((b * KV_HEADS + g) * max_seq) * HEAD_DIM, c * CHUNK,
                        tl.minimum(c * CHUNK + CHUNK, length), HEAD_DIM, CHUNK)
    await_inputs(PDL, LAUNCH_NEXT=not LATE_LAUNCH)
    if c < chunks:
        src = qkv + b * ((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
        if c == chunks - 1:  # the program of the last chunk writes the new key and value first
            k_src = src + (Q_HEADS + g) * HEAD_DIM
            k1, k2 = _head_norm(tl.load(k_src + half).to(tl.float32), tl.load(k_src + HALF + half).to(tl.float32),
                                k_norm, eps, half, HALF)
            k1, k2 = _rotate(k1, k2, co, sn)
            row = ((b * KV_HEADS + g) * max_seq + pos) * HEAD_DIM
            tl.store(k_cache + row + half, k1.to(tl.bfloat16))
            tl.store(k_cache + row + HALF + half, k2.to(tl.bfloat16))
            v_src = src + (Q_HEADS + KV_HEADS + g) * HEAD_DIM
            tl.store(v_cache + row + half, tl.load(v_src + half))
            tl.store(v_cache + row + HALF + half, tl.load(v_src + HALF + half))
            if TMA:
                _fence_async_proxy()
            tl.debug_barrier()  # the block's stores are visible to its loads of the last chunk
        # one MMA tile of 16 rows: rows r and r + 8 are query head g·G + r (r < G), the second copy for the low part
        # of the softmax weights (_attend's LOW_HALF): the tile's spare rows, so the exact product costs no MMA more
        tl.static_assert(G <= 8)
        lane = tl.arange(0, 16) % 8
        head = g * G + tl.where(lane < G, lane, 0)
        q_src = src + head[:, None] * HEAD_DIM + half
        q1, q2 = _head_norm(tl.load(q_src, mask=(lane < G)[:, None], other=0.0).to(tl.float32),
                            tl.load(q_src + HALF, mask=(lane < G)[:, None], other=0.0).to(tl.float32), q_norm, eps,
                            half, HALF)
        q1, q2 = _rotate(q1, q2, co, sn)
        # q rounded to bf16 as rotated, then scaled and rounded again; the graph's scale is a bf16 constant
        scale = (1.0 / tl.sqrt(HEAD_DIM * 1.0)).to(tl.bfloat16).to(tl.float32)
        q1 = (q1.to(tl.bfloat16).to(tl.float32) * scale).to(tl.bfloat16)
        q2 = (q2.to(tl.bfloat16).to(tl.float32) * scale).to(tl.bfloat16)
        q_tile = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (16, HEAD_DIM))
        q_pos = tl.zeros([16], tl.int64) + pos
        cache = (b * KV_HEADS + g) * max_seq * HEAD_DIM
        start = c * CHUNK
        acc, m, l = _attend(q_tile, k_cache + cache, v_cache + cache, start, tl.minimum(start + CHUNK, length), q_pos,
                            HEAD_DIM, BLOCK_S, LOW_HALF=True, k_desc=k_desc, v_desc=v_desc,
                            desc_row=(b * KV_HEADS + g) * max_seq, TMA=TMA)
        acc = tl.sum(tl.reshape(acc, (2, 8, HEAD_DIM)), axis=0)  # the two parts' products, head by head
        m = tl.max(tl.reshape(m, (2, 8)), axis=0)  # both copies of a head have the same max and sum
        l = tl.max(tl.reshape(l, (2, 8)), axis=0)
        r = tl.arange(0, 8)
        valid = r < G
        head = g * G + tl.where(valid, r, 0)
        d = tl.arange(0, HEAD_DIM)
        q_rows = (b * Q_HEADS + head) * HEAD_DIM
        part = (b * Q_HEADS + head) * MAX_CHUNKS
        if chunks == 1:
            _store_attention(out, q_rows, d, acc / l[:, None], valid, out_scale, OUT_FP8)
        else:
            tl.store(partials + (part + c)[:, None] * HEAD_DIM + d[None, :], acc, mask=valid[:, None])
            tl.store(stats + (part + c) * 2, m, mask=valid)
            tl.store(stats + (part + c) * 2 + 1, l, mask=valid)
            tl.debug_barrier()
            ticket = tl.atomic_add(tickets + b * KV_HEADS + g, 1, sem="acq_rel", scope="gpu")
            if ticket == chunks - 1:
                tl.debug_barrier()
                _combine_chunks(out, partials, stats, part, q_rows, d, valid, chunks, out_scale, HEAD_DIM, OUT_FP8)
                tl.atomic_xchg(tickets + b * KV_HEADS + g, 0, sem="relaxed", scope="gpu")
    if LATE_LAUNCH:
        launch_next(PDL)


@triton.jit
def _prefetch_chunk(k_cache, v_cache, cache, start, stop, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Keys and values of rows start..stop-1 into L2, in 128 pieces (one a thread at 4 warps): a piece of CHUNK / 64
    rows of keys or of values each."""
    tl.static_assert(CHUNK % 64 == 0)
    ROWS: tl.constexpr = CHUNK // 64
    i = tl.arange(0, 128)
    first = start + (i % 64) * ROWS
    base = tl.where(i < 64, k_cache, v_cache) + cache + first * HEAD_DIM
    prefetch_l2(base, (tl.minimum(stop - first, ROWS) * HEAD_DIM * 2).to(tl.int32), first < stop)


@triton.jit
def _combine_chunks(out, partials, stats, part, q_rows, d, valid, chunks, out_scale, HEAD_DIM: tl.constexpr,
                    OUT_FP8: tl.constexpr):
    """The chunks' (unnormalised output, max, sum) of each head, combined in chunk order (L2 reads: other programs
    wrote them)."""
    R: tl.constexpr = valid.shape[0]
    top = tl.full([R], NEG, tl.float32)
    for i in range(0, chunks):
        top = tl.maximum(top, tl.load(stats + (part + i) * 2, mask=valid, other=NEG, cache_modifier=".cg"))
    total = tl.zeros([R, HEAD_DIM], tl.float32)
    norm = tl.zeros([R], tl.float32)
    for i in range(0, chunks):
        w = tl.exp(tl.load(stats + (part + i) * 2, mask=valid, other=NEG, cache_modifier=".cg") - top)
        norm += w * tl.load(stats + (part + i) * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg")
        total += w[:, None] * tl.load(partials + (part + i)[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None],
                                      other=0.0, cache_modifier=".cg")
    norm = tl.where(valid, norm, 1.0)
    _store_attention(out, q_rows, d, total / norm[:, None], valid, out_scale, OUT_FP8)


@triton.jit
def _store_attention(out, q_rows, d, value, valid, out_scale, OUT_FP8: tl.constexpr):
    value = value.to(tl.bfloat16)
    if OUT_FP8:
        value = quantize(value.to(tl.float32), out_scale)
    tl.store(out + q_rows[:, None] + d[None, :], value, mask=valid[:, None])


@triton.jit
def _uniform(seed, row, codebook):
    """splitmix64(seed, row, codebook) → a uniform in [0, 1) with 24 bits (exact in fp32)."""
    x = seed.to(tl.uint64) * 0x9E3779B97F4A7C15 + row.to(tl.uint64) * 0xBF58476D1CE4E5B9 + codebook.to(tl.uint64)
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    return (x >> 40).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _sample(x, valid, t, top_k, top_p, u, vocab, BLOCK_V: tl.constexpr):
    """One code from logits x [BLOCK_V] (invalid lanes ignored) by temperature, top-k, top-p and uniform u."""
    z = tl.where(valid, x / t, -float("inf"))
    if top_k > 0:
        if top_k < vocab:  # the k-th largest value by bisection; ties with it are kept
            lo = tl.min(tl.where(valid, z, float("inf")), axis=0)
            hi = tl.max(z, axis=0)
            for _ in range(40):
                mid = (lo + hi) * 0.5
                many = tl.sum((z >= mid).to(tl.int32), axis=0) >= top_k
                lo = tl.where(many, mid, lo)
                hi = tl.where(many, hi, mid)
            z = tl.where(z >= lo, z, -float("inf"))
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    if top_p < 1.0:  # keep codes whose strictly-more-likely mass is below top_p (the best always stays)
        lo = 0.0
        hi = tl.max(p, axis=0)
        for _ in range(40):
            mid = (lo + hi) * 0.5
            above = tl.sum(tl.where(p > mid, p, 0.0), axis=0)
            lo = tl.where(above >= top_p, mid, lo)
            hi = tl.where(above >= top_p, hi, mid)
        p = tl.where(p >= hi, p, 0.0)
    cdf = tl.cumsum(p, axis=0)
    target = u * tl.sum(p, axis=0)
    lane = tl.arange(0, BLOCK_V)
    pick = tl.sum(((cdf <= target) & (lane < vocab)).to(tl.int32), axis=0)
    return tl.minimum(pick, vocab - 1)


@triton.jit
def _codebook_row(logits, b, hb, row, end, table, temperature, top_k, top_p, seed, codes, embedding, end_next,
                  K: tl.constexpr, VOCAB: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_H: tl.constexpr, SAMPLING: tl.constexpr, FIND_END: tl.constexpr):
    """Program (b, hb): all K codes of row b (each program of the row computes them alike; hb 0 stores them),
    then the embedding's hidden slice hb."""
    books = tl.arange(0, K)
    lanes = tl.arange(0, BLOCK_V)
    valid = lanes < VOCAB
    x = tl.load(logits + (b * K + books[:, None]) * VOCAB + lanes[None, :], mask=valid[None, :], other=-float("inf"))
    chosen = tl.argmax(x, axis=1, tie_break_left=True).to(tl.int32)
    if SAMPLING:
        t = tl.load(temperature + b)
        if t > 0:
            for k in tl.static_range(K):
                xk = tl.load(logits + (b * K + k) * VOCAB + lanes, mask=valid, other=-float("inf"))
                code = _sample(xk, valid, t, tl.load(top_k + b), tl.load(top_p + b),
                               _uniform(tl.load(seed + b), row, tl.full([], k, tl.int64)), VOCAB, BLOCK_V)
                chosen = tl.where(books == k, code.to(tl.int32), chosen)
    chosen = tl.where(row < books, BOC, chosen)
    chosen = tl.where(row - books >= end, EOC, chosen)
    fed = chosen
    if FIND_END:  # EOC on codebook 0 ends the audio at this row's frame; after the ramp-up, on codebook k at row - k
        counts = (chosen == EOC) & ((books == 0) | (row >= K)) & (row - books >= 0)
        end = tl.minimum(end, tl.min(tl.where(counts, row - books, end), axis=0))
        fed = tl.where(row - books >= end, EOC, chosen)
        if hb == 0:
            tl.store(end_next + b, end)
    if hb == 0:
        tl.store(codes + b * K + books, chosen)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = books.to(tl.int64) * VOCAB + fed
    gathered = tl.load(table + rows[:, None] * HIDDEN + h[None, :], mask=h[None, :] < HIDDEN, other=0.0)
    tl.store(embedding + b * HIDDEN + h, tl.sum(gathered.to(tl.float32), axis=0).to(tl.bfloat16), mask=h < HIDDEN)


@triton.jit
def delayed_codebook_step(logits, row_index, end_frame, table,
                          codes, embedding,
                          K: tl.constexpr, VOCAB: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    """Greedy: the engine's step (its graph contract samples on the host, when it samples). Grid (B, ⌈H/BLOCK_H⌉)."""
    b = tl.program_id(0)
    _codebook_row(logits, b, tl.program_id(1), tl.load(row_index + b), tl.load(end_frame + b), table, table, table,
                  table, table, codes, embedding, codes, K, VOCAB, HIDDEN, BLOCK_V, BLOCK_H, False, False)


# The GPU path launches it on slot slices that start anywhere (a run of joins): the per-slot state pointers are left
# unspecialized on alignment, or Triton compiles a variant (~0.5 s) for each slot offset's alignment on the request
# path. The logits, table, codes and embedding rows are 16-byte multiples: aligned at any slot.
@triton.jit(do_not_specialize_on_alignment=["row_index", "end_frame", "temperature", "top_k", "top_p", "seed",
                                            "end_next"])
def delayed_codebook_sample(logits, row_index, end_frame, table, temperature, top_k, top_p, seed,
                            codes, embedding, end_next,
                            K: tl.constexpr, VOCAB: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_V: tl.constexpr,
                            BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """GPU path: greedy where temperature[b] is 0, else seeded sampling; the state (row, end, seed) lives on the
    device; end_next gets the end frame after this row (builder/gpu_kernels.advance_slots makes it current)."""
    await_inputs(PDL)
    b = tl.program_id(0)
    _codebook_row(logits, b, tl.program_id(1), tl.load(row_index + b), tl.load(end_frame + b), table, temperature,
                  top_k, top_p, seed, codes, embedding, end_next, K, VOCAB, HIDDEN, BLOCK_V, BLOCK_H, True, True)
