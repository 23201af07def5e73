"""The GPU engine's KV cache in pages (docs/gpu-engine.md, "Memory"): one pool of pages of PAGE positions for every
slot, and a page table naming the pages that hold each slot's positions. A request holds pages for the positions it
can reach (its prompt and its row cap: SlotEngine.reserve), not max_seq, so the number of slots is bound by the
requests' lengths, not by max_batch × max_seq. The kernels read and write the cache through the table
(plugins/attention.py, plugins/rope.py); the host decides which pages each slot holds, here."""

import numpy as np
import torch

from higgs_trt.runtime.config import HiggsConfig

from .launches import ATTENTION_BLOCK

# Positions a page. A multiple of decode attention's key block, so that every block of keys lies in one page: one
# table load and one bulk copy (TMA) a block, as from a slot's own cache row. A request wastes less than a page.
PAGE = 64


def position_bytes(cfg: HiggsConfig) -> int:
    """Cache bytes of one position: every layer's key and value, bf16 (144 KiB at Higgs v3's dimensions)."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


class KvPages:
    """`positions` of cache (rounded up to whole pages, and never less than one request of max_seq) as the pool
    [layers, K/V, pages, Hkv, page, D] bf16, the page table [max_batch, ⌈max_seq / page⌉] int32 on the device, and
    which pages each slot holds. The host's copy of the table is the truth; upload() sends it before a prefill."""

    def __init__(self, cfg: HiggsConfig, max_batch: int, max_seq: int, positions: int, device: torch.device,
                 pinned: bool, page: int = PAGE):
        if page % ATTENTION_BLOCK:
            raise ValueError(f"a page of {page} positions splits decode attention's blocks of {ATTENTION_BLOCK} keys")
        self.page, self.max_seq = page, max_seq
        self.width = -(-max_seq // page)  # table entries a slot
        pages = max(-(-positions // page), self.width)
        self.pool = torch.zeros(cfg.num_layers, 2, pages, cfg.num_kv_heads, page, cfg.head_dim, dtype=torch.bfloat16,
                                device=device)
        # A slot holding no pages reads the pages its row names and writes none (an inactive slot's step); the
        # benchmarks step slots they never filled, so each names pages of its own where the pool has them.
        self.rows = (np.arange(max_batch * self.width) % pages).astype(np.int32).reshape(max_batch, self.width)
        self.table = torch.from_numpy(self.rows).to(device)
        self.host = torch.zeros(self.rows.shape, dtype=torch.int32, pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None
        self.free = list(range(pages - 1, -1, -1))  # taken from the end, given back to the end
        self.held: list[list[int]] = [[] for _ in range(max_batch)]

    @property
    def pages(self) -> int:
        return self.pool.shape[2]

    def pages_for(self, positions: int) -> int:
        """Pages a slot holding `positions` (at most max_seq) takes."""
        return -(-min(positions, self.max_seq) // self.page)

    def capacity(self, slot: int) -> int:
        """Positions the slot's pages hold (its writes stay below: advance_slots saturates there)."""
        return min(len(self.held[slot]) * self.page, self.max_seq)

    def reserve(self, slot: int, positions: int) -> bool:
        """The slot holds pages for `positions` (at most max_seq) instead of what it held; False, holding none, if
        the free pages are too few."""
        self.release(slot)
        need = self.pages_for(positions)
        if need > len(self.free):
            return False
        self.held[slot] = [self.free.pop() for _ in range(need)]
        self.rows[slot, :need] = self.held[slot]
        return True

    def release(self, slot: int) -> None:
        """The slot's pages are free. Its row of the table keeps naming them, read by its inactive steps only;
        launches already queued finish with them before any later launch on the engine's stream reuses them."""
        self.free += reversed(self.held[slot])
        self.held[slot] = []

    def upload(self) -> None:
        """The table to the device, on the current stream, from pinned memory (waiting for the last upload's copy
        first: the pinned buffer is reused)."""
        if self.copied is not None:
            self.copied.synchronize()
        self.host.numpy()[:] = self.rows
        self.table.copy_(self.host, non_blocking=self.copied is not None)
        if self.copied is not None:
            self.copied.record()

    def take(self, slot: int, positions: int) -> torch.Tensor:
        """A copy of the pages holding the slot's first `positions` [layers, K/V, pages, Hkv, page, D] (the last
        page whole), from the uploaded table."""
        return self.pool.index_select(2, self.table[slot, :-(-positions // self.page)].long())

    def put(self, slot: int, pages: torch.Tensor) -> None:
        """take()'s pages into the slot's first pages (positions past those taken, up to the last page's end, get
        whatever the copy holds there: rewritten before they are read)."""
        self.pool.index_copy_(2, self.table[slot, :pages.shape[2]].long(), pages)
