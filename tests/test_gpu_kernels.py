"""The GPU path's kernels (plugins/engine_kernels.py, and the attention / norm+rope / end-finding kernels of
plugins/attention.py, rope.py, codebook.py) against torch references, run by Triton's interpreter on the CPU (the same kernels run on the
H200 in tests/test_gpu_engine.py, with tighter bounds). Each check runs in a child process: TRITON_INTERPRET must be
set before Triton is imported.

Triton 3.9's interpreter rounds fp32 → bf16 toward zero where the GPU rounds to nearest; tests/triton_rne.py makes
it round as the GPU does, so each bf16 rounding is held to half an ulp (2^-8 relative), as on the GPU.
"""

import textwrap

import pytest
from interpreted import run_interpreted

PRELUDE = """
import numpy as np, torch, torch.nn.functional as F
from higgs_trt.plugins import engine_kernels
from higgs_trt.plugins import attention, codebook, rope
from higgs_trt.plugins.fp8 import bf16_scale, quantize_weight
torch.manual_seed(0)
"""


def run(body: str) -> None:
    run_interpreted(PRELUDE + textwrap.dedent(body))


LINEAR = """
def linear(x, w, up=None, fp8=False, residual=None, split=1, block_n=16, block_k=32, in_program=None, persistent=0):
    m, k = x.shape
    n = w.shape[0]
    amax = float(x.float().abs().max())
    xs = float(bf16_scale(amax)) if fp8 else 1.0
    (w8, ws), (u8, us) = (quantize_weight(w), quantize_weight(up if up is not None else w)) if fp8 else ((w, x), (up, x))
    out = residual.clone() if residual is not None else torch.full((m, n), float("nan")).bfloat16()
    partials, tickets = torch.zeros(2 * 8 * 64 * n), torch.zeros(n, dtype=torch.int32)
    rows = min(64, max(16, 1 << (m - 1).bit_length()))
    in_program = m > rows if in_program is None else in_program  # the engine's rule at its smallest threshold
    grid = (persistent,) if persistent else (-(-m // rows), -(-n // block_n), 1 if in_program else split)
    engine_kernels.linear[grid](
        x, w8, u8 if up is not None else w8, ws, us, out, out, partials, tickets, m, xs, 1.0, N=n, K=k, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split, ROWS=rows, FP8=fp8, GATED=up is not None,
        RESIDUAL=residual is not None, OUT_F32=False, SPLITS_IN_PROGRAM=in_program, PERSISTENT=bool(persistent))
    assert not tickets.any()  # every split-K ticket counter is reset for the next launch
    # reference: the same quantisation, fp32 products and sums, the kernel's bf16 rounding points
    if fp8:
        xq = (x.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn).float() * xs
        y = xq @ (w8.float() * ws[:, None]).T
        u = xq @ (u8.float() * us[:, None]).T if up is not None else None
    else:
        y = x.float() @ w.float().T
        u = x.float() @ up.float().T if up is not None else None
    if up is not None:
        g = y.bfloat16().float()  # the graph's silu: Sigmoid, then Mul, each rounded to bf16
        y = (g * torch.sigmoid(g).bfloat16().float()).bfloat16().float() * u.bfloat16().float()
    scale = y.abs() * (2 if up is not None else 1)  # gated: five roundings (gate, sigmoid, silu, up, product)
    if residual is not None:
        scale = residual.float().abs() + y.abs()
        y = residual.float() + y.bfloat16().float()
    return out, y, scale

def close(out, ref, scale):
    # half an ulp per bf16 rounding of the terms rounded (two at most), fp32 sums in another order within that
    err = (out.float() - ref).abs()
    assert (err <= scale * 2 ** -7 + 1e-4).all(), float(err.max())
"""


def test_linear_matches_the_exact_gemm_in_every_mode():
    run(LINEAR + """
for m, n, k, split, bn, bk in [(1, 48, 64, 1, 16, 32), (5, 40, 96, 2, 16, 32), (20, 64, 64, 4, 32, 16),
                               (70, 32, 80, 1, 16, 32), (33, 24, 64, 1, 16, 32), (1, 80, 64, 1, 64, 32),
                               (20, 64, 96, 2, 32, 32), (70, 72, 80, 1, 64, 16), (70, 40, 96, 3, 32, 16)]:
    x = torch.randn(m, k).bfloat16()
    w, up = (torch.randn(n, k) / k ** 0.5).bfloat16(), (torch.randn(n, k) / k ** 0.5).bfloat16()
    res = torch.randn(m, n).bfloat16()
    for fp8 in (False, True):
        close(*linear(x, w, fp8=fp8, split=split, block_n=bn, block_k=bk))
        close(*linear(x, w, fp8=fp8, residual=res, split=split, block_n=bn, block_k=bk))
        close(*linear(x, w, up, fp8=fp8, split=split, block_n=bn, block_k=bk))
""")


def test_k_ranges_in_one_program_equal_split_programs_bit_for_bit():
    """The K ranges summed one after another in one program (many rows) give the numbers that split programs and
    their reduction give (few rows), so the engine picks either by the number of rows without changing a row."""
    run(LINEAR + """
m, n, k = 12, 40, 200  # 5 ranges of 64: the fourth is short, the fifth empty
x = torch.randn(m, k).bfloat16()
w, up = (torch.randn(n, k) / k ** 0.5).bfloat16(), (torch.randn(n, k) / k ** 0.5).bfloat16()
res = torch.randn(m, n).bfloat16()
for fp8 in (False, True):
    for args in (dict(), dict(up=up), dict(residual=res)):
        a = linear(x, w, fp8=fp8, split=5, block_k=32, in_program=False, **args)[0]
        b = linear(x, w, fp8=fp8, split=5, block_k=32, in_program=True, **args)[0]
        assert torch.equal(a, b), (fp8, args.keys())
""")


def test_persistent_programs_equal_split_programs_bit_for_bit():
    """Fewer programs than (weight tile, K range) units, each taking every n-th unit, compute the split programs'
    numbers: the same units, each summed from zero, reduced in range order."""
    run(LINEAR + """
m, n, k = 5, 40, 200  # 3 weight tiles of 16 rows (the last short) × 5 ranges of 64 columns (the last empty)
x = torch.randn(m, k).bfloat16()
w, up = (torch.randn(n, k) / k ** 0.5).bfloat16(), (torch.randn(n, k) / k ** 0.5).bfloat16()
res = torch.randn(m, n).bfloat16()
for fp8 in (False, True):
    for split in (1, 5):
        for args in (dict(), dict(up=up), dict(residual=res)):
            a = linear(x, w, fp8=fp8, split=split, block_k=32, in_program=False, **args)[0]
            for programs in (1, 4, 15):
                b = linear(x, w, fp8=fp8, split=split, block_k=32, in_program=False, persistent=programs, **args)[0]
                assert torch.equal(a, b), (fp8, split, programs, args.keys())
""")


