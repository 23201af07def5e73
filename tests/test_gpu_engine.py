"""The GPU engine on an NVIDIA GPU (run on the GPU host: `pytest -m gpu`): its kernels at Higgs v3 dimensions against
exact references, batch invariance, and the whole engine against the fp32 torch reference, teacher-forced."""

import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

HQ, HKV, D, HIDDEN, INTER, S_MAX = 32, 8, 128, 2560, 9728, 2048


def exact_linear(x, lin):
    """What the linear kernel computes, in fp32 from the same (quantised) operands, before its output rounding; for a
    gated pair also the gate's and the up projection's sums as the kernel rounds them (else None)."""
    if lin.fp8:
        xq = (x.float() / lin.x_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * lin.x_scale
        w = lin.weight.float() * lin.scale[:, None]
        u = lin.up.float() * lin.up_scale[:, None] if lin.up is not None else None
    else:
        xq, w, u = x.float(), lin.weight.float(), lin.up.float() if lin.up is not None else None
    y = xq @ w.T
    if u is None:
        return y, None, None
    g, u = y.bfloat16().float(), (xq @ u.T).bfloat16().float()
    return (g * torch.sigmoid(g).bfloat16().float()).bfloat16().float() * u, g, u  # the graph's Sigmoid, then Mul


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape", ["qkv", "o", "gate_up", "down"])
def test_linear_at_higgs_dimensions_is_exact_and_batch_invariant(shape, fp8):
    from higgs_trt.runtime.gpu.engine import Workspace
    from higgs_trt.runtime.gpu.linear import Linear

    n, k, gated = {"qkv": ((HQ + 2 * HKV) * D, HIDDEN, False), "o": (HIDDEN, HQ * D, False),
                   "gate_up": (INTER, HIDDEN, True), "down": (HIDDEN, INTER, False)}[shape]
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
    up = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02 if gated else None
    lin = Linear(w, up, act_amax=6.0 if fp8 else None)
    # launched as the engine launches them on this GPU: with programmatic dependent launch from Hopper on (the
    # waits, and the next kernel's launch at a tile's start or end: TileConfig.late_launch)
    ws = Workspace(n, 64, 1, 1, 16, 16, "cuda", pdl=torch.cuda.get_device_capability() >= (9, 0))
    x = torch.randn(200, k, device="cuda", generator=g).bfloat16()
    ref, gate, up_sum = exact_linear(x, lin)
    rounding = 5 * 2 ** -8 if gated else 2 ** -7  # half an ulp per bf16 rounding: one, or five when gated
    # FP8 wgmma sums each instruction's 32 products in the tensor core's reduced precision (gpu_linear.FP8_SPAN):
    # H200, these operands: up to 1.7e-3 beyond the roundings at outputs of about unit size
    slack = 4e-3 if fp8 else 1e-3
    bound = ref.abs() * rounding + slack
    if gated:  # that error in the gate or the up sum, and the bf16 rounding it may flip, times the other factor
        silu = torch.nn.functional.silu(gate).abs()
        wgmma_fp8 = (slack + gate.abs() * 2 ** -7) * 1.1 * up_sum.abs() + (slack + up_sum.abs() * 2 ** -7) * silu
    # decode: 16, 32 and 64 rows per product (narrow, wide tiles; 200 rows: more than one product); prefill: its own
    # tiles at any number of rows
    for prefill, sizes in ((False, (1, 5, 16, 20, 37, 64, 200)), (True, (1, 16, 41, 64, 200))):
        outs = {}
        for m in sizes:
            out = torch.full((200, n), float("nan"), device="cuda").bfloat16()
            lin(x, out, m, ws, prefill=prefill)
            torch.cuda.synchronize()
            assert not out[:m].isnan().any() and out[m:].isnan().all()  # every row written, none past M
            outs[m] = out[:m]
        for m in (64, 200):
            err = (outs[m].float() - ref[:m]).abs()
            tiles = lin.tiles.for_rows(m, prefill)
            loose = bound + wgmma_fp8 if gated and fp8 and tiles.block_n >= 64 else bound  # mma.sync: exact sums
            assert (err <= loose[:m]).all(), (prefill, m, float(err.max()))
        for m, out in outs.items():  # row 0 is the same whatever else is in the batch
            assert torch.equal(out[0], outs[1][0]), (prefill, m)
    assert not ws.tickets.any()


def test_codec_snake_on_the_gpu_equals_its_formula():
    """The codec's Snake in one Triton pass (CUDA tensors) against the module's torch formula on the CPU, at the last
    decoder block's size for 4 windows of 45 frames."""
    from higgs_trt.runtime.gpu.codec import Snake

    snake = Snake(32)
    snake.alpha.data = torch.rand(1, 32, 1) * 2 + 0.05
    x = torch.randn(4, 32, 45 * 960) * 4
    ref = snake(x)
    got = snake.cuda()(x.cuda()).cpu()
    assert (got - ref).abs().max() <= 1e-5 * (1 + ref.abs().max()), float((got - ref).abs().max())


def paged(caches, page, seed=0):
    """Contiguous caches [B, Hkv, S, D] as a pool of pages in scrambled order and the page table naming each row's."""
    b, h, s, d = caches.shape
    width = s // page
    table = torch.randperm(b * width, generator=torch.Generator().manual_seed(seed)).view(b, width).int()
    pool = torch.empty(b * width, h, page, d, dtype=caches.dtype, device=caches.device)
    pool[table.flatten().long()] = caches.view(b, h, width, page, d).transpose(1, 2).reshape(b * width, h, page, d)
    return pool, table.to(caches.device)


def unpaged(pool, table):
    (b, width), (_, h, page, d) = table.shape, pool.shape
    return pool[table.flatten().long()].view(b, width, h, page, d).transpose(1, 2).reshape(b, h, width * page, d)


def test_decode_attention_at_higgs_dimensions():
    """decode_attention_split from the q|k|v row: the new key and value written at each row's position, attention
    over the prefix against fp32, and the same bits alone and in the batch, with 2 or 3 pipeline stages; over the
    engine's paged caches (pages of 64 scrambled in a pool), the same bits out and written, with per-thread loads,
    TMA or the L2 prefetch."""
    from decode_rows import decode_rows

    from higgs_trt.plugins import attention, rope
    from higgs_trt.runtime.gpu.engine import ATTENTION_BLOCK, ATTENTION_CHUNK, ATTENTION_WARPS, attention_tma

    torch.manual_seed(0)
    lengths = [1, 255, 256, 257, 1000, 2048, 77, 513]
    b = len(lengths)
    qkv, qn, kn, cos, sin, kc, vc, pos, k_ref, v = decode_rows(lengths, HQ, HKV, D, S_MAX)
    chunks = -(-S_MAX // ATTENTION_CHUNK)
    cuda = {name: t.cuda() for name, t in dict(qkv=qkv, qn=qn, kn=kn, cos=cos, sin=sin, kc=kc, vc=vc, pos=pos).items()}

    def attend(rows, stages=3, tma=False, page=0, prefetch=False):
        out = torch.full((len(rows), HQ * D), float("nan"), device="cuda").bfloat16()
        kc2, vc2 = cuda["kc"][rows].clone(), cuda["vc"][rows].clone()
        paging = {}
        if page:
            (kc2, table), (vc2, _) = paged(kc2, page), paged(vc2, page)
            paging = dict(pages=table, active=torch.ones(len(rows), dtype=torch.int32, device="cuda"), PAGE=page)
        parts = torch.empty(len(rows), HQ, chunks, D, device="cuda")
        stats = torch.empty(len(rows), HQ, chunks, 2, device="cuda")
        tickets = torch.zeros(len(rows) * HKV, device="cuda", dtype=torch.int32)
        descriptors = attention_tma(kc2, vc2) if tma else {}
        attention.decode_attention_split[(len(rows), HKV, chunks)](
            cuda["qkv"][rows], cuda["qn"], cuda["kn"], cuda["cos"], cuda["sin"], kc2, vc2, cuda["pos"][rows], out,
            parts, stats, tickets, S_MAX, 1e-6, 1.0, Q_HEADS=HQ, KV_HEADS=HKV, HEAD_DIM=D, CHUNK=ATTENTION_CHUNK,
            BLOCK_S=ATTENTION_BLOCK, MAX_CHUNKS=chunks, num_stages=stages,
            num_warps=ATTENTION_WARPS, PREFETCH=prefetch, **descriptors, **paging)
        torch.cuda.synchronize()
        assert not tickets.any()
        if page:
            kc2, vc2 = unpaged(kc2, table), unpaged(vc2, table)
        return out.cpu(), kc2.cpu(), vc2.cpu()

    everyone = list(range(b))
    got, kc2, vc2 = attend(everyone)
    # q as the two-kernel chain computes it (qk_norm_rope_kv_write, tested against the formula in CI): the reference
    # attention starts from it, so that the bounds below measure attention, not q's roundings
    q_chain = torch.empty(b, HQ * D, device="cuda").bfloat16()
    (k_pool, table), (v_pool, _) = paged(cuda["kc"].clone(), 64), paged(cuda["vc"].clone(), 64)
    rows = torch.arange(b, device="cuda")
    rope.qk_norm_rope_kv_write[(b,)](
        cuda["qkv"], cuda["qn"], cuda["kn"], cuda["cos"], cuda["sin"], cuda["pos"], rows, rows, table, q_chain,
        k_pool, v_pool, 1, S_MAX, 1e-6, Q_HEADS=HQ, KV_HEADS=HKV, HALF=D // 2, PAGE=64)
    q_chain = q_chain.cpu().view(b, HQ, D)
    for i, n in enumerate(lengths):
        kb = k_ref[i]
        bound = 2 * 2 ** -8 * (kb.abs() + torch.cat([kb[..., D // 2:], kb[..., :D // 2]], -1).abs()) + 1e-6
        assert ((kc2[i, :, n - 1].float() - kb).abs() <= bound).all(), n
        assert torch.equal(vc2[i, :, n - 1], v[i])
        assert kc2[i, :, n:].isnan().all()
        qs = (q_chain[i].float() * D ** -0.5).bfloat16().float()
        keys = kc2[i, :, :n].float().repeat_interleave(HQ // HKV, 0)
        values = vc2[i, :, :n].float().repeat_interleave(HQ // HKV, 0)
        ref = (torch.softmax(qs[:, None] @ keys.transpose(1, 2), -1) @ values)[:, 0]
        assert ((got[i].view(HQ, D).float() - ref).abs() <= 0.02 * ref.abs() + 2e-3).all(), n
        assert torch.equal(attend([i])[0][0], got[i])  # alone or in the batch: the same bits
    # the pipeline stages and the loads (per thread or TMA) follow the batch (gpu_engine.attention_stages,
    # ATTENTION_TMA_BUCKETS): they must not change a bit, nor what is written into the caches
    assert torch.equal(attend(everyone, stages=2)[0], got)
    by_tma, kc3, vc3 = attend(everyone, stages=2, tma=True)
    assert torch.equal(by_tma, got)
    assert torch.equal(kc3.view(torch.int16), kc2.view(torch.int16))
    assert torch.equal(vc3.view(torch.int16), vc2.view(torch.int16))
    for page, tma, prefetch in ((64, False, False), (64, True, False), (128, False, True)):
        by_page, kc3, vc3 = attend(everyone, stages=2, tma=tma, page=page, prefetch=prefetch)
        assert torch.equal(by_page, got), (page, tma, prefetch)
        assert torch.equal(kc3.view(torch.int16), kc2.view(torch.int16))
        assert torch.equal(vc3.view(torch.int16), vc2.view(torch.int16))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from higgs_trt.builder.tiny import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def open_engine(ckpt_dir, max_batch=8, amax=None, cache_pages=None):
    """The tiny engine as `run` opens it: graphs, a cache of `cache_pages` pages (None: the default budget)."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.runtime.gpu.engine import load_gpu_engine
    from higgs_trt.runtime.gpu.kv_pages import PAGE, position_bytes

    source = Checkpoint(ckpt_dir)
    gib = None if cache_pages is None else cache_pages * PAGE * position_bytes(source.config) / (1 << 30)
    return load_gpu_engine(source, max_seq=512, max_batch=max_batch, max_prompt=128, act_amax=amax, cache_gib=gib)


def fp8_amax(ckpt_dir):
    """FP8 activation scales calibrated on the GPU from the checkpoint's BF16 reference, as `run --precision fp8`."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.torch_backend import bf16_reference
    from higgs_trt.calibration.calibrate import calibrate

    return calibrate(bf16_reference(Checkpoint(ckpt_dir), "cuda"))["activation_amax"]


def samplings(temperature, n):
    """Request i's sampling: greedy, or top-k 50 and top-p 0.95 at `temperature`; seed i."""
    from higgs_trt.runtime.decoding import Sampling

    return [Sampling(temperature, top_k=50 if temperature else 0, top_p=0.95 if temperature else 1.0, seed=i)
            for i in range(n)]


def join_mid_flight(engine, ps, sampling):
    """ps[1:] decode together for 7 steps, then ps[0] joins their batch; (the joined request, the others), all run
    to their end."""
    from higgs_trt.runtime.request import request_for
    from higgs_trt.runtime.scheduler import Scheduler

    mixed = Scheduler(engine)
    others = [mixed.submit(request_for(engine, p, s, hard_cap=120)) for p, s in zip(ps[1:], sampling[1:])]
    for _ in range(7):
        mixed.step()
    joined = mixed.submit(request_for(engine, ps[0], sampling[0], hard_cap=120))
    mixed.run()
    return joined, others


def slot_cache(engine, slot, n):
    """The slot's first n positions [layers, K/V, Hkv, n, D], read through its page table."""
    pages = engine.kv.take(slot, n)
    layers, _, count, heads, page, d = pages.shape
    return pages.permute(0, 1, 3, 2, 4, 5).reshape(layers, 2, heads, count * page, d)[:, :, :, :n]


def test_captured_codec_windows_equal_the_eager_codec(tiny):
    """The engine replays a CUDA graph per window count bucket for the default plan's four window shapes (frames,
    kept frames): the kept samples of the same call made eagerly, for fresh codes at each call (the graph reads its
    input buffer, not the codes it was captured with), for a count padded up to its bucket (3 windows in the graph
    of 4), and for a last window keeping fewer frames than the graph it replays; and within fp16's rounding of the
    whole window decoded at once (the engine's codec: CodecDecoder.fp16)."""
    engine = open_engine(tiny, max_batch=4)
    assert len(engine.codec_calls.graphs) == 4 * len(engine.codec_calls.buckets) == 12
    shapes = sorted({shape for _, shape in engine.codec_calls.graphs})
    calls = [(n, frames, keep) for n, (frames, keep) in engine.codec_calls.graphs] * 2 + [(3, *shape) for shape in shapes]
    rng = np.random.default_rng(0)
    for windows, frames, keep in calls + [(2, 45, (33, 45)), (1, 45, (44, 45))]:
        kept = engine.codec_calls.captured(windows, frames, keep)[-1]
        codes = rng.integers(0, 1024, (windows, engine.codec_model.dims.num_quantizers, frames))
        got = engine.codec(codes, keep).result()
        padded = np.zeros((engine.codec_calls.bucket_of[windows], *codes.shape[1:]), codes.dtype)  # as the engine pads a call
        padded[:windows] = codes
        with torch.inference_mode():  # the replayed call's shape: cuDNN's roundings depend on crop and count
            eager = engine.codec_model(torch.from_numpy(padded).cuda(), kept).cpu().numpy()[:windows]
            eager = eager[..., (keep[0] - kept[0]) * 960:(keep[1] - kept[0]) * 960]
            whole = engine.codec_model(torch.from_numpy(codes).cuda()).cpu().numpy()[..., keep[0] * 960:keep[1] * 960]
        assert got.shape == eager.shape and np.abs(got - eager).max() <= 1e-5 * (1 + np.abs(eager).max()), (frames, keep)
        assert np.sqrt(np.mean((got - whole) ** 2) / np.mean(whole ** 2)) < 1e-2, (frames, keep)


def prompts(ckpt_dir, texts):
    from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt

    tok = HiggsTokenizer(ckpt_dir / "tokenizer.json")
    return [build_prompt(tok, t) for t in texts]


def teacher_forced(engine, prompt, rows):
    """The engine's logits for rows 0..len(rows): row r is fed to predict row r + 1 (decode state set on the device)."""
    from higgs_trt.runtime.decoding import NO_END, Sampling

    engine.prefill([(0, prompt, Sampling())])
    out = []
    with torch.cuda.stream(engine.stream):
        for r in range(len(rows) + 1):
            if r:
                fed = torch.as_tensor(rows[r - 1], device="cuda").long() + engine.offsets
                engine.h[0] = engine.table[fed].float().sum(0).bfloat16()
                engine.write_pos[0], engine.row_index[0], engine.end_frame[0] = len(prompt) + r - 1, r, int(NO_END)
                engine.step(1)
            engine.stream.synchronize()
            out.append(engine.logits[0].view(8, -1).clone())
    engine.rows(keep=0)
    engine.release(0)
    return torch.stack(out)


def reference_rows(ckpt_dir, prompt, rows: int, dtype=torch.float32):
    """The fp32 reference's greedy rows (as fed back) and its logits for each, on the GPU."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.model import HiggsLM
    from higgs_trt.runtime.decoding import NO_END, delay_mask
    from higgs_trt.runtime.generate import prefill_feeds, step_feeds

    model = HiggsLM.from_checkpoint(Checkpoint(ckpt_dir), 512, dtype).cuda()
    caches = model.new_caches(1, "cuda")
    feeds = prefill_feeds([prompt])
    fed, logits = [], []
    with torch.inference_mode():
        for r in range(rows + 1):
            out, codes, *caches = model(**{k: torch.from_numpy(v).cuda() for k, v in feeds.items()}, caches=tuple(caches))
            logits.append(out[0].float())
            row = delay_mask(codes.cpu().numpy(), np.array([r]), np.array([NO_END]))
            fed.append(row[0])
            feeds = step_feeds(row, np.array([len(prompt) + r]), r + 1, np.array([NO_END]))
    return fed[:rows], torch.stack(logits)


def test_greedy_codes_equal_the_fp32_reference_teacher_forced(tiny):
    """bf16 against fp32: the engine must choose the reference's code wherever the reference's best code leads the
    second by more than bf16 noise (0.5 logits); at near-ties either is right (higgs-v3-model.md, appendix)."""
    engine = open_engine(tiny)
    prompt = prompts(tiny, ["The quick brown fox jumps over the lazy dog."])[0]
    fed, ref = reference_rows(tiny, prompt, 48)
    got = teacher_forced(engine, prompt, fed)
    top2 = ref.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.5
    agree = got.argmax(-1) == ref.argmax(-1)
    assert agree[clear].all(), int((~agree[clear]).sum())
    assert clear.float().mean() > 0.9  # the comparison covers nearly every choice
    cos = torch.nn.functional.cosine_similarity(got.flatten(1), ref.flatten(1), dim=1)
    assert cos.min() >= 0.999, float(cos.min())


@pytest.mark.slow
def test_mid_checkpoint_logits_cosine_over_64_steps(tmp_path_factory):
    from higgs_trt.builder.tiny import write_random_checkpoint

    mid = write_random_checkpoint(tmp_path_factory.mktemp("mid") / "ckpt", seed=0, size="mid")
    engine = open_engine(mid, max_batch=1)
    prompt = prompts(mid, ["Four score and seven years ago our fathers brought forth on this continent."])[0]
    fed, ref = reference_rows(mid, prompt, 64)
    got = teacher_forced(engine, prompt, fed)
    cos = torch.nn.functional.cosine_similarity(got.flatten(1), ref.flatten(1), dim=1)
    print(f"mid, 64 teacher-forced steps: logits cosine min {float(cos.min()):.5f} mean {float(cos.mean()):.5f}")
    assert cos.min() >= 0.999, float(cos.min())


def mid_fp8_engine(root):
    """The mid checkpoint (seed 0) and its FP8 engine directory under `root`, exported unless there already."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.export import export_engine
    from higgs_trt.builder.tiny import write_random_checkpoint

    ckpt, engine = root / "ckpt", root / "engine"
    if not (engine / "manifest.json").exists():
        write_random_checkpoint(ckpt, seed=0, size="mid")
        export_engine(Checkpoint(ckpt), engine, max_seq=160, max_batch=1, max_prompt=96, precision="fp8", say=lambda msg: None)
    return ckpt, engine


@pytest.mark.slow
def test_fp8_engine_follows_the_ort_fp8_twin_on_the_mid_checkpoint(tmp_path_factory):
    """Issue 11's FP8 bar on the GPU: the engine from an FP8 engine directory of the mid checkpoint (its weights.bin
    and calibration.json, opened as `--backend torch --engine DIR` opens it), teacher-forced with the greedy rows of
    ONNX Runtime's bf16-rounding FP8 twin of that directory (lm.fp8.bf16ref.onnx: the FP8 graph with its bf16
    roundings). The issue asks cosine ≥ 0.999; at 12 layers no implementation can give it that does not sum in the
    twin's own order: FP8 quantization is chaotic — a sum that rounds to the other bf16 moves an FP8 code, that code
    moves many bf16 roundings of the next GEMM, and so on, until two runs sit at FP8's noise apart. Measured on the
    prompt's row (Triton's interpreter rounding as the GPU): the engine against itself with K summed in two ranges
    instead of one 0.9971, against the twin 0.9959; on the H200 (before q took the graph's bf16 scale) min 0.9958,
    mean 0.9971; against the fp32 twin 0.994. On the tiny checkpoint (2 layers, few flips) the engine equals the twin
    to 0.999999 (tests/test_gpu_kernels.py). So this holds the engine to ≥ 0.99 a step and nearer the FP8 twin than
    the BF16 one (it quantizes as the FP8 graph does), and the BF16 engine from the same directory within 0.9998 of
    the BF16 twin at every step (measured 0.99989). The export takes minutes of CPU: HIGGS_TEST_CACHE=DIR keeps it
    between runs."""
    from fp8_twin import twin_logits

    from higgs_trt.runtime.cli.engines import open_engine as open_slots
    from higgs_trt.runtime.cli.engines import open_sources
    from higgs_trt.runtime.gpu.engine import load_gpu_engine
    from higgs_trt.runtime.gpu.weights import EngineWeights
    from higgs_trt.runtime.manifest import EngineDir

    cache = os.environ.get("HIGGS_TEST_CACHE")
    mid, engine_dir = mid_fp8_engine(Path(cache) / "mid8" if cache else tmp_path_factory.mktemp("mid8"))
    prompt = prompts(mid, ["Four score and seven years ago our fathers brought forth on this continent."])[0]
    twin, fed = twin_logits(EngineDir(engine_dir), prompt, 16, "lm_fp8_bf16ref")
    fp32_twin, _ = twin_logits(EngineDir(engine_dir), prompt, 16, "lm_fp8_ref", fed)
    bf16_twin, _ = twin_logits(EngineDir(engine_dir), prompt, 16, "lm_ref", fed)
    cosine = torch.nn.functional.cosine_similarity

    fp8 = teacher_forced(open_slots(open_sources("torch", engine_dir, None, None, None), device="cuda"), prompt, fed)
    fp8 = fp8.flatten(1).float().cpu()
    to_twin, to_fp32 = cosine(fp8, twin, dim=1), cosine(fp8, fp32_twin, dim=1)
    print(f"mid FP8 engine against its bf16-rounding ORT FP8 twin, 16 teacher-forced steps: cosine min "
          f"{float(to_twin.min()):.5f} mean {float(to_twin.mean()):.5f}; against the fp32 twin min "
          f"{float(to_fp32.min()):.5f} mean {float(to_fp32.mean()):.5f}")
    assert to_twin.min() >= 0.99, to_twin.tolist()
    to_bf16 = cosine(fp8, bf16_twin, dim=1)
    assert to_twin[0] > to_bf16[0] and to_twin.mean() > to_bf16.mean(), to_bf16.tolist()

    bf16_engine = load_gpu_engine(EngineWeights(EngineDir(engine_dir)), max_seq=160, max_batch=1, max_prompt=96)
    bf16 = cosine(teacher_forced(bf16_engine, prompt, fed).flatten(1).float().cpu(), bf16_twin, dim=1)
    print(f"the BF16 engine from the same directory against the BF16 twin: cosine min {float(bf16.min()):.5f}")
    assert bf16.min() >= 0.9998, bf16.tolist()


@pytest.mark.parametrize("temperature, precision", [(0.0, "bf16"), (1.0, "bf16"), (0.0, "fp8")])
def test_a_request_decodes_the_same_alone_and_joining_a_batch(tiny, temperature, precision):
    """A request prefills from the captured graph of one prompt alone and when it joins a batch mid-flight (whose 7
    requests prefilled together from the graph of 8, one empty prompt filling it up), and from the graph of 8 in the
    middle of a group of 8: the same codes each time."""
    from higgs_trt.runtime.request import request_for
    from higgs_trt.runtime.scheduler import Scheduler

    amax = fp8_amax(tiny) if precision == "fp8" else None
    engine = open_engine(tiny, amax=amax)
    texts = ["Hello there, how are you doing today?", "She sells sea shells by the sea shore.",
             "Numbers: one, two, three.", "Wait... what? No way!", "A journey of a thousand miles.",
             "It was 3:45 pm on March 14.", "Text to speech.", "Can you call me back?"]
    ps = prompts(tiny, texts)
    sampling = samplings(temperature, len(ps))
    alone = Scheduler(engine)
    solo = alone.submit(request_for(engine, ps[0], sampling[0], hard_cap=120))
    alone.run()

    joined, others = join_mid_flight(engine, ps, sampling)
    assert np.array_equal(np.stack(solo.utterance.rows), np.stack(joined.utterance.rows))
    # windows may share a codec call, and its fp16 roundings depend on the call's window count (cuDNN's algorithms)
    a, b = solo.audio(), joined.audio()
    assert a.shape == b.shape and np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2)) < 1e-2
    assert all(r.finished for r in others)

    together = Scheduler(engine)  # prefilled in one call with the others, from the middle of the group
    group = [together.submit(request_for(engine, p, s, hard_cap=120))
             for p, s in zip(ps[1:4] + ps[:1] + ps[4:], sampling[1:4] + sampling[:1] + sampling[4:])]
    together.run()
    assert np.array_equal(np.stack(solo.utterance.rows), np.stack(group[3].utterance.rows))
    for request, other in zip(group[:3] + group[4:], others):  # and each of the others as when they joined together
        assert np.array_equal(np.stack(request.utterance.rows), np.stack(other.utterance.rows))


def cloned_prompts(ckpt_dir, texts, frames, transcript, seed=0):
    """Prompts for `texts` in one random voice of `frames` frames with its transcript."""
    from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt

    tok = HiggsTokenizer(ckpt_dir / "tokenizer.json")
    voice = np.random.default_rng(seed).integers(0, 1024, (frames, 8)).astype(np.int32)
    return [build_prompt(tok, t, voice, transcript) for t in texts]


class RecordedGraph:
    """A captured graph whose replays are listed in `replayed` by key."""

    def __init__(self, key, graph, replayed):
        self.key, self.graph, self.replayed = key, graph, replayed

    def replay(self):
        self.replayed.append(self.key)
        self.graph.replay()


@pytest.mark.parametrize("temperature, precision", [(0.0, "bf16"), (1.0, "bf16"), (0.0, "fp8")])
def test_the_prefix_cache_changes_no_code_and_a_hit_prefills_only_the_text(tiny, temperature, precision):
    """The reference prefix cache on the GPU, with graphs. The reference part's keys and values prefilled alone equal
    those inside the whole prompt (the GPU's kernels, whose tiles differ from the interpreter's). A cloned voice's
    request decodes the same codes with the cache off, cold (a miss: the whole prompt's graph) and warm (a hit: the
    graph of the rows past the reference part, and no compile), and joining mid-flight a batch of 7 whose requests
    are in that voice (hits) or zero-shot."""
    from higgs_trt.runtime.decoding import Sampling
    from higgs_trt.runtime.prompt import Prompt
    from higgs_trt.runtime.request import request_for
    from higgs_trt.runtime.scheduler import Scheduler

    amax = fp8_amax(tiny) if precision == "fp8" else None
    engine = open_engine(tiny, amax=amax)
    texts = ["Hello there, how are you doing today?", "She sells sea shells.", "Numbers: one, two, three.",
             "Wait... what? No way!", "A journey of a thousand miles.", "It was 3:45 pm.", "Text to speech.",
             "Can you call me back?"]
    cloned = cloned_prompts(tiny, texts[:5], 40, "Words of the reference.")
    ps = cloned + prompts(tiny, texts[5:])
    n = cloned[0].prefix
    assert len(ps[0]) <= engine.max_prompt and all(p.prefix_key == cloned[0].prefix_key for p in cloned)
    sampling = samplings(temperature, len(ps))

    engine.prefixes.entries = 0
    part = Prompt(ps[0].input_ids[:n], ps[0].audio_rows[:n], ps[0].is_audio[:n], 0)
    engine.prefill([(0, ps[0], Sampling())])
    engine.prefill([(1, part, Sampling())])
    torch.cuda.synchronize()
    assert torch.equal(slot_cache(engine, 0, n), slot_cache(engine, 1, n))
    engine.rows()
    engine.release(0)
    engine.release(1)

    replayed = []
    for key in [key for key in engine.graphs if key[0] == "prompt"]:
        engine.graphs[key] = RecordedGraph(key, engine.graphs[key], replayed)

    def bucket(rows):
        return next(b for b in engine.prompt_buckets if b >= rows)

    def alone(entries):
        engine.prefixes.entries = entries
        scheduler = Scheduler(engine)
        request = scheduler.submit(request_for(engine, ps[0], sampling[0], hard_cap=120))
        scheduler.run()
        return np.stack(request.utterance.rows)

    off = alone(0)
    assert not engine.prefixes.kept and replayed[-1] == ("prompt", 1, bucket(len(ps[0])))
    cold = alone(4)
    assert len(engine.prefixes.kept) == 1 and engine.prefixes.hits == 0
    before = compiled_variants()
    warm = alone(4)
    assert engine.prefixes.hits == 1 and replayed[-1] == ("prompt", 1, bucket(len(ps[0]) - n))
    assert np.array_equal(off, cold) and np.array_equal(off, warm)

    joined, others = join_mid_flight(engine, ps, sampling)
    torch.cuda.synchronize()
    assert compiled_variants() == before
    assert engine.prefixes.hits == 1 + 4 + 1 and np.array_equal(off, np.stack(joined.utterance.rows))
    assert all(r.finished for r in others)


@pytest.mark.slow
def test_a_hit_prefills_a_10_s_voice_faster_than_the_whole_prompt(tmp_path_factory):
    """At the mid checkpoint's width, a prompt in a voice of 10 s (250 frames and a transcript: ~300 of its rows):
    a hit's prefill (the entry copied into the slot, then the graph of the text's rows) takes less time than the whole
    prompt's (the cache off), and the miss that keeps the entry costs the whole prompt and a copy."""
    import time

    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.tiny import write_random_checkpoint
    from higgs_trt.runtime.decoding import Sampling
    from higgs_trt.runtime.gpu.engine import load_gpu_engine

    mid = write_random_checkpoint(tmp_path_factory.mktemp("mid") / "ckpt", seed=0, size="mid")
    engine = load_gpu_engine(Checkpoint(mid), max_seq=640, max_batch=1, max_prompt=384)
    prompt = cloned_prompts(mid, ["A sentence to speak in the cloned voice."], 250,
                            "Ten seconds of words spoken in the reference voice, more or less.")[0]
    assert len(prompt) <= engine.max_prompt

    def seconds(entries, times=5):
        engine.prefixes.entries = entries
        spent = []
        for _ in range(times):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.prefill([(0, prompt, Sampling())])
            torch.cuda.synchronize()
            spent.append(time.perf_counter() - t0)
            engine.rows()
            engine.release(0)
        return sorted(spent)[times // 2]

    whole = seconds(0)
    miss = seconds(4, times=1)
    hit = seconds(4)
    print(f"prefill of {len(prompt)} rows ({prompt.prefix} of them the reference part): whole {whole * 1e3:.2f} ms, "
          f"miss {miss * 1e3:.2f} ms, hit {hit * 1e3:.2f} ms")
    assert engine.prefixes.hits == 5 and hit < whole


def compiled_variants():
    """How many variants Triton has compiled of each kernel of the engine, in this process."""
    from triton.runtime.jit import JITFunction

    from higgs_trt.plugins import attention, codebook, engine_kernels, rope

    return {name: sum(len(cache[0]) for cache in k.device_caches.values())
            for module in (engine_kernels, attention, codebook, rope) for name, k in vars(module).items()
            if isinstance(k, JITFunction)}


def test_joins_compile_nothing(tiny):
    """Joins start slots anywhere (a run of joins at an odd slot, of any length) and come in waves of any size: the
    kernels they launch are the variants compiled at start-up. A Triton compile (~0.5 s) on the request path stalls
    every stream of a server: the step-state kernels were specialized on the slot slices' alignment (24 prefill
    calls took 1.5 s), and a wave larger than the captured prefill graphs ran eagerly, compiling variants for its
    row count (a first wave of 64 joins of 41 rows waited ~5 s)."""
    from higgs_trt.runtime.decoding import Sampling

    engine = open_engine(tiny, max_batch=32)
    p = prompts(tiny, ["Hello there."])[0]
    long = prompts(tiny, ["A longer sentence, so that its prompt takes the next length bucket of the prefill graphs,"
                          " and a little more."])[0]
    assert 64 < len(long) < 96 and len(long) % 16  # bucket 96: 4 prompts a captured pass (pass_rows 512)
    engine.prefill([(0, p, Sampling())])
    before = compiled_variants()
    for slots in ([3], [5, 6, 7], list(range(9, 20)), [1, 2, 21, 22, 23]):
        engine.prefill([(s, p, Sampling(0.8, seed=s)) for s in slots])
    engine.prefill([(s, long, Sampling()) for s in range(29)])  # by rows alone: passes of 7, eager
    torch.cuda.synchronize()
    assert compiled_variants() == before


def test_codec_graphs_cover_every_window_of_the_plan(tiny):
    """The default plan's first, second (8 + 25 + 10 frames: it starts at frame 0), middle and last windows are
    replays; a scheduler with another plan captures that plan's windows when it starts."""
    from higgs_trt.runtime.scheduler import Scheduler
    from higgs_trt.runtime.streaming import StreamPlan

    engine = open_engine(tiny)
    assert {shape for _, shape in engine.codec_calls.graphs} == {(18, (0, 8)), (43, (8, 33)), (45, (10, 35)), (45, (10, 45))}
    Scheduler(engine, StreamPlan.exact(engine.codec_strides, first=2))
    assert {frames for _, (frames, _) in engine.codec_calls.graphs} == {12, 18, 20, 43, 45}
    assert {n for n, (frames, _) in engine.codec_calls.graphs if frames == 12} == set(engine.codec_calls.buckets)


def fixed_engine(ckpt_dir, amax=None):
    """The tiny engine as open_engine's, but with fixed slots: a page of max_seq each, the cache layout before
    paging."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.runtime.config import lm_tensor_shapes
    from higgs_trt.runtime.gpu.codec import CodecDecoder
    from higgs_trt.runtime.gpu.engine import GpuEngine

    source = Checkpoint(ckpt_dir)
    codec = CodecDecoder.from_checkpoint(source).channels_last().to("cuda")
    codec.fp16()
    return GpuEngine(source.config, source.take(lm_tensor_shapes(source.config), "language model"), max_seq=512,
                     max_batch=8, max_prompt=128, act_amax=amax, codec=codec, page=512)


@pytest.mark.parametrize("temperature, precision", [(0.0, "bf16"), (1.0, "bf16"), (0.0, "fp8")])
def test_paged_slots_decode_as_fixed_slots(tiny, temperature, precision):
    """With graphs: 8 requests (5 in one cloned voice, 3 zero-shot) decoded at once in fixed slots, and through a
    paged cache of 10 pages (pages handed out in a random order) that holds two of them at a time: the others wait
    for pages, not slots, and join mid-flight into pages that others released, their voice's reference part from
    the prefix cache. Every request's codes are the same, and no join compiles anything."""
    from higgs_trt.runtime.request import request_for
    from higgs_trt.runtime.scheduler import Scheduler

    amax = fp8_amax(tiny) if precision == "fp8" else None
    texts = ["Hello there, how are you doing today?", "She sells sea shells.", "Numbers: one, two, three.",
             "Wait... what? No way!", "A journey of a thousand miles.", "It was 3:45 pm.", "Text to speech.",
             "Can you call me back?"]
    ps = cloned_prompts(tiny, texts[:5], 40, "Words of the reference.") + prompts(tiny, texts[5:])
    sampling = samplings(temperature, len(ps))

    def decoded(engine, check=lambda scheduler: None):
        scheduler = Scheduler(engine)
        requests = [scheduler.submit(request_for(engine, p, s, hard_cap=120)) for p, s in zip(ps, sampling)]
        scheduler.step()
        check(scheduler)
        scheduler.run()
        return [np.stack(r.utterance.rows) for r in requests]

    fixed = decoded(fixed_engine(tiny, amax))
    engine = open_engine(tiny, amax=amax, cache_pages=10)
    engine.kv.free = [int(p) for p in np.random.default_rng(0).permutation(engine.kv.pages)]
    assert all(len(p) + 120 <= 4 * 64 for p in ps)  # a request holds at most 4 pages: 2 fit at once

    def waits_for_pages(scheduler):
        assert len(scheduler.occupied) == 2 and len(scheduler.queue) == 6
        waits_for_pages.before = compiled_variants()

    paged = decoded(engine, waits_for_pages)
    torch.cuda.synchronize()
    assert compiled_variants() == waits_for_pages.before and engine.prefixes.hits >= 3
    assert len(engine.kv.free) == 10
    for a, b in zip(fixed, paged, strict=True):
        assert np.array_equal(a, b)


def test_a_request_decodes_the_same_in_the_128_row_bucket(tiny):
    """An engine of 128 slots captures decode graphs for the buckets past 64 (two parities each, and the 1-row
    bucket's 4-row graphs); a request joining mid-flight a batch of 100 steps in the 128-row bucket (the linear's rows
    in two products of 64): the codes it decodes alone; its audio, decoded in codec calls of more than 64 windows (in
    pieces), within fp16's reach of its audio alone."""
    from higgs_trt.runtime.decoding import Sampling
    from higgs_trt.runtime.request import request_for
    from higgs_trt.runtime.scheduler import Scheduler

    engine = open_engine(tiny, max_batch=128)
    assert engine.buckets == [1, 2, 4, 8, 16, 32, 64, 128]
    assert len([key for key in engine.graphs if key[0] != "prompt"]) == 2 * len(engine.buckets) + 2
    texts = [f"Request number {i}, spoken among many others." for i in range(100)]
    ps = prompts(tiny, texts + ["The one we follow, alone and in the crowd."])
    sampled = Sampling(1.0, top_k=50, top_p=0.95, seed=11)
    alone = Scheduler(engine)
    solo = alone.submit(request_for(engine, ps[-1], sampled, hard_cap=80))
    alone.run()

    crowd = Scheduler(engine)
    others = [crowd.submit(request_for(engine, p, Sampling(seed=i), hard_cap=160)) for i, p in enumerate(ps[:-1])]
    for _ in range(5):
        crowd.step()
    joined = crowd.submit(request_for(engine, ps[-1], sampled, hard_cap=80))
    crowd.step()
    assert joined in crowd.slots and engine.bucket_of[crowd.occupied[-1] + 1] == 128
    crowd.run()
    assert np.array_equal(np.stack(solo.utterance.rows), np.stack(joined.utterance.rows))
    a, b = solo.audio(), joined.audio()
    assert a.shape == b.shape and np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2)) < 1e-2
    assert all(r.finished for r in others)
