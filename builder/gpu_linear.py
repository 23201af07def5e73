"""The GPU engine's linear: out = x Wᵀ for a decode step's or a prefill's rows, bf16 or FP8, every row summed in
one fixed K order whatever else shares the launch (batch invariance; builder/gpu_kernels.linear), and the tile shapes
that fix that order per weight shape (TileConfig; TUNED from `higgs-trt bench linear` on the H200)."""

from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from higgs_trt.calibration.qdq import bf16_scale, quantize_weight

from . import gpu_kernels

SHARED_MEMORY = 200 * 1024  # of the H200's 227 KiB per block, leaving room for the compiler's own
# FP8 products one wgmma instruction sums in the tensor core's reduced precision before fp32 (plugins/kernels.mma):
# 32, each instruction's K. 0 would keep every sum in fp32 but makes Triton multiply FP8 as f16 with mma.sync,
# which measured 9.1 against 7.5 ms for a B=64 FP8 step on the H200.
FP8_SPAN = 32
FP8_CODES = torch.float8_e4m3fn


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_k: int
    split_k: int
    warps: int = 4
    stages: int = 4
    in_program_from: int = 64  # x rows per product (16/32/64) from which the K ranges run in one program
    rows: int = 64  # the most x rows per product; more rows go to more programs
    persistent: int = 0  # split programs: this many per multiprocessor, each taking every n-th unit (0: one per unit)
    wide: "TileConfig | None" = None  # the tiles for 17 to 64 rows of x (a decode step's batch)
    wide32: "TileConfig | None" = None  # the tiles for 17 to 32 rows, where they differ from the wide ones
    prefill: "TileConfig | None" = None  # the tiles of every prefill pass, whatever its rows
    tma: bool = False  # tiles by bulk tensor copies (Hopper's TMA) instead of per-thread loads: the same sums
    # under PDL, the next kernel's programs launch as these tiles' programs finish instead of as soon as all of them
    # have started: the same sums; where it is faster is measured (TUNED), why there is not established
    late_launch: bool = False

    def __post_init__(self):
        # A row's numbers depend on the K ranges and on the MMA instruction (16 or 32 weight rows: mma.sync; 64 or
        # more: Hopper's wgmma), nothing else: the wide tiles may change anything but those. The prefill tiles may
        # change those too: a prompt's rows are only ever summed by a prefill and every prefill takes them (one
        # prompt or many, any number of rows), so prefills agree with each other, decode steps with each other.
        for wide in (self.wide, self.wide32):
            if wide is not None and (wide.split_k != self.split_k or (wide.block_n >= 64) != (self.block_n >= 64)):
                raise ValueError(f"tiles {wide} would sum rows differently from {self}")
        for other in (self.wide, self.wide32, self.prefill):
            if other is not None and (other.wide or other.wide32 or other.prefill):
                raise ValueError(f"tiles {other} nest tiles of their own")

    def for_rows(self, m: int, prefill: bool = False) -> "TileConfig":
        if prefill and self.prefill is not None:
            return self.prefill
        if 16 < m <= 32 and self.wide32 is not None:
            return self.wide32
        return self.wide if self.wide is not None and m > 16 else self