def test_tma_tiles_equal_per_thread_loads_bit_for_bit():
    """Tiles loaded by TMA (bulk tensor copies through descriptors, out-of-bounds rows and columns zero-filled) give
    the numbers of the same tiles loaded by each thread, in every mode of the engine's launch: split programs,
    ranges in one program, persistent units, gated, FP8, K not a multiple of the tile, fewer rows than a product
    holds; rows past M are never written."""
    run(LINEAR + """
from dataclasses import replace
from higgs_trt.runtime.gpu.engine import Workspace
from higgs_trt.runtime.gpu.linear import Linear
from higgs_trt.runtime.gpu.tiles import TileConfig
for n, k, gated, fp8, tiles, m in [(96, 200, False, False, TileConfig(64, 64, 1), 3),
                                   (128, 192, True, True, TileConfig(64, 64, 2), 20),
                                   (80, 208, False, True, TileConfig(64, 64, 3, persistent=1), 5),
                                   (64, 128, True, False, TileConfig(64, 32, 2, in_program_from=16), 40),
                                   (40, 96, False, False, TileConfig(32, 32, 1, prefill=TileConfig(64, 64, 2)), 33)]:
    x = torch.randn(64, k).bfloat16()
    w, up = (torch.randn(n, k) / k ** 0.5).bfloat16(), (torch.randn(n, k) / k ** 0.5).bfloat16()
    lin = Linear(w, up if gated else None, act_amax=4.0 if fp8 else None)
    ws = Workspace(n, 64, 1, 1, 16, 16, "cpu")
    for prefill in (False, True):
        outs = []
        for tma in (False, True):
            out = torch.full((64, n), float("nan")).bfloat16()
            t = replace(tiles, tma=tma, prefill=replace(tiles.prefill, tma=tma) if tiles.prefill else None)
            lin(x[:m], out, m, ws, tiles=t, prefill=prefill)
            assert not out[:m].isnan().any() and out[m:].isnan().all()
            outs.append(out[:m])
        assert torch.equal(outs[0], outs[1]), (n, k, gated, fp8, tiles, prefill)
""")


def test_fp8_linear_takes_and_gives_codes_quantized_by_their_neighbours():
    """An FP8 linear fed codes that its producer quantized (rms_norm, gate|up) computes exactly what it computes
    quantizing bf16 rows itself; an FP8 output holds exactly the codes the next linear would make of the bf16 one."""
    run("""
m, n, k = 5, 64, 96
x = torch.randn(m, k).bfloat16()
w, up = (torch.randn(n, k) / k ** 0.5).bfloat16(), (torch.randn(n, k) / k ** 0.5).bfloat16()
xs, next_scale = float(bf16_scale(float(x.float().abs().max()))), 0.004
(w8, ws), (u8, us) = quantize_weight(w), quantize_weight(up)
quantized = (x.float() / xs).clamp(-448, 448).to(torch.float8_e4m3fn)

def call(inp, out, split, gated):
    engine_kernels.linear[(1, n // 32, split)](
        inp, w8, u8 if gated else w8, ws, us, out, out, torch.zeros(2 * 8 * 64 * n), torch.zeros(n, dtype=torch.int32),
        m, xs, next_scale, N=n, K=k, BLOCK_N=32, BLOCK_K=32, SPLIT_K=split, ROWS=16, FP8=True, GATED=gated,
        RESIDUAL=False, OUT_F32=False, X_FP8=inp.dtype == torch.float8_e4m3fn,
        OUT_FP8=out.dtype == torch.float8_e4m3fn)
    return out

for split, gated in ((1, False), (3, True), (2, False), (1, True)):
    bf16 = call(x, torch.zeros(m, n).bfloat16(), split, gated)
    assert torch.equal(call(quantized, torch.zeros(m, n).bfloat16(), split, gated), bf16)
    codes = call(x, torch.zeros(m, n, dtype=torch.float8_e4m3fn), split, gated)
    expected = (bf16.float() / next_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8)), (split, gated)
""")


def test_linear_rows_do_not_depend_on_the_batch():
    run(LINEAR + """
k, n = 96, 48
w = (torch.randn(n, k) / k ** 0.5).bfloat16()
row = torch.randn(1, k).bfloat16()
for fp8 in (False, True):
    alone = linear(row, w, fp8=fp8, split=2)[0]
    for m, at in ((3, 2), (16, 9), (37, 20), (64, 63)):
        x = torch.randn(m, k).bfloat16()
        x[at] = row[0]
        # same static activation scale as alone (a per-tensor scale is a constant of the model, not of the batch)
        x = x.clamp(-float(row.float().abs().max()), float(row.float().abs().max()))
        got = linear(x, w, fp8=fp8, split=2)[0][at]
        assert torch.equal(got, alone[0]), (fp8, m)
""")


def test_engine_linear_dispatch_computes_every_row_with_each_tile_kind():
    """Linear (the engine's launch) with persistent narrow tiles and prefill tiles of another family: a decode call
    with more rows than one product holds (persistent units hold one product's rows: they must not serve it) and
    prefill calls of 1 to 100 rows; every row is right, and a row's numbers are the same at one row and among 100,
    decode with decode, prefill with prefill."""
    run(LINEAR + """
from higgs_trt.runtime.gpu.engine import Workspace
from higgs_trt.runtime.gpu.linear import Linear
from higgs_trt.runtime.gpu.tiles import TileConfig
k, n = 96, 64
w = (torch.randn(n, k) / k ** 0.5).bfloat16()
up = (torch.randn(n, k) / k ** 0.5).bfloat16()
x = torch.randn(100, k).bfloat16()
ws = Workspace(n, 100, 1, 1, 16, 16, "cpu")
for fp8 in (False, True):
    for gated in (False, True):
        lin = Linear(w, up if gated else None, act_amax=float(x.float().abs().max()) if fp8 else None)
        for split in (1, 2):
            tiles = TileConfig(16, 32, split, persistent=2, prefill=TileConfig(64, 64, 1, rows=128))
            ref = linear(x, w, up if gated else None, fp8=fp8)
            for prefill in (False, True):
                for m in (1, 70, 100):
                    out = torch.full((100, n), float("nan")).bfloat16()
                    lin(x, out, m, ws, tiles=tiles, prefill=prefill)
                    close(out[:m], ref[1][:m], ref[2][:m])
                    assert out[m:].isnan().all()
                    if m == 1:
                        alone = out[0].clone()
                    else:
                        assert torch.equal(out[0], alone), (fp8, gated, split, prefill, m)
""")


def test_quantize_rows_gives_the_codes_an_fp8_linear_makes_of_bf16_rows():
    run(LINEAR + """
from higgs_trt.runtime.gpu.engine import Workspace
from higgs_trt.runtime.gpu.linear import Linear
k, n, m = 96, 64, 7
w = (torch.randn(n, k) / k ** 0.5).bfloat16()
x = torch.randn(m, k).bfloat16()
lin = Linear(w, act_amax=float(x.float().abs().max()))
ws = Workspace(n, 8, 1, 1, 16, 16, "cpu")
codes = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
engine_kernels.quantize_rows[(m, 2)](x, codes, lin.x_scale, N=k, BLOCK=64)
a, b = torch.zeros(m, n).bfloat16(), torch.zeros(m, n).bfloat16()
lin(x, a, m, ws)
lin(codes, b, m, ws)
assert torch.equal(a, b)
expected = (x.float() / lin.x_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
""")


