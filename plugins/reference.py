"""numpy reference for the device-side sampler of plugins/kernels.py (same hash, same cuts, same inverse CDF)."""

import numpy as np

MASK64 = (1 << 64) - 1


def uniform(seed: int, row: int, codebook: int) -> np.float32:
    x = (seed * 0x9E3779B97F4A7C15 + row * 0xBF58476D1CE4E5B9 + codebook) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return np.float32((x >> 40) * (1.0 / 16777216.0))


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """One code from one codebook's logits; top-k keeps ties with the k-th value; top-p keeps the codes whose
    strictly-more-likely mass is below top_p."""
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
        p = np.where(keep, p, 0.0)
    cdf = np.cumsum(p)
    return min(int((cdf <= u * p.sum()).sum()), vocab - 1)
