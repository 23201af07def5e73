"""`bench linear --tiles step`: the wide tiles of the decode step's GEMMs chosen by the captured B=64 step's own time
(neighbours, waits and waves included), not by a GEMM's alone (needs a GPU)."""

import itertools
import time
from dataclasses import replace

import torch

from higgs_trt.runtime.config import HiggsConfig
from higgs_trt.runtime.gpu.engine import GpuEngine
from higgs_trt.runtime.gpu.tiles import SHARED_MEMORY, TileConfig, stage_bytes

from .gpu import captured_step, replay_ms, timing_engine
from .tiles import table

STEP_SHAPES = ("gate_up", "down", "o", "qkv")  # Layer attributes, in the order sweep_wide_in_step visits them


def step_wide_candidates(base: TileConfig, k: int, gated: bool, fp8: bool) -> list[TileConfig]:
    """Every wide tile that sums rows as `base` does (its K ranges and MMA family) and fits shared memory: block
    width, K block, stages, loads by TMA or by each thread, K ranges in one program or split, and for a whole-K shape
    64 or 32 x rows a product (32: twice the programs, each weight tile read by two of them; a shape of K ranges
    then sums them in one program, which measured 0.18–1.98 ms slower a B=64 step). Today's first."""
    out = [base.wide] if base.wide is not None else []
    for block_n, block_k, rows, stages, tma, in_program_from in itertools.product(
            (64, 128) if base.block_n >= 64 else (16, 32), (128, 256) if fp8 else (64, 128),
            (64, 32) if base.split_k == 1 else (64,), (2, 3, 4), (False, True),
            (64, 128) if base.split_k > 1 else (64,)):
        tiles = TileConfig(block_n, block_k, base.split_k, 8 if block_n == 128 else 4, stages, in_program_from, rows,
                           tma=tma)
        fits = stage_bytes(block_n, block_k, rows, fp8, gated) * stages <= SHARED_MEMORY
        if fits and k // base.split_k >= block_k and tiles not in out:
            out.append(tiles)
    return out


def sweep_wide_in_step(cfg: HiggsConfig, budget_s: float = 240.0, fp8_options=(False, True), say=print,
                       batch: int = 64) -> dict:
    """Wide tiles chosen by the decode step's own time at `batch` rows (its CUDA graph with programmatic dependent
    launch: a GEMM's neighbours, waits and waves included), not a GEMM's alone: shape by shape, each candidate
    (step_wide_candidates) in every layer, the step captured and timed; the best three, the best with the next
    kernel launched at its other end (TileConfig.late_launch) and today's again, alternately, three times; the least
    time wins. Winners go into the table for the rest of this process (prefills and steps of up to 32 rows keep the
    tiles they used: `wide32` where the winner differs)."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for fp8 in fp8_options:
        best.update(_descend(timing_engine(cfg, fp8, batch), fp8, batch, t_end, say))
        torch.cuda.empty_cache()
    return best


def _descend(engine: GpuEngine, fp8: bool, batch: int, t_end: float, say) -> dict:
    best = {}
    for name in STEP_SHAPES:
        linears = [getattr(layer, name) for layer in engine.layers]
        first = linears[0]
        today = first.tiles

        def step(wide):
            for lin in linears:
                lin.tiles = replace(today, wide=wide)
            return _step_ms(engine, batch)

        timed = []
        for wide in step_wide_candidates(today, first.k, first.up is not None, fp8):
            if time.perf_counter() > t_end:
                break
            try:
                timed.append((step(wide), wide))
            except Exception as e:  # shared memory, registers
                say(f"    {wide}: {type(e).__name__}")
        ranked = [w for _, w in sorted(timed, key=lambda r: r[0])]
        finalists = [today.wide] + [w for w in ranked[:3] if w != today.wide]
        if ranked:  # the fastest with the next kernel launched at its other end (numbers alike: launch order only)
            flipped = replace(ranked[0], late_launch=not ranked[0].late_launch)
            finalists += [flipped] if flipped not in finalists else []
        times = {w: [] for w in finalists}
        for _ in range(3):
            for w in finalists:
                times[w].append(step(w))
        winner = min(finalists, key=lambda w: min(times[w]))
        up_to_32 = replace(today.for_rows(32), wide=None, wide32=None, prefill=None)  # narrow ones, if no wide
        tiles = replace(today, wide=winner, wide32=None if up_to_32 == winner else up_to_32,
                        prefill=today.for_rows(2048, prefill=True))
        for lin in linears:
            lin.tiles = tiles
        best[(first.n, first.k, fp8)] = table()[(first.n, first.k, fp8)] = tiles
        say(f"  {name:<8} {'fp8' if fp8 else 'bf16'}: {len(timed)} tiles timed; B={batch} step today "
            f"{min(times[today.wide]):.3f} ms, {winner} {min(times[winner]):.3f} ms")
    return best


def _step_ms(engine: GpuEngine, batch: int, context: int = 300) -> float:
    graph = captured_step(engine, batch, context)
    return min(replay_ms(engine, graph, batch, context, replays=40) for _ in range(2))
