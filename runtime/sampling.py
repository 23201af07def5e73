"""Choosing a row of codes from its logits: greedy, or seeded sampling — the device kernel's rule in numpy.

Every backend samples by this one rule (the GPU path runs it in `plugins/codebook.py::_sample`, the host loop here):
each codebook draws with one uniform that is a hash of (seed, row, codebook), so a request's codes depend only on
its own seed and row, never on its place in a batch or on what else is decoding.

- temperature T: softmax(logits / T); top-k keeps the codes scoring at least the k-th best (ties kept); top-p keeps
  the codes whose strictly more likely mass is below top_p (the best code always stays); then inverse CDF.
- greedy (T = 0): argmax, ties to the lowest index.
"""

import numpy as np

MASK64 = (1 << 64) - 1


def uniform(seed: int, row: int, codebook: int) -> np.float32:
    """splitmix64(seed, row, codebook) → a uniform in [0, 1) with 24 bits (exact in fp32)."""
    x = ((seed & MASK64) * 0x9E3779B97F4A7C15 + row * 0xBF58476D1CE4E5B9 + codebook) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return np.float32((x >> 40) * (1.0 / 16777216.0))


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """One code from one codebook's logits [V] with the uniform u."""
    z = logits.astype(np.float32) / np.float32(temperature)
    vocab = len(z)
    if 0 < top_k < vocab:
        z = np.where(z >= np.sort(z)[vocab - top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        ranked = p[order]
        keep = np.zeros(vocab, bool)
        keep[order[(np.cumsum(ranked) - ranked) < top_p]] = True
        keep[order[0]] = True  # also where top_p is below float32's range (0 here)
        p = np.where(keep, p, 0.0)
    cdf = np.cumsum(p)
    return min(int((cdf <= u * p.sum()).sum()), vocab - 1)


def choose_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, row: int) -> np.ndarray:
    """logits [K, V] of row `row` → codes [K] int32 (before the delay mask)."""
    if temperature <= 0:
        return np.argmax(logits, axis=-1).astype(np.int32)
    return np.array([sample(logits[k], temperature, top_k, top_p, uniform(seed, row, k)) for k in range(len(logits))],
                    dtype=np.int32)