def test_rms_norm_and_advance_slots():
    run("""
x = torch.randn(5, 48).bfloat16() * 3
w = (1 + 0.1 * torch.randn(48)).bfloat16()
out = torch.empty_like(x)
engine_kernels.rms_norm[(5,)](x, w, out, 1e-6, 1.0, H=48, BLOCK=64)
h = x.float()
ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -6).all()  # two bf16 roundings
codes = torch.zeros(5, 48, dtype=torch.float8_e4m3fn)  # as the input of an FP8 linear: the same rows quantized
engine_kernels.rms_norm[(5,)](x, w, codes, 1e-6, 0.01, H=48, BLOCK=64, OUT_FP8=True)
expected = (out.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))

pos, row = torch.tensor([5, 9, 40, 3]), torch.tensor([1, 2, 3, 4])
end, nxt, active = torch.full((4,), 1 << 40), torch.tensor([7, 8, 9, 10]), torch.tensor([1, 0, 1, 1], dtype=torch.int32)
limit = torch.tensor([128, 128, 41, 128])  # positions each slot's pages hold
engine_kernels.advance_slots[(1,)](pos, row, end, nxt, active, limit, 3, BLOCK=16)
assert pos.tolist() == [6, 9, 40, 3]  # inactive stays; the last row of a slot's own pages is kept; slot 3 is past n
assert row.tolist() == [2, 2, 4, 4] and end.tolist() == [7, 1 << 40, 9, 1 << 40]
pos, active = torch.arange(300), torch.ones(300, dtype=torch.int32)  # a step of the 512 bucket: 300 slots, 200 stepped
zeros = torch.zeros(300, dtype=torch.int64)
engine_kernels.advance_slots[(1,)](pos, zeros, zeros.clone(), zeros.clone(), active, zeros + 1000, 200, BLOCK=512)
assert pos.tolist() == list(range(1, 201)) + list(range(200, 300))
""")


def test_snake_in_one_pass_equals_the_codec_formula():
    """The GPU codec's Snake (one Triton pass) against the module's torch formula, which ONNX export and the CPU
    run: over [B, C, T] (T not a multiple of the block, channels with their own alpha), and over channels-last rows
    [B, T, C] taken from a longer window (the batch stride is not the rows') with a bias per channel added first."""
    run("""
from higgs_trt.runtime.gpu.codec import Snake
snake = Snake(6)
snake.alpha.data = torch.rand(1, 6, 1) * 2 + 0.05
x = torch.randn(3, 6, 1500) * 4
out = torch.empty_like(x)
engine_kernels.snake[(3, 9)](x, snake.alpha, snake.alpha, out, 6 * 1500, 6 * 1500, 6, 1500, HAS_BIAS=False, BLOCK=1024)
ref = snake(x)
assert (out - ref).abs().max() <= 1e-5 * (1 + ref.abs().max()), float((out - ref).abs().max())
bias = torch.randn(6)
rows = (torch.randn(3, 1700, 6) * 4)[:, 100:1600]
out = torch.empty(3, 1500, 6)
engine_kernels.snake[(3, 9)](rows, snake.alpha, bias, out, 1700 * 6, 1500 * 6, 6, 1, HAS_BIAS=True, BLOCK=1024)
ref = snake((rows + bias).transpose(1, 2)).transpose(1, 2)
assert (out - ref).abs().max() <= 1e-5 * (1 + ref.abs().max()), float((out - ref).abs().max())
""")


PAGED = """
def paged(caches, page, spare=0, seed=0):
    # contiguous caches [B, Hkv, S, D] as a pool of pages in scrambled order, with `spare` pages nobody holds (NaN),
    # and the page table [B, S / page] naming each row's pages
    b, h, s, d = caches.shape
    width = s // page
    order = torch.randperm(b * width + spare, generator=torch.Generator().manual_seed(seed))
    table = order[:b * width].view(b, width).int()
    pool = torch.full((b * width + spare, h, page, d), float("nan")).bfloat16()
    pool[table.flatten().long()] = caches.view(b, h, width, page, d).transpose(1, 2).reshape(b * width, h, page, d)
    return pool, table

def unpaged(pool, table):
    # each row's pages back in its order [B, Hkv, S, D]
    (b, width), (_, h, page, d) = table.shape, pool.shape
    return pool[table.flatten().long()].view(b, width, h, page, d).transpose(1, 2).reshape(b, h, width * page, d)

def same_bits(a, b):  # NaN where the other has NaN
    return torch.equal(a.view(torch.int16), b.view(torch.int16))
"""


def test_qk_norm_rope_kv_write_matches_the_reference():
    """Each prompt's q, and its keys and values written into its own slot's pages (scrambled in the pool) at its
    positions; nothing else in the pool changes: not a padding row past a prompt's own (which could reach past its
    slot's pages), not a prompt of slot -1 (one filling a launch up), not a page no slot holds."""
    run(PAGED + """
from higgs_trt.runtime.config import HiggsConfig
from higgs_trt.builder.model import RMSNorm
from higgs_trt.plugins.rope_table import rope_table
from torch.onnx import ops as onnx_ops
Hq, Hkv, D, S, SM, B = 4, 2, 16, 3, 32, 3
cfg = HiggsConfig(64, 1, Hq, Hkv, D, 128, 100, 1e-6, 1e6, 32768)
cos, sin = rope_table(cfg, SM, torch.bfloat16)
qkv = torch.randn(B * S, (Hq + 2 * Hkv) * D).bfloat16()
qn, kn = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
qn.weight.data, kn.weight.data = (1 + 0.1 * torch.randn(D)).bfloat16(), (1 + 0.1 * torch.randn(D)).bfloat16()
wp, slots = torch.tensor([0, SM - S, 5]), torch.tensor([1, 0, -1])
last = torch.tensor([S - 1, S + S - 2, 2 * S + S - 1])  # prompt 1's last row is padding
kc, vc = torch.randn(2, Hkv, SM, D).bfloat16(), torch.randn(2, Hkv, SM, D).bfloat16()
(k_pool, table), (v_pool, _) = paged(kc, 8, spare=3), paged(vc, 8, spare=3)
k_pool2, v_pool2, q_out = k_pool.clone(), v_pool.clone(), torch.empty(B * S, Hq * D).bfloat16()
rope.qk_norm_rope_kv_write[(B * S,)](qkv, qn.weight, kn.weight, cos, sin, wp, slots, last, table, q_out, k_pool2,
                                        v_pool2, S, SM, 1e-6, Q_HEADS=Hq, KV_HEADS=Hkv, HALF=D // 2, PAGE=8)
kc2, vc2 = unpaged(k_pool2, table), unpaged(v_pool2, table)
spare = torch.ones(len(k_pool), dtype=torch.bool)
spare[table.flatten().long()] = False
assert spare.sum() == 3 and k_pool2[spare].isnan().all() and v_pool2[spare].isnan().all()
x = qkv.view(B, S, -1)
q = qn(x[..., :Hq * D].reshape(B, S, Hq, D)).transpose(1, 2)
k = kn(x[..., Hq * D:(Hq + Hkv) * D].reshape(B, S, Hkv, D)).transpose(1, 2)
v = x[..., (Hq + Hkv) * D:].reshape(B, S, Hkv, D).transpose(1, 2)
pos = wp[:, None] + torch.arange(S)[None]
q_ref = onnx_ops.rotary_embedding(q.float(), cos.float(), sin.float(), pos)
k_ref = onnx_ops.rotary_embedding(k.float(), cos.float(), sin.float(), pos)
ulp = lambda t: t.abs().clamp(min=2 ** -20) * 2 ** -8  # half of one: a rounding to nearest
got_q = q_out.view(B, S, Hq, D).transpose(1, 2).float()
bound = 4 * ulp(q_ref.abs() + torch.cat([q_ref[..., D // 2:], q_ref[..., :D // 2]], -1).abs())  # norm, then rotation
assert ((got_q - q_ref).abs() <= bound).all(), float((got_q - q_ref).abs().max())
for b, rows in ((0, S), (1, S - 1)):
    row = int(slots[b])
    got_k = kc2[row, :, wp[b]:wp[b] + rows].float()
    kb = k_ref[b, :, :rows]
    assert ((got_k - kb).abs() <= 4 * ulp(kb.abs() + torch.cat([kb[..., D // 2:], kb[..., :D // 2]], -1).abs())).all()
    assert torch.equal(vc2[row, :, wp[b]:wp[b] + rows], v[b, :, :rows])
    untouched = torch.ones(SM, dtype=torch.bool)
    untouched[wp[b]:wp[b] + rows] = False
    assert torch.equal(kc2[row, :, untouched], kc[row, :, untouched])
    assert torch.equal(vc2[row, :, untouched], vc[row, :, untouched])
""")


