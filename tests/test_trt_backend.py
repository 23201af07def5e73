"""How the TensorRT backend binds the KV caches, without TensorRT or a GPU.

A real execution context cannot run here, so these tests drive `KvCaches` against a thin fake context that only
records the addresses and shapes it is given. This is the one place a fake is right: what is checked is the
binding itself (which buffer each tensor name points at, step after step), which a context takes as given.
The CUDA layer is replaced by a recording allocator and copy, passed in as `alloc` / `copy`.
"""

import numpy as np
import pytest

from higgs_trt.runtime.backends.trt import KvCaches
from higgs_trt.runtime.errors import HiggsError

NAMES = ["past_key_0", "past_value_0", "past_key_1", "past_value_1"]
SHAPE = (4, 2, 160, 16)  # slots, Hkv, S_max, D
SLOT = 2 * 160 * 16 * 2  # bytes of one slot of one bf16 cache


class FakeContext:
    def __init__(self):
        self.addresses, self.shapes = {}, {}

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        return True

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def step(self):
        """What one execution sees: (name → address) for the caches."""
        return dict(self.addresses)


class Allocations:
    """Recording stand-in for cuda.DeviceArray (distinct fake addresses) and cuda.copy_async."""

    def __init__(self):
        self.next, self.copies, self.zeroed = 1 << 32, [], []

    def alloc(self, shape, dtype):
        me = self

        class Buffer:
            ptr = me.next

            def zero(self, stream):
                me.zeroed.append(self.ptr)

        self.next += 1 << 30
        return Buffer()

    def copy(self, dst, src, nbytes, stream):
        self.copies.append((dst, src, nbytes))


def caches(aliased):
    mem = Allocations()
    return KvCaches(NAMES, SHAPE, np.uint16, aliased, alloc=mem.alloc, copy=mem.copy), mem


def test_aliased_caches_bind_past_and_present_to_one_buffer():
    kv, mem = caches(aliased=True)
    ctx = FakeContext()
    seen = []
    for _ in range(3):
        assert kv.bind(ctx, None, 0, 4) == 0
        seen.append(ctx.step())
        kv.advance()
    for name in NAMES:
        present = name.replace("past_", "present_")
        assert len({s[name] for s in seen}) == 1  # the same buffer every step
        assert all(s[present] == s[name] for s in seen)  # present_* at past_*'s address: updated in place
        assert ctx.shapes[name] == SHAPE
    assert len({seen[0][n] for n in NAMES}) == len(NAMES) and not mem.copies


def test_ping_pong_feeds_each_step_what_the_last_one_wrote():
    kv, mem = caches(aliased=False)
    ctx = FakeContext()
    seen = []
    for _ in range(4):
        kv.bind(ctx, None, 0, 4)
        seen.append(ctx.step())
        kv.advance()
    for name in NAMES:
        present = name.replace("past_", "present_")
        for before, after in zip(seen, seen[1:]):
            assert before[present] != before[name]  # never read and written at one address
            assert after[name] == before[present]  # step n+1 reads what step n wrote
            assert after[present] == before[name]  # and writes over what step n read
    assert not mem.copies


def test_a_slot_range_is_an_address_offset_and_a_batch():
    kv, mem = caches(aliased=True)
    ctx = FakeContext()
    kv.bind(ctx, None, 0, 4)
    base = ctx.step()
    kv.bind(ctx, None, 2, 1)  # e.g. a prefill into slot 2
    for name in NAMES:
        assert ctx.addresses[name] == ctx.addresses[name.replace("past_", "present_")] == base[name] + 2 * SLOT
        assert ctx.shapes[name] == (1, *SHAPE[1:])
    with pytest.raises(HiggsError, match="outside 0..3"):
        kv.bind(ctx, None, 3, 2)


def test_ping_pong_slots_written_apart_are_brought_together():
    kv, mem = caches(aliased=False)
    ctx = FakeContext()
    kv.bind(ctx, None, 1, 1)  # prefill into slot 1 alone: it reads side 0, writes side 1
    prefill = ctx.step()
    kv.advance()
    assert kv.bind(ctx, None, 0, 3) == 0  # decode over slots 0..2: slot 1's cache is brought back to side 0
    assert len(mem.copies) == len(NAMES)
    for name in NAMES:
        written = prefill[name.replace("past_", "present_")]  # where the prefill wrote slot 1
        assert any(dst == ctx.addresses[name] + SLOT and src == written and n == SLOT for dst, src, n in mem.copies)
    kv.advance()
    before = ctx.step()
    kv.bind(ctx, None, 0, 3)
    assert all(ctx.addresses[n] == before[n.replace("past_", "present_")] for n in NAMES) and len(mem.copies) == 4


def test_zero_clears_every_buffer_and_resets_the_sides():
    kv, mem = caches(aliased=False)
    ctx = FakeContext()
    kv.bind(ctx, None, 0, 4)
    kv.advance()
    kv.zero(None)
    assert len(mem.zeroed) == 2 * len(NAMES) and kv.bind(ctx, None, 0, 4) == 0
