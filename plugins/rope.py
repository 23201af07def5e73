"""RoPE and the KV-cache write.

rope_kv_write (the TensorRT plugin's kernel): per (batch row, position), for all heads, NeoX half-split RoPE with the
bf16 cos/sin table at position write_pos[b] + s, in fp32 with one rounding to bf16: q heads go to q_out, k heads are
written into the key cache at that position and v rows into the value cache (in place; rows at or past max_seq are
dropped). qk_norm_rope_kv_write is the GPU engine's form for a prefill: it reads the fused q|k|v projection rows,
applies the per-head q/k RMSNorm first (a decode step does the same inside attention.decode_attention_split) and
writes each prompt's keys and values straight into its slot's pages (the paged cache: plugins/attention.py)."""

import triton
import triton.language as tl

from .primitives import await_inputs


@triton.jit
def rotate(x1, x2, c, sn):
    return x1 * c - x2 * sn, x2 * c + x1 * sn


@triton.jit
def head_norm(x1, x2, weight, eps, d, HALF: tl.constexpr):
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
    y1, y2 = rotate(tl.load(q + rows + d, mask=heads).to(tl.float32),
                     tl.load(q + rows + HALF + d, mask=heads).to(tl.float32), c, sn)
    tl.store(q_out + rows + d, y1.to(tl.bfloat16), mask=heads)
    tl.store(q_out + rows + HALF + d, y2.to(tl.bfloat16), mask=heads)

    hk = tl.arange(0, triton.next_power_of_2(KV_HEADS))[:, None]
    src = ((b * KV_HEADS + hk) * seq + s) * (2 * HALF)
    dst = ((b * KV_HEADS + hk) * max_seq + pos) * (2 * HALF)
    heads = hk < KV_HEADS
    keep = heads & inside
    y1, y2 = rotate(tl.load(k + src + d, mask=heads).to(tl.float32),
                     tl.load(k + src + HALF + d, mask=heads).to(tl.float32), c, sn)
    tl.store(k_cache + dst + d, y1.to(tl.bfloat16), mask=keep)
    tl.store(k_cache + dst + HALF + d, y2.to(tl.bfloat16), mask=keep)
    tl.store(v_cache + dst + d, tl.load(v + src + d, mask=heads), mask=keep)
    tl.store(v_cache + dst + HALF + d, tl.load(v + src + HALF + d, mask=heads), mask=keep)


@triton.jit
def qk_norm_rope_kv_write(qkv, q_norm, k_norm, cos, sin, write_pos, slots, last, pages, q_out, k_cache, v_cache, seq,
                          max_seq, eps, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                          PAGE: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (batch row, new position). qkv [B·S, (Hq + 2·Hkv)·D] is the fused projection's output;
    q_out [B·S, Hq·D] gets q normalised and rotated; k (normalised, rotated) and v go into slot slots[b] at position
    write_pos[b] + s: the paged caches [pages, Hkv, PAGE, D] through the page table pages [slots, ⌈max_seq / PAGE⌉].
    Only a prompt's own rows (B·S row index up to last[b]) are stored: padding rows past it could reach positions
    past the slot's pages. slots[b] < 0: nowhere, a prompt that only fills a launch up."""
    await_inputs(PDL)
    bs = tl.program_id(0)
    b = bs // seq
    s = bs % seq
    D: tl.constexpr = 2 * HALF
    ROW: tl.constexpr = (Q_HEADS + 2 * KV_HEADS) * D
    pos = tl.load(write_pos + b) + s
    slot = tl.load(slots + b)
    d = tl.arange(0, HALF)[None, :]
    inside = (d * 0 + pos) < max_seq
    c = tl.load(cos + pos * HALF + d, mask=inside, other=0.0).to(tl.float32)
    sn = tl.load(sin + pos * HALF + d, mask=inside, other=0.0).to(tl.float32)
    src = qkv + bs * ROW

    hq = tl.arange(0, triton.next_power_of_2(Q_HEADS))[:, None]
    heads = hq < Q_HEADS
    x1, x2 = head_norm(tl.load(src + hq * D + d, mask=heads, other=0.0).to(tl.float32),
                        tl.load(src + hq * D + HALF + d, mask=heads, other=0.0).to(tl.float32), q_norm, eps, d, HALF)
    y1, y2 = rotate(x1, x2, c, sn)
    tl.store(q_out + bs * Q_HEADS * D + hq * D + d, y1.to(tl.bfloat16), mask=heads)
    tl.store(q_out + bs * Q_HEADS * D + hq * D + HALF + d, y2.to(tl.bfloat16), mask=heads)

    hk = tl.arange(0, triton.next_power_of_2(KV_HEADS))[:, None]
    heads = hk < KV_HEADS
    keep = heads & inside & ((d * 0 + slot) >= 0) & ((d * 0 + bs) <= tl.load(last + b))
    max_pages = (max_seq + PAGE - 1) // PAGE
    page = tl.load(pages + tl.maximum(slot, 0) * max_pages + tl.minimum(pos, max_seq - 1) // PAGE).to(tl.int64)
    dst = ((page * KV_HEADS + hk) * PAGE + pos % PAGE) * D
    k_src = src + Q_HEADS * D + hk * D
    x1, x2 = head_norm(tl.load(k_src + d, mask=heads, other=0.0).to(tl.float32),
                        tl.load(k_src + HALF + d, mask=heads, other=0.0).to(tl.float32), k_norm, eps, d, HALF)
    y1, y2 = rotate(x1, x2, c, sn)
    tl.store(k_cache + dst + d, y1.to(tl.bfloat16), mask=keep)
    tl.store(k_cache + dst + HALF + d, y2.to(tl.bfloat16), mask=keep)
    v_src = src + (Q_HEADS + KV_HEADS) * D + hk * D
    tl.store(v_cache + dst + d, tl.load(v_src + d, mask=heads), mask=keep)
    tl.store(v_cache + dst + HALF + d, tl.load(v_src + HALF + d, mask=heads), mask=keep)