ROTATED = """
from decode_rows import decode_rows

def check_new_rows(kc2, vc2, lengths, k_ref, v):
    # the new key (normalised, rotated) and value at each row's position, nothing written past it
    ulp = lambda t: t.abs().clamp(min=2 ** -20) * 2 ** -8  # half of one: a rounding to nearest
    for b, n in enumerate(lengths):
        kb = k_ref[b]
        bound = 4 * ulp(kb.abs() + torch.cat([kb[..., D // 2:], kb[..., :D // 2]], -1).abs())  # norm, rotation
        assert ((kc2[b, :, n - 1].float() - kb).abs() <= bound).all(), float((kc2[b, :, n - 1].float() - kb).abs().max())
        assert torch.equal(vc2[b, :, n - 1], v[b])
        assert kc2[b, :, n:].isnan().all() and vc2[b, :, n:].isnan().all()
"""


ATTENTION = """
Hq, Hkv, D, SM = 8, 2, 16, 96
def reference(q, kc, vc, lengths):
    # q [B, Hq, D] against keys 0..len-1 of each row, fp32, q pre-scaled and rounded as the model does
    out = []
    for b, n in enumerate(lengths):
        k = kc[b, :, :n].float().repeat_interleave(Hq // Hkv, 0)
        v = vc[b, :, :n].float().repeat_interleave(Hq // Hkv, 0)
        qs = (q[b].float() * D ** -0.5).bfloat16().float()
        p = torch.softmax(qs[:, None] @ k.transpose(1, 2), -1)
        out.append((p @ v)[:, 0])
    return torch.stack(out)
"""


def test_split_decode_attention_writes_the_new_key_and_reads_only_each_prefix():
    """decode_attention_split against the formula over contiguous caches [B, Hkv, S, D]; over the engine's paged
    caches (each row's pages scrambled in one pool, with pages nobody holds) the same bits out and the same keys
    and values written, by per-thread loads or TMA, bf16 or FP8 out; a row whose slot is not active neither writes
    nor reads."""
    run(ATTENTION + ROTATED + PAGED + """
from higgs_trt.runtime.gpu.engine import attention_tma
lengths = [1, 17, 40, 96, 65]
B = len(lengths)
qkv, qn, kn, cos, sin, kc, vc, pos, k_ref, v = decode_rows(lengths, Hq, Hkv, D, SM)
chunk = 16
chunks = -(-SM // chunk)
def attend(rows, fp8_scale=None, tma=False, page=0, idle=()):
    b = len(rows)
    kc2, vc2 = kc[rows].clone(), vc[rows].clone()
    paging = {}
    if page:
        (kc2, table), (vc2, _) = paged(kc2, page, spare=4), paged(vc2, page, spare=4)
        active = torch.tensor([r not in idle for r in range(b)], dtype=torch.int32)
        paging = dict(pages=table, active=active, PAGE=page)
    out = torch.full((b, Hq * D), float("nan")).bfloat16()
    if fp8_scale:  # the FP8 o projection's input: the bf16 result quantized here
        out = torch.zeros(b, Hq * D, dtype=torch.float8_e4m3fn)
    parts, stats = torch.zeros(b, Hq, chunks, D), torch.zeros(b, Hq, chunks, 2)
    tickets = torch.zeros(b * Hkv, dtype=torch.int32)
    descriptors = attention_tma(kc2, vc2, 16) if tma else {}
    attention.decode_attention_split[(b, Hkv, chunks)](
        qkv[rows], qn, kn, cos, sin, kc2, vc2, pos[rows], out, parts, stats, tickets, SM, 1e-6,
        fp8_scale or 1.0, Q_HEADS=Hq, KV_HEADS=Hkv, HEAD_DIM=D, CHUNK=chunk, BLOCK_S=16, MAX_CHUNKS=chunks,
        OUT_FP8=bool(fp8_scale), **descriptors, **paging)
    assert not tickets.any()
    if page:
        held = torch.zeros(len(kc2), dtype=torch.bool)
        held[table.flatten().long()] = True
        assert kc2[~held].isnan().all() and vc2[~held].isnan().all()  # no page outside the rows' was written
        kc2, vc2 = unpaged(kc2, table), unpaged(vc2, table)
    return out.view(b, Hq, D), kc2, vc2
everyone = list(range(B))
got, kc2, vc2 = attend(everyone)
check_new_rows(kc2, vc2, lengths, k_ref, v)
# keys and values by bulk copies (whole blocks: the NaN past each prefix is loaded, and must not reach the result)
by_tma, kc3, vc3 = attend(everyone, tma=True)
assert torch.equal(by_tma, got)
assert torch.equal(kc3.view(torch.int16), kc2.view(torch.int16)) and torch.equal(vc3.view(torch.int16), vc2.view(torch.int16))
# the reference starts from q as the two-kernel chain computes it (qk_norm_rope_kv_write, tested above), over the
# keys as written: the bound measures attention, not q's roundings
q_chain = torch.empty(B, Hq * D).bfloat16()
(k_pool, table), (v_pool, _) = paged(kc.clone(), 16), paged(vc.clone(), 16)
rope.qk_norm_rope_kv_write[(B,)](qkv, qn, kn, cos, sin, pos, torch.arange(B), torch.arange(B), table, q_chain, k_pool,
                                    v_pool, 1, SM, 1e-6, Q_HEADS=Hq, KV_HEADS=Hkv, HALF=D // 2, PAGE=16)
ref = reference(q_chain.view(B, Hq, D), kc2, vc2, lengths)
assert ((got.float() - ref).abs() <= 0.02 * ref.abs() + 0.01).all(), float((got.float() - ref).abs().max())
codes = attend(everyone, fp8_scale=0.004)[0]
expected = (got.float() / 0.004).clamp(-448, 448).to(torch.float8_e4m3fn)
assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
# paged: the same bits as contiguous, out and written
for page, tma, fp8_scale in ((32, False, None), (16, True, 0.004)):
    out, kc4, vc4 = attend(everyone, fp8_scale, tma, page)
    assert same_bits(kc4, kc2) and same_bits(vc4, vc2), (page, tma)
    assert torch.equal(out.view(torch.uint8), (codes if fp8_scale else got).view(torch.uint8)), (page, tma)
out, kc4, vc4 = attend(everyone, page=16, idle=(2,))
assert torch.equal(out[[0, 1, 3, 4]], got[[0, 1, 3, 4]]) and out[2].isnan().all()
assert same_bits(kc4[2], kc[2]) and same_bits(vc4[2], vc[2]) and same_bits(kc4[3], kc2[3])
# a row's result is its own: the same row alone, or beside rows of other lengths, is bit for bit the same
for b in range(B):
    assert torch.equal(attend([b])[0][0], got[b])
""")


