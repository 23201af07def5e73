"""Decode attention: causal attention of new rows over a static KV cache [B, Hkv, S_max, D] (GQA), reading only each
row's valid prefix (keys 0..write_pos[b] + s), q scaled beforehand (as the graph's Attention op takes it).

prompt_attention is the GPU engine's form for a prefill: each prompt's rows attend to the keys of the slot it was
written into, so a prompt whose reference part's keys are already there (the prefix cache) starts past them.

decode_attention_split is the GPU engine's form for one new row: it starts from the q|k|v projection's row (the work
of rope.qk_norm_rope_kv_write for that row, then attention), splits the prefix into fixed chunks of CHUNK keys for
parallelism and combines them in chunk order, so a row's result depends only on its own length, never on the
batch.

The GPU engine's cache is paged (runtime/gpu/kv_pages.py): a pool [pages, Hkv, PAGE, D] and a page table [slots,
⌈max_seq / PAGE⌉], key j of a slot at position j % PAGE of page table[slot, j // PAGE]. PAGE is a multiple of the key
block, so every block of keys lies in one page: one table load a block, the same loads (or one bulk copy) as from a
slot's own cache row, the same numbers."""

import triton
import triton.language as tl

from .primitives import NEG, await_inputs, fence_async_proxy, launch_next, mma, prefetch_l2, quantize
from .rope import head_norm, rotate


@triton.jit
def _attend(q_tile, k_rows, v_rows, start, stop, q_pos, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
            LOW_HALF: tl.constexpr = False, k_desc=None, v_desc=None, desc_row=0, TMA: tl.constexpr = False,
            pages=None, PAGE: tl.constexpr = 0, PAGE_ROWS: tl.constexpr = 0):
    """Online softmax of q_tile [R, D] (pre-scaled, bf16) over keys start..stop-1 of one head's cache rows, key j
    visible to query row r when j ≤ q_pos[r]. Returns (unnormalised output [R, D], running max [R], sum [R]).

    Key j is row j of k_rows and v_rows; with PAGE (paged caches, start a multiple of BLOCK_S, PAGE of BLOCK_S) row
    pages[j // PAGE] · PAGE_ROWS + j % PAGE, PAGE_ROWS being a page's rows of every head.

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
        if PAGE:
            first = tl.load(pages + s0 // PAGE).to(tl.int64) * PAGE_ROWS + s0 % PAGE  # the block's first key's row
            keys = first + tl.arange(0, BLOCK_S)
        else:
            first = s0
            keys = j
        if TMA:
            row = (desc_row + first).to(tl.int32)
            kt = k_desc.load([row, 0])
            vt = v_desc.load([row, 0])
            vt = tl.where(inside[:, None], vt, tl.zeros_like(vt))
        else:
            kt = tl.load(k_rows + keys[:, None] * HEAD_DIM + d[None, :], mask=inside[:, None], other=0.0)
            vt = tl.load(v_rows + keys[:, None] * HEAD_DIM + d[None, :], mask=inside[:, None], other=0.0)
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
    _causal_rows(q, k_cache, v_cache, write_pos, None, None, seq, max_seq, out, Q_HEADS, KV_HEADS, HEAD_DIM,
                 BLOCK_Q, BLOCK_S, 0)


@triton.jit
def prompt_attention(q, k_cache, v_cache, write_pos, slots, pages, seq, max_seq, out,
                     Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_S: tl.constexpr, PAGE: tl.constexpr):
    """GPU engine's prefill form: prompt b's S rows (q [B, Hq, S, D], scaled) sit at positions write_pos[b] + s of
    slot slots[b] (paged caches [pages, Hkv, PAGE, D] and the page table pages [slots, ⌈max_seq / PAGE⌉], keys and
    values written there, those before write_pos[b] too) → out [B, Hq, S, D]; slots[b] < 0: a prompt that only fills
    the launch up, nothing stored. Grid as decode_attention's."""
    _causal_rows(q, k_cache, v_cache, write_pos, slots, pages, seq, max_seq, out, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_Q,
                 BLOCK_S, PAGE)