def default_tiles(n: int, k: int, fp8: bool, device: str = "cuda") -> TileConfig:
    """Enough programs for every SM several times over (a GEMV is bound by its weight read), 16 weight rows
    each, K split when the columns alone give too few programs. `higgs-trt bench linear` measures alternatives.
    On the CPU (Triton's interpreter, tests only) few large programs are fastest."""
    if device == "cpu":
        return TileConfig(64, 64, 1)
    block_n = 16
    split = 1
    while (n // block_n) * split < 512 and split < 8:
        split *= 2
    return TileConfig(block_n, 512 if fp8 else 256, split)


# Measured on the H200 (`higgs-trt bench linear`, 2026-11-30); shapes not listed use default_tiles. (N, K, fp8) →
# tiles, µs at M = 1 / 64; `wide`: the tiles from 17 rows on. `prefill`: the tiles of every prefill pass (wgmma, 128
# or 256 rows of x per product; `bench linear --tiles prefill`, 2026-12-01), µs at M = 2048 / 64 against the decode
# tiles' family that prefills used before. o and down take K in 4 ranges there (2026-12-02, `time_linear`): split
# programs up to 64 rows — one prompt's prefill, before every lone stream's first audio — and the ranges in one
# program past that, the same numbers; µs at M = 48 / 2048 against the whole K in one program. `tma=True` where
# loads by TMA beat per-thread loads (`bench linear --tiles tma`, 2026-12-02, µs loads → TMA): wide FP8 o 12.8 → 11.6,
# down 19.4 → 18.4, gate|up 23.5 → 23.7 (even; 3.434 → 3.362 ms a B=64 step with the other two), wide BF16 gate|up
# 32.2 → 30.1, q|k|v 11.6 → 11.4; BF16 prefills at 2048 rows 0.79–0.88× (64 rows: 0.97–1.08×), FP8 o's 0.94–0.98×.
# Narrow tiles keep per-thread loads: TMA was 1.01–1.20× slower at 1 and 8 rows.
TUNED: dict[tuple[int, int, bool], TileConfig] = {
    # gate|up: 27.9 / 28.2 / 30.9 at M = 1 / 8 / 64 (2026-12-01; the mma.sync tiles before, 32 weight rows, persistent,
    # wide ones: 30.6 / 31.1 / 38.4); prefill 361 / 31.5 (576.7 / 39.9)
    # Twenty-first session: from 17 rows down's programs launch as these finish (late_launch; captured steps side by
    # side: B=64 3.976–3.980 → 3.870–3.872 ms, B=32 3.258–3.261 → 3.214–3.217; elsewhere it was no faster: FP8 at
    # every bucket, the other shapes, the narrow tiles — q|k|v's gained 1.3–1.6 % at B=8 but lost 2.3–3.4 % at B=1)
    (9728, 2560, False): TileConfig(64, 64, 1, 4, 4, wide=TileConfig(64, 64, 1, 4, 4, tma=True, late_launch=True),
                                    prefill=TileConfig(128, 64, 1, 8, 4, rows=128, tma=True)),
    # FP8 gate|up: 17.0 / 16.9 / 23.6 at M = 1 / 8 / 64 (2026-12-01; the mma.sync tiles before: 18.2 / 19.8 / 33.3);
    # prefill 367.3 / 24.3 (477.2 / 29.6)
    # wide tiles of FP8 gate|up, down and o chosen by the B=64 step's time (`bench linear --tiles step`, nineteenth
    # session; down kept its earlier ones up to 32 rows: B=32 step 2.652 ms with the new ones, 2.589 without).
    # Twentieth: gate|up and q|k|v over 32 x rows a product at 33–64 rows (a B=64 step 3.404–3.415 → 3.307–3.309 ms
    # with both; 32 rows keep theirs: gate|up's 3 stages cost the B=32 step 1.6 %), then the step sweep again beside
    # them: gate|up by per-thread loads, down and o back to 256-deep K blocks (3.306–3.328 → 3.258–3.261)
    (9728, 2560, True): TileConfig(64, 128, 1, 4, 4, persistent=3, wide=TileConfig(64, 128, 1, 4, 3, rows=32),
                                   wide32=TileConfig(64, 128, 1, 4, 4, tma=True),
                                   prefill=TileConfig(128, 128, 1, 8, 4, rows=128)),
    # down: 16.7 / 23.9 (one program per unit: 18.0); prefill 24.0 / 224.9 at M = 48 / 2048 (whole K: 52.1 / 212.6)
    (2560, 9728, False): TileConfig(64, 64, 8, 4, 4, 128, persistent=3, wide=TileConfig(64, 64, 8, 4, 3, 128),
                                    prefill=TileConfig(128, 64, 4, 8, 4, 128, rows=128, tma=True)),
    # 10.8 / 19.1; prefills keep the wide tiles of before: 186.4 / 18.9 (the best whole-K tiles 160.1 / 37.0: 20
    # programs at 64 rows)
    (2560, 9728, True): TileConfig(64, 256, 8, 4, 3, 128, wide=TileConfig(64, 256, 8, 4, 3, 128, tma=True),
                                   prefill=TileConfig(64, 256, 8, 4, 3, 128, tma=True)),
    # q|k|v: 11.2 / 11.1 / 12.2 at M = 1 / 8 / 64 (2026-12-01; K in 4 ranges before: 11.6 / 11.7 / 15.4); prefill
    # 102.1 / 17.1 (142.3 / 20.5); twentieth session: 32 x rows a product at 33–64 rows (B=64 step 4.081–4.085 →
    # 4.062–4.063 ms)
    (6144, 2560, False): TileConfig(64, 128, 1, 4, 4, persistent=3,
                                    wide=TileConfig(64, 128, 1, 4, 4, rows=32, tma=True),
                                    wide32=TileConfig(64, 128, 1, 4, 5, tma=True),
                                    prefill=TileConfig(128, 64, 1, 8, 4, rows=256, tma=True)),
    # 8.5 / 8.4 / 10.7 (K in 4 ranges before: 8.5 / 8.7 / 13.4); prefill 97.1 / 12.8 (124.1 / 17.5)
    (6144, 2560, True): TileConfig(64, 256, 1, 4, 4, wide=TileConfig(64, 256, 1, 4, 4, rows=32),
                                   wide32=TileConfig(64, 256, 1, 4, 3),
                                   prefill=TileConfig(128, 128, 1, 8, 4, rows=128)),
    # o: 9.0 / 13.9 (one program per unit: 9.9); prefill 12.7 / 104.3 at M = 48 / 2048 (whole K: 21.0 / 106.0)
    (2560, 4096, False): TileConfig(64, 64, 8, 4, 4, 128, persistent=3, wide=TileConfig(64, 64, 8, 4, 3, 128),
                                    prefill=TileConfig(128, 64, 4, 8, 4, 128, rows=128, tma=True)),
    # 7.8 / 12.8; prefill 12.1 / 90.0 at M = 48 / 2048 (whole K: 17.6 / 72.1)
    (2560, 4096, True): TileConfig(32, 256, 4, 4, 4, 128, wide=TileConfig(32, 256, 4, 4, 2, 128, tma=True),
                                   wide32=TileConfig(32, 128, 4, 4, 3, 128),
                                   prefill=TileConfig(128, 128, 4, 8, 4, 128, rows=128, tma=True)),
    # audio head: 14.9 / 16.2 (the narrow tiles at 64 rows: 20.7)
    (8208, 2560, False): TileConfig(64, 128, 2, 4, 4, 128, wide=TileConfig(64, 128, 2, 4, 4, 16, rows=32)),
}


def stage_bytes(block_n: int, block_k: int, rows: int, fp8: bool, gated: bool) -> int:
    """Shared memory of one pipeline stage: a weight tile (two when gated) and the x rows' tile."""
    return block_k * (block_n * (1 if fp8 else 2) * (2 if gated else 1) + rows * 2)


class Linear:
    """One weight [N, K] (bf16, or FP8 with a scale per row) with its tile shape; `up` makes it the gated pair."""

    def __init__(self, weight: torch.Tensor, up: torch.Tensor | None = None, act_amax: float | None = None):
        self.n, self.k = weight.shape
        device = weight.device.type
        self.fp8 = act_amax is not None
        self.x_scale = float(bf16_scale(act_amax)) if self.fp8 else 1.0
        self.weight, self.scale = self._store(weight)
        self.up, self.up_scale = self._store(up) if up is not None else (None, None)
        self.tiles = TUNED.get((self.n, self.k, self.fp8)) or default_tiles(self.n, self.k, self.fp8, device)
        self._descriptors: dict = {}  # (weight's name, block) → its TMA descriptor

    def _store(self, w: torch.Tensor):
        if not self.fp8:
            return w.to(torch.bfloat16).contiguous(), None
        w8, scale = quantize_weight(w)
        return w8.contiguous(), scale.to(w.device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, m: int, workspace,
                 residual: bool = False, tiles: TileConfig | None = None, out_scale: float = 1.0,
                 prefill: bool = False) -> None:
        """out[:m] = x[:m] Wᵀ (gated: silu(x Gᵀ)·(x Uᵀ); residual: out[:m] += ...), every row summed in the same K
        order whatever m is: the decode tiles' order, or with `prefill` the prefill tiles' (TileConfig). An FP8 x
        holds codes at this linear's activation scale; an FP8 out gets codes at out_scale. `workspace`: the step's
        scratch and launch settings (gpu_engine.Workspace)."""
        t = (tiles or self.tiles).for_rows(m, prefill)
        rows = min(t.rows, max(16, 1 << (m - 1).bit_length()))  # x rows per product: 16 to the tiles' rows (64; 256)
        in_program = t.split_k > 1 and (rows >= t.in_program_from or m > rows)
        persistent = bool(t.persistent) and not in_program and m <= rows  # its units hold every row of x
        if persistent:
            grid = (min(-(-self.n // t.block_n) * t.split_k, workspace.sms * t.persistent),)
        else:
            grid = (-(-m // rows), -(-self.n // t.block_n), 1 if in_program else t.split_k)
        # as many pipeline stages as shared memory takes
        stages = max(2, min(t.stages, SHARED_MEMORY // stage_bytes(t.block_n, t.block_k, rows, self.fp8,
                                                                    self.up is not None)))
        descriptors = {}
        if t.tma:
            descriptors = dict(x_desc=TensorDescriptor(x, [m, self.k], [self.k, 1], [rows, t.block_k]),
                               w_desc=self._descriptor("weight", t), TMA=True)
            if self.up is not None:
                descriptors["w_up_desc"] = self._descriptor("up", t)
        gpu_kernels.linear[grid](
            x, self.weight, self.up if self.up is not None else self.weight,
            self.scale if self.fp8 else x, self.up_scale if self.up_scale is not None else x,
            out, out, workspace.partials, workspace.tickets, m, self.x_scale, out_scale,
            N=self.n, K=self.k, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, ROWS=rows,
            FP8=self.fp8, GATED=self.up is not None, RESIDUAL=residual, OUT_F32=out.dtype == torch.float32,
            SPLITS_IN_PROGRAM=in_program, PDL=workspace.pdl, FP8_SPAN=FP8_SPAN if self.fp8 else 0,
            X_FP8=x.dtype == FP8_CODES, OUT_FP8=out.dtype == FP8_CODES, PERSISTENT=persistent,
            LATE_LAUNCH=t.late_launch, launch_pdl=workspace.pdl, num_warps=t.warps, num_stages=stages, **descriptors)

    def _descriptor(self, name: str, t: TileConfig) -> TensorDescriptor:
        key = name, t.block_n, t.block_k
        if key not in self._descriptors:
            self._descriptors[key] = TensorDescriptor.from_tensor(getattr(self, name), [t.block_n, t.block_k])
        return self._descriptors[key]