def test_decode_attention_plugin_is_causal_over_cache_and_new_rows():
    run(ATTENTION + """
B, S = 2, 5
wp = torch.tensor([0, 30])
q = torch.randn(B, Hq, S, D).bfloat16()
kc, vc = torch.randn(B, Hkv, SM, D).bfloat16(), torch.randn(B, Hkv, SM, D).bfloat16()
out = torch.full((B, Hq, S, D), float("nan")).bfloat16()
scaled = (q.float() * D ** -0.5).bfloat16()  # the plugin takes q scaled, as the graph's Attention op does
attention.decode_attention[(B, Hkv, -(-S * (Hq // Hkv) // 16))](scaled, kc, vc, wp, S, SM, out, Q_HEADS=Hq, KV_HEADS=Hkv,
                                                              HEAD_DIM=D, BLOCK_Q=16, BLOCK_S=16)
for s in range(S):
    ref = reference(q[:, :, s], kc, vc, (wp + s + 1).tolist())
    assert ((out[:, :, s].float() - ref).abs() <= 0.02 * ref.abs() + 0.01).all()
""")


def test_prompt_attention_from_any_start_equals_the_whole_prompt():
    """The prefill's attention (a prompt's rows over its own slot's keys, through the slot's pages scrambled in one
    pool): bit for bit the plugin form's numbers over the same keys in a contiguous cache row; the rows from position
    17 on, attended in a launch that starts there (over keys 0..16 already in the
    slot, as a prefix cache hit has them), bit for bit the rows of the launch from position 0, although the tiles of
    16 (position, head) rows and the key blocks they stop at are cut elsewhere; a prompt of slot -1 computes
    nothing."""
    run(ATTENTION + PAGED + """
L, start = 40, 17
kc, vc = torch.randn(3, Hkv, SM, D).bfloat16(), torch.randn(3, Hkv, SM, D).bfloat16()
(k_pool, table), (v_pool, _) = paged(kc, 16, spare=2), paged(vc, 16, spare=2)
q = (torch.randn(1, Hq, L, D) * D ** -0.5).bfloat16()

def attend(q, starts, slots):
    b, s = len(slots), q.shape[2]
    out = torch.full((b, Hq, s, D), float("nan")).bfloat16()
    attention.prompt_attention[(b, Hkv, -(-s * (Hq // Hkv) // 16))](
        q, k_pool, v_pool, torch.tensor(starts), torch.tensor(slots), table, s, SM, out, Q_HEADS=Hq, KV_HEADS=Hkv,
        HEAD_DIM=D, BLOCK_Q=16, BLOCK_S=16, PAGE=16)
    return out

whole = attend(q, [0], [2])
plugin = torch.full((1, Hq, L, D), float("nan")).bfloat16()
attention.decode_attention[(1, Hkv, -(-L * (Hq // Hkv) // 16))](q, kc[2:], vc[2:], torch.tensor([0]), L, SM, plugin,
                                                               Q_HEADS=Hq, KV_HEADS=Hkv, HEAD_DIM=D, BLOCK_Q=16,
                                                               BLOCK_S=16)
assert torch.equal(whole, plugin)
rest = torch.cat([q[:, :, start:], torch.randn(1, Hq, L - start, D).bfloat16()])  # a second prompt filling up
got = attend(rest, [start, 0], [2, -1])
assert torch.equal(got[0], whole[0, :, start:])
assert got[1].isnan().all()
""")


def test_codebook_sample_finds_the_end_and_feeds_the_masked_row():
    run("""
from higgs_trt.runtime.decoding import EOC, NO_END, delay_mask, find_end
K, V, H = 8, 1026, 64
B = 4
logits = torch.randn(B, K, V)
logits[0, 0, EOC] = 100.0  # EOC on codebook 0 at row 3: ends at frame 3
logits[1, 2, EOC] = 100.0  # EOC on codebook 2 at row 12 (after ramp-up): ends at frame 10
logits[2, 2, EOC] = 100.0  # on codebook 2 during the ramp-up (row 5): does not count
row = torch.tensor([3, 12, 5, 20])
end = torch.tensor([NO_END, NO_END, NO_END, 18])
table = torch.randn(K * V, H).bfloat16()
codes, emb, end_next = torch.empty(B, K, dtype=torch.int32), torch.empty(B, H).bfloat16(), torch.empty(B, dtype=torch.int64)
zeros = torch.zeros(B)
codebook.delayed_codebook_sample[(B, 2)](logits, row, end, table, zeros, zeros.int(), zeros + 1, row, codes, emb,
                                        end_next, K=K, VOCAB=V, HIDDEN=H, BLOCK_V=2048, BLOCK_H=32)
want = delay_mask(logits.argmax(-1).numpy(), row.numpy(), end.numpy())
assert np.array_equal(codes.numpy(), want)
ends = [find_end(want[b], int(row[b]), int(end[b])) for b in range(B)]
assert end_next.tolist() == ends and ends[:3] == [3, 10, int(NO_END)]
fed = delay_mask(want, row.numpy(), np.array(ends))
exact = table.float()[torch.from_numpy(fed).long() + torch.arange(K) * V].sum(1)
assert ((emb.float() - exact).abs() <= exact.abs().clamp(min=2 ** -20) * 2 ** -8).all()  # one rounding to nearest
""")


SLOTS = """
def slot_cache(engine, slot, n):
    # the slot's first n positions [layers, K/V, Hkv, n, D], read through its page table
    kv = engine.kv
    pages = kv.pool.index_select(2, kv.table[slot, :-(-n // kv.page)].long())
    layers, _, count, heads, page, d = pages.shape
    return pages.permute(0, 1, 3, 2, 4, 5).reshape(layers, 2, heads, count * page, d)[:, :, :, :n]

def scramble(engine, seed=0):
    # the engine hands out its pages in a random order (as after many requests came and went)
    engine.kv.free = [int(p) for p in np.random.default_rng(seed).permutation(engine.kv.pages)]
    return engine
"""


