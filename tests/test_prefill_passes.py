"""How the GPU engine cuts a wave of joins into prefill passes (runtime/gpu/launches.prefill_passes), on the CPU."""

import pytest

pytest.importorskip("torch")


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
    buckets, of = bucket_table(CODEC_BUCKETS, 64)
    assert of[21] == 24 and of[14] == 16 and of[40] == 48  # served codec calls of 14-21 windows pad little
    assert all(n <= of[n] and (n == 0 or of[n] in buckets) for n in range(65))