@triton.jit
def _causal_rows(q, k_cache, v_cache, write_pos, slots, pages, seq, max_seq, out, Q_HEADS: tl.constexpr,
                 KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr,
                 PAGE: tl.constexpr):
    """This program's (position, query head) rows of batch row b at positions write_pos[b] + s, over the keys
    0..position of slot slots[b] through its pages (slots None: cache row b of [B, Hkv, max_seq, D], the plugin
    form's code as it was without slots). The key blocks start at key 0 whatever the rows, so a row's result is the
    same in any launch that holds the same keys before it."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    G: tl.constexpr = Q_HEADS // KV_HEADS
    r = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    valid = r < seq * G
    row = b
    if slots is not None:
        row = tl.load(slots + b)
        valid = valid & ((r * 0 + row) >= 0)  # as a tensor: the interpreter mishandles scalar masks
        row = tl.maximum(row, 0)  # without a slot key 0 of row 0 is read, and nothing stored
    s = r // G
    head = g * G + r % G
    q_pos = tl.where(valid, tl.load(write_pos + b) + s, 0)
    d = tl.arange(0, HEAD_DIM)
    rows = ((b * Q_HEADS + head) * seq + s) * HEAD_DIM
    q_tile = tl.load(q + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if PAGE:
        cache = g * PAGE * HEAD_DIM  # head g's rows of any page
        pages += row * ((max_seq + PAGE - 1) // PAGE)
    else:
        cache = (row * KV_HEADS + g) * max_seq * HEAD_DIM
    stop = tl.minimum(tl.max(q_pos, axis=0) + 1, max_seq)
    acc, m, l = _attend(q_tile, k_cache + cache, v_cache + cache, 0, stop, q_pos, HEAD_DIM, BLOCK_S, pages=pages,
                        PAGE=PAGE, PAGE_ROWS=KV_HEADS * PAGE)
    tl.store(out + rows[:, None] + d[None, :], (acc / l[:, None]).to(tl.bfloat16), mask=valid[:, None])


@triton.jit
def decode_attention_split(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, write_pos, out, partials, stats, tickets,
                           max_seq, eps, out_scale,
                           Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK_S: tl.constexpr, MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr = False,
                           OUT_FP8: tl.constexpr = False, PREFETCH: tl.constexpr = False, k_desc=None, v_desc=None,
                           TMA: tl.constexpr = False, LATE_LAUNCH: tl.constexpr = False, pages=None, active=None,
                           PAGE: tl.constexpr = 0):
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
    [rows, D] with blocks [BLOCK_S, D]; the same numbers as per-thread loads. The copies read through the async
    proxy, so the new key and value, written here through the generic one, are fenced before them.

    PAGE: the engine's paged caches [pages, Hkv, PAGE, D] with the page table `pages` [B, ⌈max_seq / PAGE⌉] (module
    docstring); a row whose slot is not `active` neither writes nor reads (a released slot's pages may be another
    slot's by now; its output is nobody's). Without PAGE: caches [B, Hkv, max_seq, D], every row is computed
    (`bench attention`'s layout)."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    c = tl.program_id(2)
    G: tl.constexpr = Q_HEADS // KV_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.minimum(tl.load(write_pos + b), max_seq - 1)
    length = pos + 1
    # the page table and the active flags are written by prefills and releases, before the step's first kernel
    if PAGE:
        length *= (tl.load(active + b) != 0).to(length.dtype)
        pages += b * ((max_seq + PAGE - 1) // PAGE)
        desc_row = g * PAGE  # head g's rows of any page
        new_row = tl.load(pages + pos // PAGE).to(tl.int64) * (KV_HEADS * PAGE) + pos % PAGE
    else:
        desc_row = (b * KV_HEADS + g) * max_seq
        new_row = pos
    cache = desc_row * HEAD_DIM
    chunks = (length + CHUNK - 1) // CHUNK
    half = tl.arange(0, HALF)[None, :]
    co = tl.load(cos + pos * HALF + half).to(tl.float32)  # pos < max_seq, the table's rows
    sn = tl.load(sin + pos * HALF + half).to(tl.float32)
    if PREFETCH:
        _prefetch_chunk(k_cache, v_cache, cache, c * CHUNK, tl.minimum(c * CHUNK + CHUNK, length), HEAD_DIM, CHUNK,
                        pages, PAGE, KV_HEADS * PAGE)
    await_inputs(PDL, LAUNCH_NEXT=not LATE_LAUNCH)
    if c < chunks:
        src = qkv + b * ((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
        if c == chunks - 1:  # the program of the last chunk writes the new key and value first
            k_src = src + (Q_HEADS + g) * HEAD_DIM
            k1, k2 = head_norm(tl.load(k_src + half).to(tl.float32), tl.load(k_src + HALF + half).to(tl.float32),
                                k_norm, eps, half, HALF)
            k1, k2 = rotate(k1, k2, co, sn)
            row = cache + new_row * HEAD_DIM
            tl.store(k_cache + row + half, k1.to(tl.bfloat16))
            tl.store(k_cache + row + HALF + half, k2.to(tl.bfloat16))
            v_src = src + (Q_HEADS + KV_HEADS + g) * HEAD_DIM
            tl.store(v_cache + row + half, tl.load(v_src + half))
            tl.store(v_cache + row + HALF + half, tl.load(v_src + HALF + half))
            if TMA:
                fence_async_proxy()
            tl.debug_barrier()  # the block's stores are visible to its loads of the last chunk
        # one MMA tile of 16 rows: rows r and r + 8 are query head g·G + r (r < G), the second copy for the low part
        # of the softmax weights (_attend's LOW_HALF): the tile's spare rows, so the exact product costs no MMA more
        tl.static_assert(G <= 8)
        lane = tl.arange(0, 16) % 8
        head = g * G + tl.where(lane < G, lane, 0)
        q_src = src + head[:, None] * HEAD_DIM + half
        q1, q2 = head_norm(tl.load(q_src, mask=(lane < G)[:, None], other=0.0).to(tl.float32),
                            tl.load(q_src + HALF, mask=(lane < G)[:, None], other=0.0).to(tl.float32), q_norm, eps,
                            half, HALF)
        q1, q2 = rotate(q1, q2, co, sn)
        # q rounded to bf16 as rotated, then scaled and rounded again; the graph's scale is a bf16 constant
        scale = (1.0 / tl.sqrt(HEAD_DIM * 1.0)).to(tl.bfloat16).to(tl.float32)
        q1 = (q1.to(tl.bfloat16).to(tl.float32) * scale).to(tl.bfloat16)
        q2 = (q2.to(tl.bfloat16).to(tl.float32) * scale).to(tl.bfloat16)
        q_tile = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (16, HEAD_DIM))
        q_pos = tl.zeros([16], tl.int64) + pos
        start = c * CHUNK
        acc, m, l = _attend(q_tile, k_cache + cache, v_cache + cache, start, tl.minimum(start + CHUNK, length), q_pos,
                            HEAD_DIM, BLOCK_S, LOW_HALF=True, k_desc=k_desc, v_desc=v_desc, desc_row=desc_row, TMA=TMA,
                            pages=pages, PAGE=PAGE, PAGE_ROWS=KV_HEADS * PAGE)
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
def _prefetch_chunk(k_cache, v_cache, cache, start, stop, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, pages,
                    PAGE: tl.constexpr, PAGE_ROWS: tl.constexpr):
    """Keys and values of keys start..stop-1 into L2, in 128 pieces (one a thread at 4 warps): a piece of CHUNK / 64
    keys or of values each (paged: in one page, PAGE a multiple of CHUNK / 64, found as _attend finds a key)."""
    tl.static_assert(CHUNK % 64 == 0)
    ROWS: tl.constexpr = CHUNK // 64
    i = tl.arange(0, 128)
    first = start + (i % 64) * ROWS
    row = first
    if PAGE:
        tl.static_assert(PAGE % ROWS == 0)
        row = tl.load(pages + first // PAGE, mask=first < stop, other=0).to(tl.int64) * PAGE_ROWS + first % PAGE
    base = tl.where(i < 64, k_cache, v_cache) + cache + row * HEAD_DIM
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