def test_engine_prefills_joins_together_as_each_alone(tiny_ckpt):
    """The GPU engine's batched prefill (one call for every request joining) on the CPU: each slot's caches, first
    codes, next input and decode state equal those of its prompt prefilled alone, whatever the order of the group,
    with the group's slots in pages handed out in a random order and each prompt alone in a fixed slot (a page of
    max_seq: one cache row of its own, the layout before paging); padded to a captured graph's buckets, the same
    keys, values and logits, and neither the empty prompts nor the padding rows write anything."""
    run(SLOTS + f"""
from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.runtime.gpu.engine import GpuEngine, slot_runs
from higgs_trt.runtime.config import lm_tensor_shapes
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from pathlib import Path

ckpt = Checkpoint(Path({str(tiny_ckpt)!r}))
tensors = ckpt.take(lm_tensor_shapes(ckpt.config), "language model")
tok = HiggsTokenizer(Path({str(tiny_ckpt)!r}) / "tokenizer.json")
ps = [build_prompt(tok, t) for t in ("Hello there.", "She sells sea shells by the sea shore, twice.", "Hi")]

def engine(page=64):
    return GpuEngine(ckpt.config, tensors, max_seq=128, max_batch=4, max_prompt=64, device="cpu", graphs=False,
                     page=page)

def prefilled(engine, joins):
    engine.prefill(joins)
    return engine

sampled = Sampling(temperature=1.0, top_k=20, seed=3)
solo = [prefilled(engine(page=128), [(0, p, sampled if i == 1 else Sampling())]) for i, p in enumerate(ps)]
together = prefilled(scramble(engine()), [(2, ps[0], Sampling()), (0, ps[1], sampled), (1, ps[2], Sampling())])
for alone, slot, p in zip(solo, (2, 0, 1), ps):
    n = len(p)
    assert torch.equal(slot_cache(alone, 0, n), slot_cache(together, slot, n))
    assert torch.equal(alone.codes[0], together.codes[slot]) and torch.equal(alone.h[0], together.h[slot])
    assert int(alone.write_pos[0]) == int(together.write_pos[slot]) == n
    assert all(torch.equal(a[0], b[slot]) for a, b in zip(alone.states, together.states))
assert slot_runs([2, 0, 1, 5]) == [(0, 2, 1), (1, 0, 2), (3, 5, 1)]  # the slots' states go up run by run

# a captured prefill graph pads the group to its count and length buckets: empty prompts and rows past each prompt
# change nothing of the real prompts' keys, values and logits, and write nothing: each slot reserves its prompt's
# positions only, so a padding row's key would land past them (in its page, or in a page it does not hold)
def staged(length, count):
    padded = scramble(engine())
    for slot, p in zip((2, 0, 1), ps):
        assert padded.reserve(slot, len(p))
    padded.kv.upload()
    padded._stage_prompts([(slot, p, 0) for slot, p in zip((2, 0, 1), ps)], length, count)
    padded._prefill_padded(count, length)
    return padded
longest = max(len(p) for p in ps)
padded, exact = staged(64, 4), staged(longest, len(ps))
assert torch.equal(padded.logits[:len(ps)], exact.logits[:len(ps)])
for slot, p in zip((2, 0, 1), ps):
    n = len(p)
    assert torch.equal(slot_cache(padded, slot, n), slot_cache(exact, slot, n))
    assert not slot_cache(padded, slot, 64)[:, :, :, n:].any()
held = [page for pages in padded.kv.held for page in pages]
assert len(held) == 3 and not padded.caches[:, :, [p for p in range(padded.kv.pages) if p not in held]].any()
""")


def test_prefix_cache_changes_no_number_of_a_cloned_voice_alone_or_in_a_group(tiny_ckpt):
    """The GPU engine's reference prefix cache on the CPU. A reference part's keys and values prefilled alone equal
    those inside the whole prompt (what the cache rests on). A cloned voice's request with the cache off, cold (a
    miss, in a group with a second voice that the 1-entry cache lets go first) and warm (a hit, in a group of joins
    with a zero-shot prompt and another text in the same voice) starts from the same slot state — keys and values,
    logits, first codes, next input, decode state — and decodes the same rows; the warm group's pass takes only the
    rows past the reference part. The engine without the cache has fixed slots (a page of max_seq each, the layout
    before paging); the cached one pages handed out in a random order, the prompts spanning two pages, the warm
    group's slots released and reserved again first. It runs its prefills and steps as their captured graphs would
    (the passes padded to the graphs' count and length buckets)."""
    run(SLOTS + f"""
from pathlib import Path
from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.runtime.gpu.engine import GpuEngine
from higgs_trt.runtime.config import lm_tensor_shapes
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.prompt import HiggsTokenizer, Prompt, build_prompt

ckpt = Checkpoint(Path({str(tiny_ckpt)!r}))
tensors = ckpt.take(lm_tensor_shapes(ckpt.config), "language model")
tok = HiggsTokenizer(ckpt.dir / "tokenizer.json")
rng = np.random.default_rng(1)
voice, second_voice = (rng.integers(0, 1024, (t, 8)).astype(np.int32) for t in (30, 6))
cloned = build_prompt(tok, "The cache should not matter.", voice, "Some words.")
other = build_prompt(tok, "Another sentence in that voice.", voice, "Some words.")
second = build_prompt(tok, "A second voice.", second_voice)
plain = build_prompt(tok, "Hi")
n = cloned.prefix
assert 0 < n < len(cloned) and other.prefix == n and other.prefix_key == cloned.prefix_key != second.prefix_key
assert 64 < len(cloned) < len(other) <= 96
sampled = Sampling(temperature=1.0, top_k=20, seed=3)

def engine(entries, page=64):
    return GpuEngine(ckpt.config, tensors, max_seq=192, max_batch=4, max_prompt=96, device="cpu", graphs=False,
                     prefix_entries=entries, page=page)

def state(engine, slot, prompt, j):
    # a slot's state after a prefill whose j-th prompt it was (its decode state but the positions its pages hold)
    return ([slot_cache(engine, slot, len(prompt)).clone(), engine.logits[j].clone(), engine.codes[slot].clone(),
             engine.h[slot].clone()] + [t[slot].clone() for t in engine.states if t is not engine.limit])

def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

off = engine(0, page=192)
off.prefill([(1, cloned, sampled)])
alone = state(off, 1, cloned, 0)
assert off.prefixes.misses == 1 and not off.prefixes.kept
off.prefill([(0, Prompt(cloned.input_ids[:n], cloned.audio_rows[:n], cloned.is_audio[:n], 0), Sampling())])
assert torch.equal(slot_cache(off, 0, n), slot_cache(off, 1, n))

cached = scramble(engine(1))
replayed = []

class Replayed:
    # what a captured graph does on the GPU: its shape's launches over whatever is staged
    def __init__(self, launch, shape):
        self.launch, self.shape = launch, shape

    def replay(self):
        replayed.append(self.shape)
        self.launch()

for length in cached.prompt_buckets:
    for count in (c for c in cached.buckets if c * length <= cached.pass_rows):
        cached.graphs["prompt", count, length] = Replayed(lambda c=count, l=length: cached._prefill_padded(c, l),
                                                          (count, length))
        cached.prompt_counts[length] = count
for b in cached.buckets:
    for parity in (0, 1):
        cached.graphs[b, parity, 1] = Replayed(lambda b=b, p=parity: cached._decode_rows(b, 1, p), b)

def bucket(rows):
    return next(b for b in cached.prompt_buckets if b >= rows)

cached.prefill([(0, second, Sampling()), (1, cloned, sampled), (2, other, Sampling())])
assert (cached.prefixes.hits, cached.prefixes.misses) == (0, 3) and list(cached.prefixes.kept) == [cloned.prefix_key]
assert replayed == [(4, bucket(len(other)))]
assert same(state(cached, 1, cloned, 1), alone)
cold_other = state(cached, 2, other, 2)
kept = cached.prefixes.kept[cloned.prefix_key]
cfg = ckpt.config
assert kept.shape == (cfg.num_layers, 2, 1, cfg.num_kv_heads, 64, cfg.head_dim) and kept.dtype == torch.bfloat16

cached.release(0)
cached.release(1)
assert cached.reserve(1, len(cloned) + 2)  # slot 0 takes max_seq at its prefill, as a slot that reserved nothing
cached.prefill([(3, plain, Sampling()), (0, other, Sampling()), (1, cloned, sampled)])
assert (cached.prefixes.hits, cached.prefixes.misses) == (2, 3)
assert replayed[-1] == (4, bucket(max(len(plain), len(other) - n))) and replayed[-1][1] < bucket(len(other))
assert same(state(cached, 1, cloned, 2), alone) and same(state(cached, 0, other, 1), cold_other)

def decoded(engine, n):
    # each live slot's rows not read yet (its first row, then two steps')
    for _ in range(2):
        engine.step(n)
    rows = {{}}
    for slot, codes in engine.rows():
        rows.setdefault(slot, []).append(codes)
    return rows

with_cache, without = decoded(cached, 4), decoded(off, 2)
assert len(without[1]) == 3 and with_cache[1] == without[1] and with_cache[0] == with_cache[2]
""")


