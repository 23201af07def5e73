"""`bench linear`'s tile sweeps (runtime/bench/tiles.py, tiles_in_step.py) on the CPU, with a stand-in timer: what they
run on the GPU is timing, but what they write into the table must be tiles that TileConfig accepts (wide tiles that
sum rows as the narrow ones do, prefill tiles without tiles of their own), starting from the H200's table; and the
tables round-trip through their JSON files."""

import types

import pytest

torch = pytest.importorskip("torch")


def h200_table() -> dict:
    from higgs_trt.runtime.gpu.tiles import TILES_DIR, read_table

    return read_table(TILES_DIR / "nvidia-h200.json")


def test_tile_sweeps_run_through_every_shape_and_leave_valid_tiles(monkeypatch):
    from higgs_trt.runtime.bench import tiles as sweeps
    from higgs_trt.runtime.config import HIGGS_V3
    from higgs_trt.runtime.gpu.tiles import TileConfig

    def fake_time(n, k, gated, fp8, tiles, m, copies, prefill=False):  # any order of candidates, the same in every run
        return (hash((n, k, fp8, tiles, m)) % 997 + 1) * 1e-3

    table = h200_table()
    monkeypatch.setattr(sweeps, "table", lambda: table)  # the sweeps write into it
    monkeypatch.setattr(sweeps, "time_linear", fake_time)
    monkeypatch.setattr(sweeps, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(sweeps, "_copies",
                        lambda n, k, gated, fp8: [types.SimpleNamespace(weight=types.SimpleNamespace(nbytes=n * k))])
    said = []
    for sweep in (sweeps.sweep_persistent, sweeps.sweep_wide, sweeps.sweep_linear, sweeps.sweep_ranges,
                  sweeps.sweep_prefill):
        best = sweep(HIGGS_V3, 600.0, (False, True), say=said.append)
        assert len(best) >= 8, (sweep.__name__, said[-3:])  # every decoder shape in both precisions (+ the head)
    for tiles in table.values():
        assert isinstance(tiles, TileConfig)
        for m in (1, 20, 64, 2048):
            tiles.for_rows(m), tiles.for_rows(m, prefill=True)
    skipped = [line for line in said if "skipped" in line]
    assert skipped == ["  head bf16: skipped (a prefill runs one row per prompt through it)"]


def test_tile_configs_keep_a_decode_rows_sums_and_let_prefills_choose_theirs():
    from higgs_trt.runtime.gpu.tiles import TileConfig

    narrow = TileConfig(32, 256, 1)
    assert narrow.for_rows(20) is narrow and narrow.for_rows(20, prefill=True) is narrow
    wide = TileConfig(32, 128, 1, rows=64)
    prefill = TileConfig(128, 64, 1, 8, 3, rows=256)  # wgmma where the decode tiles use mma.sync
    tiles = TileConfig(32, 256, 1, wide=wide, prefill=prefill)
    assert [tiles.for_rows(m) for m in (1, 16, 17, 64)] == [tiles, tiles, wide, wide]
    assert tiles.for_rows(1, prefill=True) is prefill and tiles.for_rows(2048, prefill=True) is prefill
    up_to_32 = TileConfig(32, 64, 1, rows=32)
    tiles = TileConfig(32, 256, 1, wide=wide, wide32=up_to_32, prefill=prefill)
    assert [tiles.for_rows(m) for m in (16, 17, 32, 33, 64)] == [tiles, up_to_32, up_to_32, wide, wide]
    for other_sums in (TileConfig(64, 128, 1), TileConfig(32, 128, 2)):  # another MMA family, other K ranges
        with pytest.raises(ValueError, match="sum rows differently"):
            TileConfig(32, 256, 1, wide=other_sums)
        with pytest.raises(ValueError, match="sum rows differently"):
            TileConfig(32, 256, 1, wide=wide, wide32=other_sums)
    with pytest.raises(ValueError, match="nest"):
        TileConfig(32, 256, 1, prefill=TileConfig(128, 64, 1, wide=TileConfig(64, 64, 1)))


def test_timeline_charges_each_idle_gap_to_the_call_running_when_it_began():
    """bench stream --timeline's reading of a trace: decode stream = the stream with the most kernels; a gap is charged
    to the innermost labelled call containing its start, "(loop)" if none; gaps under GAP_US are not counted; the
    codec stream's busy time within each gap is reported beside it."""
    from higgs_trt.runtime.bench.profile import timeline_lines

    def kernel(stream, start, end):
        return {"ph": "X", "cat": "kernel", "ts": start, "dur": end - start, "args": {"stream": stream}}

    def call(name, start, end):
        return {"ph": "X", "cat": "user_annotation", "ts": start, "dur": end - start, "name": name}

    events = [kernel(7, 0, 1000), kernel(7, 1003, 2000), kernel(7, 8000, 9500), kernel(7, 12000, 13000),
              kernel(7, 14000, 15000), kernel(7, 16000, 17000), kernel(9, 10000, 12500),
              call("@scheduler._decode", 1500, 12500), call("@engine.codec", 9000, 10000),  # gaps at 2000 and at 9500
              call("@engine.rows", 12500, 14500),  # the gap at 13000 began in rows, the one at 15000 in no call
              {"ph": "X", "cat": "cpu_op", "ts": 14900, "dur": 500, "name": "aten::copy_"}]  # not a labelled call
    lines = timeline_lines(events)
    assert lines[0] == ("timeline: decode stream busy 6.5 of 17.0 ms; codec stream busy 2.5 ms, 0.5 of it beside "
                        "decode kernels"), lines[0]
    assert "idle 10.5 ms" in lines[1], lines[1]  # the 3 µs gap after the first kernel is not counted
    by_call = {line.split()[0]: line.split(maxsplit=1)[1] for line in lines[2:]}
    assert by_call == {"@scheduler._decode": "6.0 ms in     1 gaps (0.0)", "@engine.codec": "2.5 ms in     1 gaps (2.0)",
                       "@engine.rows": "1.0 ms in     1 gaps (0.0)", "(loop)": "1.0 ms in     1 gaps (0.0)"}, lines
    assert timeline_lines([call("@engine.step", 0, 5)]) == ["timeline: no GPU kernels in the trace"]


def test_profile_level_labels_the_loops_calls_and_puts_them_back(tiny_engine, monkeypatch):
    """A real level of the tiny ORT engine under the profiler (CPU only: no kernels): the trace holds the labelled
    scheduler and engine calls, and afterwards the scheduler's methods and the engine are as they were."""
    from higgs_trt.runtime.backends.ort import OrtBackend
    from higgs_trt.runtime.bench import profile as gpu_profile
    from higgs_trt.runtime.bench.loop import bench_stream
    from higgs_trt.runtime.decoding import Sampling
    from higgs_trt.runtime.manifest import EngineDir
    from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
    from higgs_trt.runtime.scheduler import Scheduler
    from higgs_trt.runtime.stepper import HostStepper

    engine = HostStepper(OrtBackend(EngineDir(tiny_engine)))
    prompt = build_prompt(HiggsTokenizer(tiny_engine / "tokenizer.json"), "Hello there.")
    before = {name: Scheduler.__dict__[name] for name in gpu_profile.SCHEDULER_CALLS}
    seen = []
    monkeypatch.setattr(gpu_profile, "timeline_lines", lambda events: seen.extend(events) or ["no kernels"])
    said = []
    figures = gpu_profile.profile_level(lambda: bench_stream(engine, lambda: (prompt, None), 2, 2, 24, Sampling()), engine,
                                          said.append)
    assert figures.line().startswith("concurrency   2:") and said == ["no kernels"]
    names = {e.get("name") for e in seen if e.get("cat") == "user_annotation"}
    assert {"@scheduler._admit", "@scheduler._decode", "@engine.step", "@engine.codec", "@engine.prefill"} <= names
    assert {name: Scheduler.__dict__[name] for name in gpu_profile.SCHEDULER_CALLS} == before
    assert not set(gpu_profile.ENGINE_CALLS) & set(vars(engine))


def test_step_sweep_keeps_each_shapes_sums_and_prefill_tiles(monkeypatch):
    """`bench linear --tiles step` with a stand-in engine and step timer (on the GPU: the captured B=64 step of a
    36-layer engine): every candidate sums rows as today's narrow tiles do, the winner (the least time of the
    finalists' repeats) lands in every layer and in the table, and prefills and steps of up to 32 rows keep the tiles
    they used."""
    from dataclasses import replace

    from higgs_trt.runtime.bench import tiles_in_step
    from higgs_trt.runtime.bench.tiles import shapes
    from higgs_trt.runtime.config import HIGGS_V3
    from higgs_trt.runtime.gpu.tiles import SHARED_MEMORY, TileConfig

    tuned = h200_table()
    monkeypatch.setattr(tiles_in_step, "table", lambda: tuned)
    sizes = {name: shape for name, shape in shapes(HIGGS_V3).items() if name in tiles_in_step.STEP_SHAPES}

    def engine(cfg, fp8, max_batch):
        def linear(name):
            n, k, gated = sizes[name]
            return types.SimpleNamespace(n=n, k=k, up=object() if gated else None, tiles=tuned[n, k, fp8])
        return types.SimpleNamespace(layers=[types.SimpleNamespace(**{name: linear(name) for name in sizes})
                                             for _ in range(3)])

    def step_ms(engine, batch):  # favours 128-deep K blocks, fewer stages, then a late launch of the next kernel
        assert len({layer.down.tiles for layer in engine.layers}) == 1  # every layer must agree
        w = engine.layers[0].down.tiles.wide
        return 3.0 + 0.1 * (w.block_k != 128) + 0.01 * w.stages + 0.001 * w.tma - 0.0005 * w.late_launch

    monkeypatch.setattr(tiles_in_step, "timing_engine", engine)
    monkeypatch.setattr(tiles_in_step, "_step_ms", step_ms)
    down_key = (*sizes["down"][:2], True)
    tuned[down_key] = replace(tuned[down_key], prefill=None)  # its prefills run its wide tiles
    o_key = (*sizes["o"][:2], True)
    tuned[o_key] = replace(tuned[o_key], wide=None, wide32=None)  # every step runs its narrow tiles
    before = dict(tuned)
    said = []

    def own(tiles):  # a tile shape without the tiles it nests
        return replace(tiles, wide=None, wide32=None, prefill=None)

    best = tiles_in_step.sweep_wide_in_step(HIGGS_V3, 600.0, (True,), say=said.append)
    assert len(best) == 4 and len(said) == 4, said
    for (n, k, fp8), tiles in best.items():
        old = before[n, k, fp8]
        assert tuned[n, k, fp8] is tiles and isinstance(tiles, TileConfig)
        assert (tiles.block_n, tiles.block_k, tiles.split_k) == (old.block_n, old.block_k, old.split_k)
        assert tiles.for_rows(2048, prefill=True) == old.for_rows(2048, prefill=True)
        assert own(tiles.for_rows(32)) == own(old.for_rows(32))
    down = best[down_key]
    assert (down.wide.block_k, down.wide.stages, down.wide.tma, down.wide.late_launch) == (128, 2, False, True)
    for n, k, gated in sizes.values():
        base = before[n, k, True]
        candidates = tiles_in_step.step_wide_candidates(base, k, gated, True)
        assert len(set(candidates)) == len(candidates) > 8 and candidates[0] == (base.wide or candidates[0])
        assert {w.rows for w in candidates} == ({64, 32} if base.split_k == 1 else {64})
        for wide in candidates:
            replace(base, wide=wide)  # TileConfig refuses tiles that sum rows differently
            stage = wide.block_k * (wide.block_n * (2 if gated else 1) + 2 * wide.rows)
            assert stage * wide.stages <= SHARED_MEMORY or wide == base.wide


def test_tile_tables_round_trip_and_a_gpu_without_one_takes_its_twins_or_none(tmp_path, monkeypatch):
    """`bench linear --write` writes the table as the GPU model's file, which reads back to the same tiles; a GPU
    without a file takes the table of one with the same compute capability and multiprocessors, else none."""
    from higgs_trt.runtime.gpu import tiles

    table = h200_table()
    assert len(table) == 9 and all(isinstance(t, tiles.TileConfig) for t in table.values())
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    written = tiles.write_table(table, "cuda", tmp_path)
    assert written.name == "nvidia-h200.json" and tiles.read_table(written) == table
    assert written.read_bytes() == (tiles.TILES_DIR / "nvidia-h200.json").read_bytes()
    assert tiles._table_of("NVIDIA H100 80GB HBM3", (9, 0), 132) == table
    assert tiles._table_of("NVIDIA A100-SXM4-80GB", (8, 0), 108) == {}
    assert tiles.tuned_tiles("cpu") == {}
