"""`bench linear`'s five tile sweeps (builder/gpu_bench.py) on the CPU, with a stand-in timer: what they run on the GPU
is timing, but what they write into TUNED must be tiles that TileConfig accepts (wide tiles that sum rows as the
narrow ones do, prefill tiles without tiles of their own), starting from today's TUNED."""

import types

import pytest

torch = pytest.importorskip("torch")


def test_tile_sweeps_run_through_every_shape_and_leave_valid_tiles(monkeypatch):
    from higgs_trt.builder import gpu_bench
    from higgs_trt.builder.config import HIGGS_V3
    from higgs_trt.builder.gpu_linear import TileConfig

    def fake_time(n, k, gated, fp8, tiles, m, copies, prefill=False):  # any order of candidates, the same in every run
        return (hash((n, k, fp8, tiles, m)) % 997 + 1) * 1e-3

    monkeypatch.setattr(gpu_bench, "TUNED", dict(gpu_bench.TUNED))  # the sweeps write into it
    monkeypatch.setattr(gpu_bench, "time_linear", fake_time)
    monkeypatch.setattr(gpu_bench, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(gpu_bench, "_copies",
                        lambda n, k, gated, fp8: [types.SimpleNamespace(weight=types.SimpleNamespace(nbytes=n * k))])
    said = []
    for sweep in (gpu_bench.sweep_persistent, gpu_bench.sweep_wide, gpu_bench.sweep_linear, gpu_bench.sweep_ranges,
                  gpu_bench.sweep_prefill):
        best = sweep(HIGGS_V3, 600.0, (False, True), say=said.append)
        assert len(best) >= 8, (sweep.__name__, said[-3:])  # every decoder shape in both precisions (+ the head)
    for tiles in gpu_bench.TUNED.values():
        assert isinstance(tiles, TileConfig)
        for m in (1, 20, 64, 2048):
            tiles.for_rows(m), tiles.for_rows(m, prefill=True)
    skipped = [line for line in said if "skipped" in line]
    assert skipped == ["  head bf16: skipped (a prefill runs one row per prompt through it)"]


def test_tile_configs_keep_a_decode_rows_sums_and_let_prefills_choose_theirs():
    from higgs_trt.builder.gpu_linear import TileConfig

    narrow = TileConfig(32, 256, 1)
    assert narrow.for_rows(20) is narrow and narrow.for_rows(20, prefill=True) is narrow
    wide = TileConfig(32, 128, 1, rows=64)
    prefill = TileConfig(128, 64, 1, 8, 3, rows=256)  # wgmma where the decode tiles use mma.sync
    tiles = TileConfig(32, 256, 1, wide=wide, prefill=prefill)
    assert [tiles.for_rows(m) for m in (1, 16, 17, 64)] == [tiles, tiles, wide, wide]
    assert tiles.for_rows(1, prefill=True) is prefill and tiles.for_rows(2048, prefill=True) is prefill
    for other_sums in (TileConfig(64, 128, 1), TileConfig(32, 128, 2)):  # another MMA family, other K ranges
        with pytest.raises(ValueError, match="sum rows differently"):
            TileConfig(32, 256, 1, wide=other_sums)
    with pytest.raises(ValueError, match="nest"):
        TileConfig(32, 256, 1, prefill=TileConfig(128, 64, 1, wide=TileConfig(64, 64, 1)))