def test_engine_step_of_several_rows_equals_single_steps(tiny_ckpt):
    """A step that decodes STEP_ROWS rows at once (what a lone stream's replay does) hands back the rows, oldest
    first, that as many one-row steps give."""
    run(f"""
from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.runtime.gpu.engine import STEP_ROWS, GpuEngine
from higgs_trt.runtime.config import lm_tensor_shapes
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from pathlib import Path

ckpt = Checkpoint(Path({str(tiny_ckpt)!r}))
tensors = ckpt.take(lm_tensor_shapes(ckpt.config), "language model")
prompt = build_prompt(HiggsTokenizer(Path({str(tiny_ckpt)!r}) / "tokenizer.json"), "Hello there.")
rows = STEP_ROWS[1]

def decoded(per_step):
    engine = GpuEngine(ckpt.config, tensors, max_seq=64, max_batch=1, max_prompt=32, device="cpu", graphs=False)
    engine.prefill([(0, prompt, Sampling(temperature=1.0, seed=5))])
    out = []
    for _ in range(rows // per_step):
        engine.step(1, per_step)
        out += engine.rows(keep=engine.lag)  # as the scheduler reads them: a parity's buffer is then reused
    return out + engine.rows()

several, single = decoded(rows), decoded(1)
assert rows > 1 and len(several) == rows + 1 and several == single, (several, single)
""")


def test_fp8_engine_follows_the_ort_fp8_twin_teacher_forced(tiny_fp8_engine, tiny_ckpt):
    """The GPU engine in FP8 from an FP8 engine directory (its weights.bin and calibration.json) against ONNX Runtime
    running that directory's bf16-rounding FP8 twin (lm.fp8.bf16ref.onnx, builder/bf16_twin.py), teacher-forced with
    the twin's greedy rows: the engine rounds where the graph rounds, so they agree to the order of fp32 sums (measured
    0.999999 at every step). One bf16 rounding out of place is enough to fail: with silu's sigmoid not rounded
    (the graph's Sigmoid output is bf16) the prompt's row drops to 0.9985, with softmax weights multiplying the values
    in bf16 to 0.9991; with the interpreter's own fp32 → bf16 truncation to 0.998. Against the fp32 twin
    (lm.fp8.ref.onnx) the same engine gives 0.998: FP8 quantization turns bf16-vs-fp32 differences into whole FP8
    steps. On the H200 tests/test_gpu_engine.py holds the engine to the same twin at mid width."""
    run(f"""
from pathlib import Path
from fp8_twin import twin_logits
from higgs_trt.runtime.gpu.weights import EngineWeights
from higgs_trt.runtime.gpu.engine import GpuEngine
from higgs_trt.runtime.config import lm_tensor_shapes
from higgs_trt.calibration.calibrate import load_calibration
from higgs_trt.runtime.decoding import NO_END, Sampling
from higgs_trt.runtime.manifest import EngineDir
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt

engine = EngineDir(Path({str(tiny_fp8_engine)!r}))
prompt = build_prompt(HiggsTokenizer(Path({str(tiny_ckpt)!r}) / "tokenizer.json"), "The quick brown fox.")
twin, fed = twin_logits(engine, prompt, 12, "lm_fp8_bf16ref")

weights = EngineWeights(engine)
amax = load_calibration(engine.path / engine.manifest["calibration"]["file"], engine.fingerprint)["activation_amax"]
gpu = GpuEngine(weights.config, weights.take(lm_tensor_shapes(weights.config), "language model"), max_seq=64,
                max_batch=1, max_prompt=32, act_amax=amax, device="cpu", graphs=False)
gpu.prefill([(0, prompt, Sampling())])
got = [gpu.logits[0].clone()]
for r, row in enumerate(fed, 1):
    gpu.h[0] = gpu.table[torch.from_numpy(row).long() + gpu.offsets].float().sum(0).bfloat16()
    gpu.write_pos[0], gpu.row_index[0], gpu.end_frame[0] = len(prompt) + r - 1, r, int(NO_END)
    gpu.step(1)
    got.append(gpu.logits[0].clone())
cos = F.cosine_similarity(torch.stack(got), twin, dim=1)
print("cosine to the bf16-rounding FP8 twin", cos.tolist())
assert cos.min() >= 0.9999, cos.tolist()
""")


def test_a_request_steps_in_the_32_row_bucket_of_paged_slots_as_alone_in_a_fixed_slot(tiny_ckpt):
    """A request in slot 16 of a paged engine steps in the 32-row bucket (32 rows a product, decode attention by TMA:
    launches.ATTENTION_TMA_BUCKETS) beside 16 live slots of random next inputs and random caches and 15 idle ones,
    its pages handed out in a random order; alone in a fixed slot (a page of max_seq: the layout before paging) it
    steps in the 1-row bucket (16 rows a product, per-thread loads): the same codes (the tiny engine in Triton's
    interpreter on the CPU)."""
    run(SLOTS + f"""
from pathlib import Path
from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.runtime.gpu.engine import GpuEngine
from higgs_trt.runtime.config import lm_tensor_shapes
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt

ckpt = Checkpoint(Path({str(tiny_ckpt)!r}))
tensors = ckpt.take(lm_tensor_shapes(ckpt.config), "language model")
prompt = build_prompt(HiggsTokenizer(ckpt.dir / "tokenizer.json"), "Request number 0, spoken among others.")

def decoded(engine, slot):
    engine.prefill([(slot, prompt, Sampling(temperature=1.0, top_k=50, seed=7))])
    for _ in range(3):
        engine.step(slot + 1)
    return [codes for s, codes in engine.rows() if s == slot]

alone = decoded(GpuEngine(ckpt.config, tensors, max_seq=64, max_batch=1, max_prompt=32, device="cpu", graphs=False,
                          page=64), 0)
crowd = scramble(GpuEngine(ckpt.config, tensors, max_seq=64, max_batch=32, max_prompt=32, device="cpu",
                           graphs=False, cache_positions=17 * 64))
gen = torch.Generator().manual_seed(0)
crowd.caches.copy_(torch.randn(crowd.caches.shape, generator=gen))
for slot in range(16):
    assert crowd.reserve(slot, 64)
crowd.h[:16] = torch.randn(16, ckpt.config.hidden_size, generator=gen)
crowd.write_pos[:16] = torch.randint(0, 64, (16,), generator=gen)
crowd.active[:16] = 1
assert crowd.bucket_of[17] == 32
beside = decoded(crowd, 16)
assert len(alone) == 4 and beside == alone, (alone, beside)
""")


