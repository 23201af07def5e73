"""The delayed-codebook step: per batch row, per codebook, argmax over the 1026 logits (ties to the lowest index) or,
where temperature[b] > 0, seeded sampling (temperature, top-k, top-p: runtime/sampling.py's rule); then the delay
mask (BOC before row k, EOC from the end frame on); then the next input embedding Σ_k table[k·1026 + code_k], fp32
sum, one bf16 round. delayed_codebook_sample is the GPU engine's form: it also finds the utterance's end frame from
this row's EOCs (the rule of runtime/decoding.py) and embeds the row as it is fed back, masked with that end."""

import triton
import triton.language as tl

from .primitives import await_inputs

BOC = tl.constexpr(1024)
EOC = tl.constexpr(1025)


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
    device; end_next gets the end frame after this row (engine_kernels.advance_slots makes it current)."""
    await_inputs(PDL)
    b = tl.program_id(0)
    _codebook_row(logits, b, tl.program_id(1), tl.load(row_index + b), tl.load(end_frame + b), table, temperature,
                  top_k, top_p, seed, codes, embedding, end_next, K, VOCAB, HIDDEN, BLOCK_V, BLOCK_H, True, True)
