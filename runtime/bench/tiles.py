"""`bench linear`: the GPU engine's linear kernel at Higgs v3's weight shapes, tile shapes timed against each other
(needs a GPU). Each sweep starts from this GPU's table (runtime/gpu/tiles.py) and writes its winners into it for the
rest of the process; `bench linear --write` saves the table as this GPU model's file."""

import time
from dataclasses import replace

import torch

from higgs_trt.runtime.config import HiggsConfig
from higgs_trt.runtime.gpu.launches import Workspace
from higgs_trt.runtime.gpu.linear import Linear
from higgs_trt.runtime.gpu.tiles import TileConfig, default_tiles, stage_bytes, tuned_tiles

from .kernels import copy_bandwidth, graph_ms


def table() -> dict:
    """This GPU's table: what the sweeps start from and write into."""
    return tuned_tiles("cuda")


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
    The shape in table() first. 64 or 128 weight rows per tile use wgmma on Hopper, 32 mma.sync."""
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
    tuned = [replace(table()[n, k, fp8], wide=None)] if (n, k, fp8) in table() else []
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
    which M the K ranges run in one program, _where_in_program); the winner (least M=1 + M=64 time) goes into the table
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
        best[(n, k, fp8)] = table()[(n, k, fp8)] = tiles = _keep_wide(tiles, table().get((n, k, fp8)))
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
    that family (the table's, or the best of a few at M=1), and the wide ones (wide_candidates) timed at M=64, the best
    two again at M=20 and 32. The family with the least M=1 + M=64 time goes into the table, with its wide tiles where
    they beat the narrow ones at M=64."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for _, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        tuned = replace(table().get((n, k, fp8)) or candidates(n, k, gated, fp8)[0], wide=None)
        copies = _copies(n, k, gated, fp8)
        choices = []
        for wgmma in (tuned.block_n >= 64, tuned.block_n < 64):
            try:
                choices.append(_best_in_family(n, k, gated, fp8, tuned, wgmma, copies, say))
            except Exception as e:  # no tile shape of this family ran
                say(f"    {'wgmma' if wgmma else 'mma.sync'}: {type(e).__name__}")
        _, tiles = min(choices, key=lambda c: c[0])
        best[(n, k, fp8)] = table()[(n, k, fp8)] = tiles = replace(tiles, prefill=tuned.prefill)
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
    """Per weight shape: the table's narrow tiles with persistent programs (1 to 4 per multiprocessor, as many or one more
    pipeline stages) against one program per unit, timed at M = 1, the best three again at M = 8 and 16; the least
    M=1 + M=8 + M=16 time goes into the table (with the previous tiles as its wide ones if it had none: persistent
    programs are tuned for a few rows)."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for _, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        if (n, k, fp8) not in table():
            say(f"  {label}: skipped (no tiles in table() to start from)")
            continue
        base = replace(table()[n, k, fp8], persistent=0)
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
        best[(n, k, fp8)] = table()[(n, k, fp8)] = chosen
        say(f"  {label:<10} → {chosen}")
        del copies
    return best


def sweep_ranges(cfg: HiggsConfig, budget_s: float = 240.0, fp8_options=(False, True), say=print) -> dict:
    """Per weight shape: wgmma tiles with K in S = 1, 2, 4, 8 ranges against the table's. For each S, narrow tiles (64
    weight rows; one program per unit or 3 persistent per SM) timed at M = 1, the best at 8; wide ones (64 rows with 4
    warps or 128 with 8, K ranges in one program) at 64, the best at 20 and 32. The K ranges and the MMA fix a row's
    numbers, so narrow and wide tiles move together: the least M=1 + M=8 + M=64 time goes into the table."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for _, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        tuned = table().get((n, k, fp8)) or candidates(n, k, gated, fp8)[0]
        copies = _copies(n, k, gated, fp8)

        def us(tiles, m):
            return 1e3 * time_linear(n, k, gated, fp8, tiles, m, copies)

        base = replace(tuned, prefill=None)
        times = [us(base, m) for m in (1, 8, 64)]
        say(f"    the table {' / '.join(f'{t:.1f}' for t in times)} µs at M=1/8/64  {base}")
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
        best[(n, k, fp8)] = table()[(n, k, fp8)] = replace(chosen, prefill=tuned.prefill)
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
    time goes into the table (one prompt's prefill comes before every stream's first audio, a 2,048-row pass only with a
    burst of joins). Compute, not the weight read, bounds these: TFLOP/s are shown."""
    t_end = time.perf_counter() + budget_s
    best = {}
    for name, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        if name == "head":
            say(f"  {label}: skipped (a prefill runs one row per prompt through it)")
            continue
        tuned = table().get((n, k, fp8)) or default_tiles(n, k, fp8)
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
        best[(n, k, fp8)] = table()[(n, k, fp8)] = replace(tuned, prefill=chosen if chosen != today else tuned.prefill)
        say(f"  {label:<10} → prefill {chosen}")
        del copies
    return best


def with_tma(tiles: TileConfig, on: bool) -> TileConfig:
    """The same tiles with every kind's loads (narrow, wide, prefill) by TMA or not."""
    return replace(tiles, tma=on, wide=with_tma(tiles.wide, on) if tiles.wide else None,
                   prefill=with_tma(tiles.prefill, on) if tiles.prefill else None)


def compare_tma(cfg: HiggsConfig, budget_s: float = 120.0, fp8_options=(False, True), say=print) -> dict:
    """Per weight shape: the table's tiles as they are against the same tiles with their loads by TMA (bulk tensor copies)
    and by each thread (the same sums either way), at M = 1, 8 (narrow tiles), 64 (wide) and prefill passes of 64 and
    2048 rows; the two alternate, each figure the better of two. Reports only: the table's `tma` flags are chosen from it
    by hand, per tile kind."""
    t_end = time.perf_counter() + budget_s
    figures = {}
    for name, label, n, k, gated, fp8 in _shapes_in_budget(cfg, fp8_options, t_end, say):
        tuned = table().get((n, k, fp8)) or default_tiles(n, k, fp8)
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
                + ("  (table: TMA)" if kind.tma else ""))
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