def test_a_request_waits_for_cache_pages_and_decodes_the_same_in_pages_another_released(tiny_ckpt):
    """The scheduler through the slot contract's reserve, on a paged engine whose cache holds two requests: of three,
    the third waits (reserve refused) until the first ends, then joins mid-flight in the first's slot and page; its
    prompt and sampling are the first's, and so are its codes."""
    run(f"""
from pathlib import Path
from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.runtime.gpu.codec import CodecDecoder
from higgs_trt.runtime.gpu.engine import GpuEngine
from higgs_trt.runtime.config import lm_tensor_shapes
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from higgs_trt.runtime.request import request_for
from higgs_trt.runtime.scheduler import Scheduler

ckpt = Checkpoint(Path({str(tiny_ckpt)!r}))
tensors = ckpt.take(lm_tensor_shapes(ckpt.config), "language model")
engine = GpuEngine(ckpt.config, tensors, max_seq=64, max_batch=3, max_prompt=32, device="cpu", graphs=False,
                   cache_positions=2 * 64, codec=CodecDecoder.from_checkpoint(ckpt))
tok = HiggsTokenizer(ckpt.dir / "tokenizer.json")
first, second = (build_prompt(tok, t) for t in ("The first one.", "The second one, a little longer."))
scheduler = Scheduler(engine)
sampled = Sampling(temperature=1.0, top_k=50, seed=5)
a, b, c = (scheduler.submit(request_for(engine, p, s, hard_cap=cap))
           for p, s, cap in ((first, sampled, 8), (second, Sampling(), 11), (first, sampled, 8)))
scheduler.step()
assert scheduler.slots[:2] == [a, b] and list(scheduler.queue) == [c] and not engine.kv.free
for _ in range(20):  # a's 8 rows, and a few more
    if c in scheduler.slots:
        break
    scheduler.step()
assert a.finished and not b.finished and scheduler.slots[0] is c
scheduler.run()
assert len(a.utterance.rows) == 8 and np.array_equal(np.stack(c.utterance.rows), np.stack(a.utterance.rows))
assert len(engine.kv.free) == 2
""")


def recorded_step(ckpt_dir) -> str:
    """Script lines: a tiny engine on the CPU with every kernel launch of the decode step recorded by name in
    `launched`, after one step."""
    return f"""
from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.plugins import attention, codebook, engine_kernels
from higgs_trt.runtime.gpu.engine import GpuEngine
from higgs_trt.runtime.config import lm_tensor_shapes
from pathlib import Path

launched = []

class Recorded:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        def run(*args, **kwargs):
            launched.append(self.kernel.fn.__name__)
            return launch(*args, **kwargs)
        return run

for module, name in ((engine_kernels, "rms_norm"), (engine_kernels, "linear"), (engine_kernels, "advance_slots"),
                     (attention, "decode_attention_split"), (codebook, "delayed_codebook_sample")):
    setattr(module, name, Recorded(getattr(module, name)))
ckpt = Checkpoint(Path({str(ckpt_dir)!r}))
tensors = ckpt.take(lm_tensor_shapes(ckpt.config), "language model")
engine = GpuEngine(ckpt.config, tensors, max_seq=64, max_batch=1, max_prompt=32, device="cpu", graphs=False)
engine.active[:1] = 1
engine.decode_step(1)
"""


def test_profile_labels_follow_the_engines_launch_order(tiny_ckpt):
    """bench profile names each kernel of a step by its place: the names must follow the order in which the engine's
    decode step launches them (recorded here around every kernel of a tiny engine's step)."""
    run(recorded_step(tiny_ckpt) + """
from higgs_trt.runtime.bench.profile import label_step
labels = label_step(launched, ckpt.config.num_layers)
assert labels[:7] == ["norm (input)", "q|k|v", "attention", "o", "norm (post)", "gate|up", "down"], labels[:7]
assert labels[-4:] == ["norm (final)", "audio head", "codebook", "advance"]
try:
    label_step(launched[:3] + launched[4:], ckpt.config.num_layers)
except ValueError as e:
    assert "kernels in the step" in str(e)
else:
    raise AssertionError("a step with a kernel missing was labelled")
""")


def test_leave_out_launches_none_of_a_kind_and_puts_the_kernels_back(tiny_ckpt):
    """bench profile --leave-out times the step without a kernel kind: inside left_out the engine's step launches
    none of it and every other kernel as before; afterwards the kernels are the ones that were there."""
    run(recorded_step(tiny_ckpt) + """
from higgs_trt.runtime.bench.profile import LEAVE_OUT, left_out
every = list(launched)
names = {"norms": "rms_norm", "attention": "decode_attention_split", "GEMMs": "linear"}
before = {(module, name): getattr(module, name) for targets in LEAVE_OUT.values() for module, name in targets}
for kinds in (("norms",), ("attention",), ("GEMMs",), ("norms", "attention")):
    launched.clear()
    with left_out(kinds):
        engine.decode_step(1)
    gone = {names[kind] for kind in kinds}
    assert launched == [name for name in every if name not in gone], (kinds, launched)
    assert all(getattr(module, name) is kernel for (module, name), kernel in before.items())
""")


def test_profile_summary_per_layer_and_read_rate():
    from higgs_trt.runtime.bench.profile import LAYER, TAIL, label_step, summarize

    names = [kernel + "_0d1d" for kernel, _ in LAYER] * 2 + [kernel for kernel, _ in TAIL]
    labels = label_step(names, 2)
    us = [2.0, 10.0, 8.0, 5.0, 2.0, 20.0, 10.0] * 2 + [1.0, 4.0, 3.0, 1.0]
    lines = summarize(labels, us, 2, {"gate|up": 40_000_000, "audio head": 2_000_000})
    gate_up = next(line for line in lines if "gate|up" in line)
    assert "20.0 µs a layer" in gate_up and "2.00 TB/s" in gate_up, gate_up  # 40 MB in 20 µs
    assert "0.50 TB/s" in next(line for line in lines if "audio head" in line)  # 2 MB in 4 µs, once a step
    assert lines[-1].split()[1] == f"{sum(us) / 1e3:.3f}"
    with pytest.raises(ValueError, match="kernel 1 of the step is 'rms_norm'"):
        label_step(["rms_norm", "rms_norm"] + names[2:], 2)
