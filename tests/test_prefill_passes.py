"""What the GPU engine decides on the host, on the CPU: how a wave of joins is cut into prefill passes
(runtime/gpu/launches.prefill_passes), the buckets its graphs are captured for, and which cache pages each slot holds
(runtime/gpu/kv_pages.py)."""

import pytest

torch = pytest.importorskip("torch")


def captured(pass_rows=2048, max_batch=64):
    """The most prompts a captured prefill graph holds per length bucket, as GpuEngine._capture_all captures them."""
    from higgs_trt.runtime.gpu.launches import BUCKETS, PROMPT_BUCKETS

    return {length: max(b for b in BUCKETS if b <= max_batch and b * length <= pass_rows) for length in PROMPT_BUCKETS}


def test_a_wave_takes_the_captured_graphs_shapes_only():
    from higgs_trt.runtime.gpu.launches import prefill_passes

    # 64 joins of 41 rows: 48-row graphs of at most 32 prompts (by rows alone a 2,048-row pass holds 49: eager)
    assert prefill_passes([41] * 64, 2048, captured()) == [32, 32]
    assert prefill_passes([41] * 64, 2048, {}) == [49, 15]  # no graphs (the CPU): by rows
    # a pass is padded to its longest prompt's bucket: 20 prompts of 30 rows (bucket 32: 64 a graph) fit one pass,
    # a prompt of 100 rows (bucket 128: 16 a graph) does not join them; put first, it holds its pass to 16
    assert prefill_passes([30] * 20 + [100], 2048, captured()) == [20, 1]
    assert prefill_passes([100] + [30] * 20, 2048, captured()) == [16, 5]
    assert prefill_passes([10], 2048, captured()) == [1]
    assert prefill_passes([], 2048, captured()) == []


def test_prompts_longer_than_every_bucket_go_by_rows():
    """An engine directory may allow prompts past the longest captured bucket (export --max-prompt 1000): those
    passes run eagerly, by rows, and a pass never fails for want of a bucket."""
    from higgs_trt.runtime.gpu.launches import prefill_passes

    graphs = captured(pass_rows=4000)
    assert prefill_passes([700, 700, 700, 700, 700, 700], 4000, graphs) == [5, 1]
    assert prefill_passes([600, 40, 40], 4000, graphs) == [3]  # the pass's longest decides: 3 × 600 rows fit
    for lengths in ([41] * 64, [600] + [41] * 63, [17, 300, 512, 64] * 16):
        passes = prefill_passes(lengths, 4000, graphs)
        assert sum(passes) == len(lengths) and all(passes)


def test_bucket_tables_hold_every_count_in_the_least_bucket():
    from higgs_trt.runtime.gpu.launches import BUCKETS, CODEC_BUCKETS, bucket_table

    assert bucket_table(BUCKETS, 64) == ([1, 2, 4, 8, 16, 32, 64],
                                         [0, 1, 2, 4, 4] + [8] * 4 + [16] * 8 + [32] * 16 + [64] * 32)
    assert bucket_table(BUCKETS, 6) == ([1, 2, 4, 6], [0, 1, 2, 4, 4, 6, 6])  # the most slots is always a bucket
    buckets, of = bucket_table(BUCKETS, 512)
    assert buckets == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] and of[65] == 128 and of[300] == 512
    assert bucket_table(BUCKETS, 200)[0][-3:] == [64, 128, 200]
    buckets, of = bucket_table(CODEC_BUCKETS, 64)
    assert of[21] == 24 and of[14] == 16 and of[40] == 48  # served codec calls of 14-21 windows pad little
    assert all(n <= of[n] and (n == 0 or of[n] in buckets) for n in range(65))


