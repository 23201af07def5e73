"""GPU figures for the engine design (needs a CUDA GPU): the linear kernel's tile shapes, and the whole decode step.

Everything is measured side by side in one process, against the device's copy bandwidth measured in the same run:
the floor of a decode step is the bytes of weights it must read (FP8 halves the decoder's) over that bandwidth.
Random weights at the checkpoint's dimensions: timing does not depend on the values (nor on the text, which only
sets how many keys attention reads: each slot is put at `context` cached positions).
"""

import itertools
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from higgs_trt.plugins.bench import copy_bandwidth, graph_ms

from .config import HiggsConfig
from .gpu_engine import ATTENTION_BLOCK, ATTENTION_CHUNK, GpuEngine, Workspace, attention_tma
from .gpu_linear import SHARED_MEMORY, TUNED, Linear, TileConfig, default_tiles, stage_bytes
from .model import HiggsLM

REPS = 30


def random_tensors(cfg: HiggsConfig, device: str = "cuda", seed: int = 0) -> dict:
    """The language model's tensors at the checkpoint's names and shapes, random (std 0.02; norms near 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in HiggsLM.expected_tensors(cfg).items():
        t = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
        out[name] = 1 + 0.1 * t if name.endswith("norm.weight") else 0.02 * t
    return out


def placeholder_amax(cfg: HiggsConfig) -> dict[str, float]:
    """Unit activation scales (amax 4.0 at every FP8 site) for timing FP8 without calibrating: the scales change the
    numbers, not the work."""
    return {f"body.layers.{i}.{site}": 4.0 for i in range(cfg.num_layers)
            for site in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")}


def linear_bytes(lin: Linear) -> int:
    """Bytes a linear reads per call: its weights (gate and up when gated) and FP8 scales."""
    return sum(t.nbytes for t in (lin.weight, lin.up, lin.scale, lin.up_scale) if t is not None)


def weight_bytes(engine: GpuEngine) -> int:
    """Bytes one decode step must read: every decoder weight (+ FP8 scales) and the audio head."""
    return engine.head.weight.nbytes + sum(linear_bytes(lin) for layer in engine.layers
                                           for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))


# ---- linear tile shapes ------------------------------------------------------------------------------------------

def shapes(cfg: HiggsConfig) -> dict:
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, False), "o": (h, cfg.num_heads * d, False),
            "gate_up": (cfg.intermediate_size, h, True), "down": (h, cfg.intermediate_size, False),
            "head": (cfg.audio_table_rows, h, False)}


SMS = 132  # H200 multiprocessors


def resident(stage: int, stages: int) -> int:
    """Programs of `stages` pipeline stages of `stage` bytes one multiprocessor holds by shared memory (220 KiB of
    the H200's 228 usable), at most 4."""
    return min(4, (220 * 1024) // (stage * stages))


def candidates(n: int, k: int, gated: bool, fp8: bool, limit: int = 10) -> list[TileConfig]:
    """Tile shapes worth timing, ranked by a model of the weight read: the programs should fill every SM in whole
    waves (the last, partial wave is idle bandwidth), with enough of them resident per SM to keep loads in flight.
    The shape in TUNED first. 64 or 128 weight rows per tile use wgmma on Hopper, 32 mma.sync."""
    out = []
    for block_n in (32, 64, 128):
        for split in (1, 2, 4, 8):
            programs = -(-n // block_n) * split
            if programs < SMS or k // split < 256:
                continue
            for block_k in (128, 256, 512) if fp8 else (64, 128, 256):
                for stages in (2, 3, 4):
                    stage = stage_bytes(block_n, block_k, 16, fp8, gated)
                    per_sm = resident(stage, stages)
                    if per_sm < 1:
                        continue
                    waves = programs / (SMS * per_sm)
                    fill = waves / -(-waves // 1)
                    out.append((fill * min(1.0, per_sm * stages * stage / 96e3),
                                TileConfig(block_n, block_k, split, 8 if block_n > 64 else 4, stages)))
    out.sort(key=lambda r: r[0], reverse=True)
    tuned = [replace(TUNED[n, k, fp8], wide=None)] if (n, k, fp8) in TUNED else []
    return tuned + [t for _, t in out if t not in tuned][:limit]


def time_linear(n: int, k: int, gated: bool, fp8: bool, tiles: TileConfig, m: int, copies: list,
                prefill: bool = False) -> float:
    """ms of one linear at M = m (a decode step's, or a prefill pass's). FP8: x as FP8 codes, as the engine feeds
    every FP8 linear."""
    ws = Workspace(max(n, 16), 64, 1, 1, 16, 16, "cuda")
    x = torch.randn(max(m, 64), k, device="cuda", dtype=torch.bfloat16)
    if fp8:
        x = x.to(torch.float8_e4m3fn)
    out = torch.empty(max(m, 64), n, device="cuda", dtype=torch.bfloat16)

    def run():
        for lin in copies:
            lin(x, out, m, ws, tiles=tiles, prefill=prefill)
    return graph_ms(run) / len(copies)


def sweep_linear(cfg: HiggsConfig, budget_s: float = 240.0, fp8_options=(False, True), say=print) -> dict:
    """Per weight shape and precision: every candidate at M=1, the best few again at M=16, 32 and 64 (and from
    which M the K ranges run in one program, _where_in_program); the winner (least M=1 + M=64 time) goes into TUNED
    for the rest of this process. Stops trying new shapes at the budget."""
    t_end = time.perf_counter() + budget_s
    bandwidth = copy_bandwidth()
    say(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    best = {}
    for name, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say,
                                                          order=("gate_up", "down", "qkv", "o", "head")):
        copies = _copies(n, k, gated, fp8)
        size = copies[0].weight.nbytes * (2 if gated else 1)
        results = []
        for tiles in candidates(n, k, gated, fp8):
            try:
                results.append((time_linear(n, k, gated, fp8, tiles, 1, copies), tiles))
            except Exception as e:  # a tile shape the compiler refuses (shared memory, registers)
                say(f"    {tiles}: {type(e).__name__}")
        results.sort(key=lambda r: r[0])
        finals = []
        for t1, tiles in results[:5]:
            try:
                tiles, times = _where_in_program(n, k, gated, fp8, tiles, copies)
            except Exception as e:  # fits 16 rows of x but not 64
                say(f"    {tiles} at M=64: {type(e).__name__}")
                continue
            finals.append((t1 + times[64], t1, times, tiles))
        if not finals:
            say(f"  {label}: no tile shape ran at M=64")
            continue
        finals.sort(key=lambda r: r[0])
        for _, t1, times, tiles in finals[1:]:
            say(f"    also {t1 * 1e3:7.1f} / {' / '.join(f'{t * 1e3:.1f}' for t in times.values())} µs  {tiles}")
        _, t1, times, tiles = finals[0]
        best[(n, k, fp8)] = TUNED[(n, k, fp8)] = tiles = _keep_wide(tiles, TUNED.get((n, k, fp8)))
        say(f"  {name:<8}{'fp8' if fp8 else 'bf16':<5} N={n:<6}K={k:<6} {t1 * 1e3:7.1f} / "
            f"{' / '.join(f'{t * 1e3:.1f}' for t in times.values())} µs at M=1/16/32/64  "
            f"{size / (t1 * 1e-3) / 1e12:5.2f} TB/s at M=1  "
            f"({100 * size / (t1 * 1e-3) / bandwidth:4.1f}% of copy)  {tiles}")
        del copies
    return best


def wide_candidates(base: TileConfig, n: int, k: int, gated: bool, fp8: bool, limit: int = 14) -> list[TileConfig]:
    """Tiles for more than 16 rows of x that sum every row as `base` does (its K ranges, its MMA family), ranked by
    a model: enough programs for two waves, and as many weight bytes in flight per SM as shared memory allows."""
    out = []
    family = (64, 128) if base.block_n >= 64 else (16, 32)
    modes = (16, 128) if base.split_k > 1 else (64,)  # K ranges in one program from 16 rows, or split up to 64
    for block_n in family:
        for block_k in (128, 256, 512) if fp8 else (64, 128, 256):
            for rows in (16, 32, 64):
                for in_program_from in modes if rows == 64 else modes[:1]:  # under 64 rows, M=64 runs in program
                    split = 1 if in_program_from <= rows else base.split_k
                    programs = -(-64 // rows) * -(-n // block_n) * split
                    weights = stage_bytes(block_n, block_k, 0, fp8, gated)
                    stage = stage_bytes(block_n, block_k, rows, fp8, gated)
                    for stages in (2, 3, 4):
                        per_sm = resident(stage, stages)
                        if per_sm < 1 or k // split < block_k:
                            continue
                        fill = min(1.0, programs / (2 * SMS))
                        in_flight = min(1.0, per_sm * (stages - 1) * weights / 64e3)
                        score = fill * in_flight / (1 + 0.1 * (64 // rows - 1))  # each program re-reads its weights
                        warps = 8 if block_n * rows >= 128 * 32 else 4
                        out.append((score, TileConfig(block_n, block_k, base.split_k, warps, stages, in_program_from,
                                                      rows)))
    out.sort(key=lambda r: r[0], reverse=True)
    current = [base.wide] if base.wide is not None else []
    return current + [t for _, t in out if t not in current][:limit]


def sweep_wide(cfg: HiggsConfig, budget_s: float = 240.0, fp8_options=(False, True), say=print) -> dict:
    """Per weight shape and MMA family (mma.sync below 64 weight rows per tile, wgmma from 64): the narrow tiles of
    that family (TUNED's, or the best of a few at M=1), and the wide ones (wide_candidates) timed at M=64, the best
    two again at M=20 and 32. The family with the least M=1 + M=64 time goes into TUNED, with its wide tiles where
    they beat the narrow ones at M=64."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for _, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        tuned = replace(TUNED.get((n, k, fp8)) or candidates(n, k, gated, fp8)[0], wide=None)
        copies = _copies(n, k, gated, fp8)
        choices = []
        for wgmma in (tuned.block_n >= 64, tuned.block_n < 64):
            try:
                choices.append(_best_in_family(n, k, gated, fp8, tuned, wgmma, copies, say))
            except Exception as e:  # no tile shape of this family ran
                say(f"    {'wgmma' if wgmma else 'mma.sync'}: {type(e).__name__}")
        _, tiles = min(choices, key=lambda c: c[0])
        best[(n, k, fp8)] = TUNED[(n, k, fp8)] = tiles = replace(tiles, prefill=tuned.prefill)
        say(f"  {label:<10} → {tiles}")
        del copies
    return best


def _best_in_family(n, k, gated, fp8, tuned: TileConfig, wgmma: bool, copies, say) -> tuple[float, TileConfig]:
    """(M=1 + M=64 ms, tiles) of the family's best narrow tiles and, where faster, their wide ones."""
    if (tuned.block_n >= 64) == wgmma:
        narrow = tuned
    else:
        shortlist = [t for t in candidates(n, k, gated, fp8, limit=40)[1:] if (t.block_n >= 64) == wgmma][:4]
        narrow = min(shortlist, key=lambda t: time_linear(n, k, gated, fp8, t, 1, copies))
    t1 = time_linear(n, k, gated, fp8, narrow, 1, copies)
    plain = {m: time_linear(n, k, gated, fp8, narrow, m, copies) for m in (20, 32, 64)}
    results = []
    for tiles in wide_candidates(narrow, n, k, gated, fp8, limit=10):
        try:
            results.append((time_linear(n, k, gated, fp8, tiles, 64, copies), tiles))
        except Exception as e:  # a tile shape the compiler refuses (shared memory, registers)
            say(f"    {tiles}: {type(e).__name__}")
    finals = []
    for t64, tiles in sorted(results, key=lambda r: r[0])[:2]:
        finals.append(({m: time_linear(n, k, gated, fp8, tiles, m, copies) for m in (20, 32)} | {64: t64}, tiles))
    say(f"    {'wgmma' if wgmma else 'mma.sync':<8} narrow {t1 * 1e3:.1f} µs at M=1, {_us(plain)} at M=20/32/64  "
        f"{narrow}")
    for times, tiles in finals:
        say(f"      wide {_us(times)}  {tiles}")
    if finals and finals[0][0][64] < plain[64]:
        return t1 + finals[0][0][64], replace(narrow, wide=finals[0][1])
    return t1 + plain[64], narrow


def sweep_persistent(cfg: HiggsConfig, budget_s: float = 120.0, fp8_options=(False, True), say=print) -> dict:
    """Per weight shape: TUNED's narrow tiles with persistent programs (1 to 4 per multiprocessor, as many or one more
    pipeline stages) against one program per unit, timed at M = 1, the best three again at M = 8 and 16; the least
    M=1 + M=8 + M=16 time goes into TUNED (with the previous tiles as its wide ones if it had none: persistent
    programs are tuned for a few rows)."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for _, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        if (n, k, fp8) not in TUNED:
            say(f"  {label}: skipped (no tiles in TUNED to start from)")
            continue
        base = replace(TUNED[n, k, fp8], persistent=0)
        copies = _copies(n, k, gated, fp8)
        variants = [base] + [replace(base, persistent=p, stages=s) for p in (1, 2, 3, 4)
                             for s in (base.stages, base.stages + 1)]
        timed = []
        for tiles in variants:
            try:
                timed.append((time_linear(n, k, gated, fp8, tiles, 1, copies), tiles))
            except Exception as e:  # shared memory
                say(f"    {tiles}: {type(e).__name__}")
        finals = [(t1, {m: time_linear(n, k, gated, fp8, tiles, m, copies) for m in (8, 16)}, tiles)
                  for t1, tiles in sorted(timed, key=lambda r: r[0])[:3]]
        if base not in [t for *_, t in finals]:  # one program per unit, for comparison
            t1 = next(t for t, tiles in timed if tiles == base)
            finals.append((t1, {m: time_linear(n, k, gated, fp8, base, m, copies) for m in (8, 16)}, base))
        finals.sort(key=lambda f: f[0] + sum(f[1].values()))
        for t1, times, tiles in finals:
            say(f"    {t1 * 1e3:5.1f} / {_us(times)} µs at M=1/8/16  persistent {tiles.persistent} "
                f"stages {tiles.stages}")
        chosen = finals[0][2]
        if chosen != base and chosen.wide is None:  # from 17 rows on, the tiles as they were
            chosen = replace(chosen, wide=replace(base, prefill=None))
        best[(n, k, fp8)] = TUNED[(n, k, fp8)] = chosen
        say(f"  {label:<10} → {chosen}")
        del copies
    return best


def sweep_ranges(cfg: HiggsConfig, budget_s: float = 240.0, fp8_options=(False, True), say=print) -> dict:
    """Per weight shape: wgmma tiles with K in S = 1, 2, 4, 8 ranges against TUNED's. For each S, narrow tiles (64
    weight rows; one program per unit or 3 persistent per SM) timed at M = 1, the best at 8; wide ones (64 rows with 4
    warps or 128 with 8, K ranges in one program) at 64, the best at 20 and 32. The K ranges and the MMA fix a row's
    numbers, so narrow and wide tiles move together: the least M=1 + M=8 + M=64 time goes into TUNED."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for _, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        tuned = TUNED.get((n, k, fp8)) or candidates(n, k, gated, fp8)[0]
        copies = _copies(n, k, gated, fp8)

        def us(tiles, m):
            return 1e3 * time_linear(n, k, gated, fp8, tiles, m, copies)

        base = replace(tuned, prefill=None)
        times = [us(base, m) for m in (1, 8, 64)]
        say(f"    TUNED {' / '.join(f'{t:.1f}' for t in times)} µs at M=1/8/64  {base}")
        choices = [(sum(times), base)]
        bks = (128, 256) if fp8 else (64, 128)
        for split in (s for s in (1, 2, 4, 8) if k // s >= 256):
            narrow = []
            for bk in bks:
                for persistent in (0, 3):
                    tiles = TileConfig(64, bk, split, 4, 4, 128 if split > 1 else 64, persistent=persistent)
                    try:
                        narrow.append((us(tiles, 1), tiles))
                    except Exception as e:  # shared memory, registers
                        say(f"    {tiles}: {type(e).__name__}")
            t1, chosen = min(narrow, key=lambda r: r[0])
            wide = []
            for bk in bks:
                for stages in (3, 4):
                    for block_n, warps in ((128, 8), (64, 4)):
                        tiles = replace(chosen, wide=TileConfig(block_n, bk, split, warps, stages, 16))
                        try:
                            wide.append((us(tiles, 64), tiles))
                        except Exception as e:
                            say(f"    {tiles.wide}: {type(e).__name__}")
            t64, tiles = min(wide, key=lambda r: r[0])
            t8 = us(tiles, 8)
            say(f"    S={split} {t1:.1f} / {t8:.1f} / {us(tiles, 20):.1f} / {us(tiles, 32):.1f} / {t64:.1f} µs at "
                f"M=1/8/20/32/64  {tiles}")
            choices.append((t1 + t8 + t64, tiles))
        chosen = min(choices, key=lambda c: c[0])[1]
        best[(n, k, fp8)] = TUNED[(n, k, fp8)] = replace(chosen, prefill=tuned.prefill)
        say(f"  {label:<10} → {chosen}")
        del copies
    return best


PREFILL_ROWS = 2048  # a prefill pass: 4 prompts of 512 tokens, or 64 of 32


def prefill_candidates(gated: bool, fp8: bool) -> list[TileConfig]:
    """Prefill tiles worth timing: wgmma over 64 to 256 weight rows and 128 or 256 rows of x per product, the whole K
    in one program (prefill tiles sum as they like: TileConfig). Gated tiles hold two accumulators: at most 128 × 128
    elements each."""
    out = []
    for block_n, rows in ((64, 256), (128, 128), (128, 256), (256, 128)):
        if gated and block_n * rows > 128 * 128:
            continue
        for warps in (4, 8) if block_n * rows <= 128 * 128 else (8,):
            for stages in (3, 4):
                out.append(TileConfig(block_n, 128 if fp8 else 64, 1, warps, stages, rows=rows))
    return out


def sweep_prefill(cfg: HiggsConfig, budget_s: float = 240.0, fp8_options=(False, True), say=print) -> dict:
    """Per weight shape: prefill tiles timed at M = 2048 (a pass of many prompts) against today's (the decode tiles
    where a shape has none), the best three and today's again at M = 64 (one prompt); the least M=2048 + 8 × M=64
    time goes into TUNED (one prompt's prefill comes before every stream's first audio, a 2,048-row pass only with a
    burst of joins). Compute, not the weight read, bounds these: TFLOP/s are shown."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for name, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        if name == "head":
            say(f"  {label}: skipped (a prefill runs one row per prompt through it)")
            continue
        tuned = TUNED.get((n, k, fp8)) or default_tiles(n, k, fp8)
        today = tuned.prefill or replace(tuned.wide or tuned, wide=None, prefill=None)
        copies = _copies(n, k, gated, fp8)
        flops = 2 * PREFILL_ROWS * n * k * (2 if gated else 1)
        timed = []
        for prefill in [today] + [t for t in prefill_candidates(gated, fp8) if t != today]:
            try:
                timed.append((time_linear(n, k, gated, fp8, replace(tuned, prefill=prefill), PREFILL_ROWS, copies,
                                          prefill=True), prefill))
            except Exception as e:  # shared memory, registers
                say(f"    {prefill}: {type(e).__name__}")
        timed.sort(key=lambda r: r[0])
        finals = []
        for ms, prefill in timed[:3] + [r for r in timed[3:] if r[1] == today]:
            one = time_linear(n, k, gated, fp8, replace(tuned, prefill=prefill), 64, copies, prefill=True)
            finals.append((ms + 8 * one, prefill))
            say(f"    {ms * 1e3:7.1f} µs {flops / ms / 1e9:5.0f} TFLOP/s, {one * 1e3:5.1f} µs at M=64  {prefill}"
                + ("  (today)" if prefill == today else ""))
        chosen = min(finals, key=lambda f: f[0])[1]
        best[(n, k, fp8)] = TUNED[(n, k, fp8)] = replace(tuned, prefill=chosen if chosen != today else tuned.prefill)
        say(f"  {label:<10} → prefill {chosen}")
        del copies
    return best


def with_tma(tiles: TileConfig, on: bool) -> TileConfig:
    """The same tiles with every kind's loads (narrow, wide, prefill) by TMA or not."""
    return replace(tiles, tma=on, wide=with_tma(tiles.wide, on) if tiles.wide else None,
                   prefill=with_tma(tiles.prefill, on) if tiles.prefill else None)


def compare_tma(cfg: HiggsConfig, budget_s: float = 120.0, fp8_options=(False, True), say=print) -> dict:
    """Per weight shape: TUNED's tiles as they are against the same tiles with their loads by TMA (bulk tensor copies)
    and by each thread (the same sums either way), at M = 1, 8 (narrow tiles), 64 (wide) and prefill passes of 64 and
    2048 rows; the two alternate, each figure the better of two. Reports only: TUNED's `tma` flags are chosen from it
    by hand, per tile kind."""
    t_end = time.perf_counter() + budget_s
    figures = {}
    for name, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        tuned = TUNED.get((n, k, fp8)) or default_tiles(n, k, fp8)
        copies = _copies(n, k, gated, fp8)
        runs = [(m, False) for m in (1, 8, 64)]
        if name != "head":  # a prefill runs one row per prompt through it
            runs += [(64, True), (2048, True)]
        for m, prefill in runs:
            kind = tuned.for_rows(m, prefill)
            times = {on: min(time_linear(n, k, gated, fp8, with_tma(tuned, on), m, copies, prefill=prefill)
                             for _ in range(2)) for on in (False, True)}
            figures[(n, k, fp8, m, prefill)] = times
            say(f"  {label:<10} {'prefill' if prefill else 'decode':<7} M={m:<5} loads {times[False] * 1e3:7.1f} µs"
                f"  TMA {times[True] * 1e3:7.1f} µs  ({times[True] / times[False]:4.2f}×)"
                + ("  (TUNED: TMA)" if kind.tma else ""))
        del copies
    return figures


def _shapes_in_budget(cfg: HiggsConfig, fp8_options, t_end: float, say, order=None):
    """(name, label, N, K, gated, fp8) of each weight shape and precision to sweep (the audio head is bf16 in both
    precisions), `order`'s names first; once the time budget is spent, the rest are named as skipped."""
    for name, (n, k, gated) in sorted(shapes(cfg).items(), key=lambda kv: order.index(kv[0]) if order else 0):
        for fp8 in (f for f in fp8_options if not (f and name == "head")):
            label = f"{name} {'fp8' if fp8 else 'bf16'}"
            if time.perf_counter() > t_end:
                say(f"  {label}: skipped (time budget)")
                continue
            yield name, label, n, k, gated, fp8


def _keep_wide(tiles: TileConfig, previous: TileConfig | None) -> TileConfig:
    """The new narrow tiles with the previous prefill ones, and the previous wide ones where they still sum rows the
    same way."""
    tiles = replace(tiles, prefill=previous.prefill if previous else None)
    try:
        return replace(tiles, wide=previous.wide if previous else None)
    except ValueError:
        return replace(tiles, wide=None)


def _us(times: dict) -> str:
    return " / ".join(f"{t * 1e3:.1f}" for t in times.values())


def _copies(n: int, k: int, gated: bool, fp8: bool) -> list:
    """Enough copies of one random linear to read past the L2 (a decode step never finds its weights there)."""
    one = Linear(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 if gated else None,
                 act_amax=4.0 if fp8 else None)
    size = one.weight.nbytes * (2 if gated else 1)
    return [one] + [_clone(one) for _ in range(max(1, -(-200_000_000 // size)) - 1)]


def _where_in_program(n, k, gated, fp8, tiles: TileConfig, copies) -> tuple[TileConfig, dict]:
    """At M = 16, 32, 64: K ranges in split programs or in one program (same numbers), whichever is faster; the
    tiles with in_program_from at the smallest M from which one program stays faster, and the time at each M in the
    mode those tiles choose."""
    if tiles.split_k == 1:
        return tiles, {m: time_linear(n, k, gated, fp8, tiles, m, copies) for m in (16, 32, 64)}
    split, whole = replace(tiles, in_program_from=128), replace(tiles, in_program_from=16)
    both = {m: [time_linear(n, k, gated, fp8, t, m, copies) for t in (split, whole)] for m in (16, 32, 64)}
    start = 128  # 128: split programs up to 64 rows (more rows always run in one program)
    for m in (64, 32, 16):
        if both[m][1] >= both[m][0]:
            break
        start = m
    return replace(tiles, in_program_from=start), {m: t[1] if m >= start else t[0] for m, t in both.items()}


def _clone(lin: Linear) -> Linear:
    other = object.__new__(Linear)
    other.__dict__.update(lin.__dict__)
    for attr in ("weight", "up", "scale", "up_scale"):
        value = getattr(lin, attr)
        setattr(other, attr, value.clone() if value is not None else None)
    other._descriptors = {}
    return other


# ---- decode attention ----------------------------------------------------------------------------------------------

def sweep_attention(cfg: HiggsConfig, batches=(1, 8, 64), contexts=(300, 1000), max_seq: int = 2048,
                    say=print) -> None:
    """decode_attention_split's chunk, key block, pipeline stages and warps, timed at each batch and context (µs per layer;
    every slot at `context` cached positions, four layers' caches in turn so that none is in L2), against the bytes of
    keys and values read at the copy bandwidth."""
    from higgs_trt.plugins import kernels

    from .model import rope_table

    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bandwidth = copy_bandwidth()
    b_max = max(batches)
    caches = [torch.randn(2, b_max, hkv, max_seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    tma_descriptors = [attention_tma(kv[0], kv[1]) for kv in caches]
    qkv = torch.randn(b_max, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    norm = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    cos, sin = (t.cuda() for t in rope_table(cfg, max_seq, torch.bfloat16))
    out = torch.empty(b_max, hq * d, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(b_max, dtype=torch.int64, device="cuda")
    variants = [(chunk, block, stages, warps, False) for chunk in (256, 512) for block in (32, 64, 128)
                for stages in (2, 3) for warps in (4, 8)]
    # today's chunk and block with keys and values by TMA (ATTENTION_TMA_BUCKETS)
    variants += [(ATTENTION_CHUNK, ATTENTION_BLOCK, stages, 4, True) for stages in (2, 3)]
    say("decode attention, µs per layer (× the copy rate's time for its keys and values) at "
        + ", ".join(f"B={b} S={c}" for b in batches for c in contexts))
    for chunk, block, stages, warps, tma in variants:
        chunks = -(-max_seq // chunk)
        partials = torch.empty(b_max, hq, chunks, d, device="cuda")
        stats = torch.empty(b_max, hq, chunks, 2, device="cuda")
        tickets = torch.zeros(b_max * hkv, dtype=torch.int32, device="cuda")
        figures = []
        for b in batches:
            for context in contexts:
                pos.fill_(context - 1)

                def run():
                    for kv, descriptors in zip(caches, tma_descriptors if tma else [{}] * len(caches)):
                        kernels.decode_attention_split[(b, hkv, chunks)](
                            qkv, norm, norm, cos, sin, kv[0], kv[1], pos, out, partials, stats, tickets, max_seq,
                            cfg.rms_norm_eps, 1.0, Q_HEADS=hq, KV_HEADS=hkv, HEAD_DIM=d, CHUNK=chunk, BLOCK_S=block,
                            MAX_CHUNKS=chunks, num_stages=stages, num_warps=warps, **descriptors)
                try:
                    us = graph_ms(run) / len(caches) * 1e3
                except Exception as e:  # shared memory, registers
                    figures.append(type(e).__name__)
                    continue
                floor_us = 2 * b * hkv * context * d * 2 / bandwidth * 1e6
                figures.append(f"{us:6.1f} ({us / floor_us:3.1f}×)")
        say(f"  chunk {chunk:<4} block {block:<3} stages {stages} warps {warps}{' TMA' if tma else '    '}: "
            f"{'  '.join(figures)}")


# ---- wide tiles by the decode step's time ---------------------------------------------------------------------------

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
    time wins. Winners go into TUNED for the rest of this process (prefills and steps of up to 32 rows keep the
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
        best[(first.n, first.k, fp8)] = TUNED[(first.n, first.k, fp8)] = tiles
        say(f"  {name:<8} {'fp8' if fp8 else 'bf16'}: {len(timed)} tiles timed; B={batch} step today "
            f"{min(times[today.wide]):.3f} ms, {winner} {min(times[winner]):.3f} ms")
    return best


def timing_engine(cfg: HiggsConfig, fp8: bool, max_batch: int, tensors: dict | None = None,
                  max_seq: int = 2048) -> GpuEngine:
    """An engine of random weights (or `tensors`) whose steps the caller captures and times itself (no graphs)."""
    return GpuEngine(cfg, tensors if tensors is not None else random_tensors(cfg), max_seq=max_seq,
                     max_batch=max_batch, max_prompt=16, act_amax=placeholder_amax(cfg) if fp8 else None,
                     graphs=False)


def _step_ms(engine: GpuEngine, batch: int, context: int = 300) -> float:
    graph = captured_step(engine, batch, context)
    return min(replay_ms(engine, graph, batch, context, replays=40) for _ in range(2))


def captured_step(engine: GpuEngine, b: int, context: int) -> "torch.cuda.CUDAGraph":
    """One decode step for slots [0, b) at `context` cached positions, captured (its kernels compiled first)."""
    with torch.cuda.stream(engine.stream):
        engine.active[:b] = 1
        engine.write_pos[:b] = context
        engine._decode(b)  # compiles what it launches, outside the capture
        torch.cuda.current_stream().synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=engine.stream):
            engine._decode(b)
    return graph


def replay_ms(engine: GpuEngine, graph, b: int, context: int, replays: int = 100) -> float:
    """ms per replay of a captured step, back to back (as the decode loop launches them)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(engine.stream):
        engine.active[:b] = 1
        engine.write_pos[:b] = context
        graph.replay()  # untimed: the first timed replay starts behind it, as in the decode loop
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        engine.active.zero_()
    return start.elapsed_time(stop) / replays


# ---- the codec ------------------------------------------------------------------------------------------------------

def bench_codec(ckpt, windows=(1, 8, 64), say=print) -> None:
    """One codec call as the GPU engine replays it (a CUDA graph, channels-last rows, only the kept frames' samples)
    for each window shape of the default stream plan and each window count: TF32 convolutions against fp16 ones
    (CodecDecoder.fp16, the engine's), ms per call and each one's error against exact fp32 (TF32 off), random codes."""
    from higgs_trt.runtime.streaming import StreamPlan

    from .codec import CodecDecoder

    models = {"TF32": CodecDecoder.from_checkpoint(ckpt).channels_last().to("cuda"),
              "fp16": CodecDecoder.from_checkpoint(ckpt).channels_last().to("cuda").fp16()}
    dims = models["TF32"].dims
    rng = np.random.default_rng(0)
    say("codec calls, ms (error against exact fp32)")
    for frames, keep in StreamPlan.exact(dims.strides).window_shapes():
        for n in windows:
            codes = torch.from_numpy(rng.integers(0, dims.codebook_size, (n, dims.num_quantizers, frames))).cuda()
            with torch.inference_mode():
                tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
                try:
                    exact = models["TF32"](codes, keep)
                finally:
                    torch.backends.cudnn.allow_tf32 = tf32  # the caller's setting, whatever it was
                figures = []
                for name, model in models.items():
                    ms = graph_ms(lambda: model(codes, keep))
                    error = float(((model(codes, keep) - exact) ** 2).mean() / (exact ** 2).mean())
                    figures.append(f"{name} {ms:6.2f} ms ({10 * np.log10(max(error, 1e-30)):5.1f} dB)")
            say(f"  {n:2d} windows of {frames} frames, frames {keep[0]}..{keep[1]} kept: {'   '.join(figures)}")


# ---- the decode step --------------------------------------------------------------------------------------------

@dataclass
class StepFigures:
    batch: int
    precision: str
    step_ms: float  # back to back, as the decode loop launches them
    alone_ms: float  # one replay on an idle GPU: the graph's launch included
    floor_ms: float

    @property
    def audio_s_per_s(self) -> float:
        return self.batch / (self.step_ms * 1e-3 * 25)


STREAM_RUNS = 5  # bench decode's lone-stream runs (after a warm-up), reported by their medians
BACK_TO_BACK = 8  # steps timed in a row (attention then reads `context` to `context` + 7 positions)


def step_ms(engine: GpuEngine, batch: int, context: int) -> tuple[float, float]:
    """Median time of one decode step (its captured graph) with `batch` active slots at `context` positions: back to
    back (BACK_TO_BACK replays between two events, the first event recorded behind an untimed replay, so the GPU
    never waits for the host's launch: the decode loop's case, where step n+1 is launched while step n runs), and
    alone (one replay from an idle GPU, which includes the graph's launch: the figure earlier rounds reported)."""
    n = engine._bucket(batch)
    graph = engine.graphs[n, 0, 1]
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    alone, back_to_back = [], []
    with torch.cuda.stream(engine.stream):
        engine.active[:batch] = 1
        for _ in range(REPS):
            engine.write_pos[:batch] = context  # keep the attention length fixed across replays
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            alone.append(start.elapsed_time(stop))
            engine.write_pos[:batch] = context
            graph.replay()
            start.record()
            for _ in range(BACK_TO_BACK):
                graph.replay()
            stop.record()
            stop.synchronize()
            back_to_back.append(start.elapsed_time(stop) / BACK_TO_BACK)
        engine.active.zero_()
    return float(np.median(back_to_back)), float(np.median(alone))


def bench_steps(cfg: HiggsConfig, batches=(1, 8, 64), context: int = 300, fp8_options=(False, True),
                pdl_options=(None,), max_seq: int = 2048, say=print) -> list[StepFigures]:
    """Step time per batch size, per precision and launch mode (PDL on / off / the device's default), side by side."""
    bandwidth = copy_bandwidth()
    tensors = random_tensors(cfg)
    figures = []
    for fp8, pdl in ((f, p) for f in fp8_options for p in pdl_options):
        amax = placeholder_amax(cfg) if fp8 else None
        t0 = time.perf_counter()
        engine = GpuEngine(cfg, tensors, max_seq=max_seq, max_batch=max(batches), max_prompt=512, act_amax=amax,
                           pdl=pdl)
        floor = weight_bytes(engine) / bandwidth * 1e3  # the copy rate counts bytes read + written, as the floor's
        say(f"{engine.precision}{' PDL' if engine.pdl else ''}: engine built and {len(engine.graphs)} graphs captured "
            f"in {time.perf_counter() - t0:.1f} s; "
            f"weights read per step {weight_bytes(engine) / 1e9:.2f} GB → floor {floor:.3f} ms "
            f"(copy {bandwidth / 1e12:.2f} TB/s); peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        for b in batches:
            f = StepFigures(b, engine.precision, *step_ms(engine, b, context), floor)
            figures.append(f)
            say(f"  B={b:<3} {f.step_ms:7.3f} ms/step  ({f.step_ms / floor:4.2f}× floor)  {f.audio_s_per_s:8.1f} "
                f"audio-s/s; alone {f.alone_ms:7.3f} ms")
        del engine
        torch.cuda.empty_cache()
    return figures


# ---- the whole loop: bench decode ------------------------------------------------------------------------------

def bench_decode(engine: GpuEngine, prompt, batches=(1, 8, 64), rows: int = 250, context: int = 300,
                 say=print) -> None:
    """Per batch size: ms per step (graph replay), host µs per row (the scheduler's loop, outside waits on the
    GPU), audio-s/s of decode, and time to first audio of one stream (prefill, the rows of the first exact chunk,
    its codec window); the floor and peak GPU memory."""
    from higgs_trt.runtime.decoding import Sampling
    from higgs_trt.runtime.scheduler import Scheduler, request_for

    bandwidth = copy_bandwidth()
    floor = weight_bytes(engine) / bandwidth * 1e3
    say(f"{engine.precision}: weights read per step {weight_bytes(engine) / 1e9:.2f} GB, copy {bandwidth / 1e12:.2f} TB/s"
        f" → floor {floor:.3f} ms")
    # one stream through the scheduler, greedy then sampled: TTFA and host time per row
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=0)):
        scheduler = Scheduler(engine)
        runs = []
        for _ in range(1 + STREAM_RUNS):  # the first run warms the prefill's kernels
            engine.waited, engine.prefill_seconds, scheduler.polled = 0.0, 0.0, 0.0
            engine.codec_seconds.clear()
            request = request_for(engine, prompt, sampling, hard_cap=rows)
            request.fixed_rows = True
            scheduler.submit(request)
            t0 = time.perf_counter()
            scheduler.run()
            wall = time.perf_counter() - t0
            n = len(request.utterance.rows)
            codec = sum(engine.codec_seconds)
            # the host's own work: neither waiting for the GPU (a step, or a first chunk's codec call while a step
            # runs) nor issuing the prefill and codec calls
            host = (wall - engine.waited - scheduler.polled - codec - engine.prefill_seconds) / n
            runs.append((host, 1e3 * (request.first_audio_at - request.submitted_at), wall, engine.prefill_seconds,
                         codec))
        host, ttfa, wall, prefill, codec = (float(np.median(v)) for v in zip(*runs[1:]))
        hosts = [r[0] for r in runs[1:]]
        say(f"  1 stream {'greedy' if sampling.greedy else 'T=1':<7} {n} rows in {wall * 1e3:7.1f} ms: "
            f"first audio {ttfa:6.1f} ms (prefill issued in {1e3 * prefill:.1f} ms), host {1e6 * host:5.1f} µs/row "
            f"({1e6 * min(hosts):.1f}–{1e6 * max(hosts):.1f}), codec calls issued in {1e3 * codec:.1f} ms "
            f"(medians of {STREAM_RUNS} runs)")
    for b in batches:
        if b > engine.max_batch:
            continue
        ms, alone = step_ms(engine, b, context)
        say(f"  B={b:<3} {ms:7.3f} ms/step ({ms / floor:4.2f}× floor)  {b / (ms * 1e-3 * 25):8.1f} audio-s/s of decode; "
            f"alone {alone:7.3f} ms")
    say(f"  peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
