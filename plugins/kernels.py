"""Triton kernels of the two custom ops. The same source is JIT-launched by the GPU tests and compiled ahead of time
to PTX for TensorRT's AOT plugins (plugins/qdp.py). Argument order is TensorRT's for AOT plugins: tensor inputs,
then int32 scalars, then tensor outputs (an aliased output is a separate argument pointing at its input).

rope_kv_write: per (batch row, position), for all heads, NeoX half-split RoPE with the bf16 cos/sin table at position
  write_pos[b] + s, in fp32 with one rounding to bf16: q heads go to q_out, k heads are written into the key cache
  at that position and v rows into the value cache (in place; rows at or past max_seq are dropped).
delayed_codebook_step: per batch row, per codebook: argmax over the 1026 logits (ties to the lowest index) or,
  where temperature[b] > 0, seeded sampling (temperature, top-k, top-p); then the delay mask (BOC before row k,
  EOC from the end frame on); then the next input embedding Σ_k table[k·1026 + code_k], fp32 sum, one bf16 round.
"""

import triton
import triton.language as tl

BOC = tl.constexpr(1024)
EOC = tl.constexpr(1025)


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
    x1 = tl.load(q + rows + d, mask=heads).to(tl.float32)
    x2 = tl.load(q + rows + HALF + d, mask=heads).to(tl.float32)
    tl.store(q_out + rows + d, (x1 * c - x2 * sn).to(tl.bfloat16), mask=heads)
    tl.store(q_out + rows + HALF + d, (x2 * c + x1 * sn).to(tl.bfloat16), mask=heads)

    hk = tl.arange(0, triton.next_power_of_2(KV_HEADS))[:, None]
    src = ((b * KV_HEADS + hk) * seq + s) * (2 * HALF)
    dst = ((b * KV_HEADS + hk) * max_seq + pos) * (2 * HALF)
    heads = hk < KV_HEADS
    keep = heads & inside
    x1 = tl.load(k + src + d, mask=heads).to(tl.float32)
    x2 = tl.load(k + src + HALF + d, mask=heads).to(tl.float32)
    tl.store(k_cache + dst + d, (x1 * c - x2 * sn).to(tl.bfloat16), mask=keep)
    tl.store(k_cache + dst + HALF + d, (x2 * c + x1 * sn).to(tl.bfloat16), mask=keep)
    tl.store(v_cache + dst + d, tl.load(v + src + d, mask=heads), mask=keep)
    tl.store(v_cache + dst + HALF + d, tl.load(v + src + HALF + d, mask=heads), mask=keep)


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
def _codebook_row(logits, b, hb, row, end, table, temperature, top_k, top_p, seed, codes, embedding,
                  K: tl.constexpr, VOCAB: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_H: tl.constexpr, SAMPLING: tl.constexpr):
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
    if hb == 0:
        tl.store(codes + b * K + books, chosen)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = books.to(tl.int64) * VOCAB + chosen
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
                  table, table, codes, embedding, K, VOCAB, HIDDEN, BLOCK_V, BLOCK_H, False)


@triton.jit
def delayed_codebook_sample(logits, row_index, end_frame, table, temperature, top_k, top_p, seed,
                            codes, embedding,
                            K: tl.constexpr, VOCAB: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_V: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    """Per row: greedy where temperature[b] is 0, else seeded sampling; state (row, end, seed) lives on the device."""
    b = tl.program_id(0)
    _codebook_row(logits, b, tl.program_id(1), tl.load(row_index + b), tl.load(end_frame + b), table, temperature,
                  top_k, top_p, seed, codes, embedding, K, VOCAB, HIDDEN, BLOCK_V, BLOCK_H, True)