def test_a_codec_call_of_more_windows_than_its_largest_graph_goes_in_pieces(tiny_ckpt):
    """An engine of 512 slots captures codec calls of at most 64 windows (CODEC_BUCKETS' largest, whose memory is
    known), not one of 512; a call of 150 windows goes in pieces of 64, 64 and 22, whose audio is the whole call's."""
    import numpy as np
    import torch

    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.runtime.gpu.codec import CodecDecoder
    from higgs_trt.runtime.gpu.codec_graphs import CodecGraphs, Pieces

    codec = CodecDecoder.from_checkpoint(Checkpoint(tiny_ckpt))
    calls = CodecGraphs(codec, 512, torch.device("cpu"))
    assert calls.buckets[-1] == 64
    codes = np.random.default_rng(0).integers(0, 1024, (150, codec.dims.num_quantizers, 12))
    audio = calls(codes, (2, 10))
    assert isinstance(audio, Pieces) and [len(piece.result()) for piece in audio.pieces] == [64, 64, 22]
    with torch.inference_mode():
        whole = codec(torch.from_numpy(codes), (2, 10)).numpy()
    assert audio.ready() and np.allclose(audio.result(), whole, rtol=0, atol=1e-5 * np.abs(whole).max())


def tiny_pages(max_batch: int, max_seq: int, positions: int):
    from higgs_trt.runtime.config import HiggsConfig
    from higgs_trt.runtime.gpu.kv_pages import KvPages

    cfg = HiggsConfig(64, 2, 4, 2, 16, 128, 100, 1e-6, 1e6, 32768)
    return KvPages(cfg, max_batch, max_seq, positions, torch.device("cpu"), pinned=False)


def test_slots_hold_the_pages_their_positions_need_until_released():
    """reserve takes whole pages for a slot's positions or, if too few are free, none; release
    gives them back, and a later reserve takes them; the table names each slot's pages once uploaded."""
    kv = tiny_pages(max_batch=4, max_seq=200, positions=5 * 64)
    assert (kv.pages, kv.width) == (5, 4)
    assert kv.reserve(0, 65) and len(kv.held[0]) == 2 and kv.capacity(0) == 128
    assert not kv.reserve(1, 200) and not kv.held[1]  # 4 pages needed, 3 free
    assert kv.reserve(1, 150) and kv.capacity(1) == 192
    assert not kv.free and not kv.reserve(2, 1) and not kv.held[2]
    first = list(kv.held[0])
    kv.release(0)
    assert kv.reserve(2, 64) and kv.held[2][0] in first and kv.reserve(3, 64) and not kv.free
    held = kv.held[1] + kv.held[2] + kv.held[3]
    assert sorted(held) == list(range(5))  # every page once
    kv.upload()
    for slot in (1, 2, 3):
        assert kv.table[slot, :len(kv.held[slot])].tolist() == kv.held[slot]
    assert kv.reserve(2, 60) and not kv.free  # a slot reserved again gives its pages back first


def test_a_request_of_max_seq_always_fits_an_empty_cache():
    """Whatever the budget, the pool holds one request of max_seq positions, so reserve never refuses while no slot
    holds pages."""
    for positions in (0, 1, 64, 199):
        kv = tiny_pages(max_batch=8, max_seq=200, positions=positions)
        assert kv.pages == 4 and kv.reserve(7, 200) and kv.capacity(7) == 200
        assert kv.reserve(7, 10_000) and kv.capacity(7) == 200  # positions past max_seq are never reached


def test_a_slots_pages_copy_out_and_into_another_slot():
    """What the prefix cache keeps (take: the pages holding a slot's first positions, the last one whole) goes into
    another slot's first pages (put), position for position."""
    kv = tiny_pages(max_batch=2, max_seq=256, positions=8 * 64)
    kv.free.reverse()
    assert kv.reserve(0, 200) and kv.reserve(1, 200)
    kv.upload()
    kv.pool.copy_(torch.randn(kv.pool.shape))
    kept = kv.take(0, 100)
    assert kept.shape[2] == 2
    kv.put(1, kept)
    for j in range(2):
        assert torch.equal(kv.pool[:, :, kv.held[1][j]], kv.pool[:, :, kv.held[0][j]])
