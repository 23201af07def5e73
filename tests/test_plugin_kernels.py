"""GPU tests of the plugin kernels at Higgs v3 dimensions: Triton JIT and the AOT PTX launched the way TensorRT
launches it, against the torch references; and the runtime's CUDA helpers (stream, pinned buffers, graphs)."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

HQ, HKV, D, HIDDEN, S_MAX, K, V = 32, 8, 128, 2560, 2048, 8, 1026


def ulp(x):
    return x.abs().clamp(min=2 ** -20) * 2 ** -7


@pytest.fixture(scope="module")
def rope():
    from higgs_trt.plugins.rope_table import rope_table
    from higgs_trt.runtime.config import HiggsConfig

    cfg = HiggsConfig(HIDDEN, 36, HQ, HKV, D, 9728, 151936, 1e-6, 1e6, 32768)
    return tuple(t.cuda() for t in rope_table(cfg, S_MAX, torch.bfloat16))


def rope_inputs(b, s, rope):
    g = torch.Generator(device="cuda").manual_seed(b * 100 + s)
    q = torch.randn(b, HQ, s, D, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(b, HKV, s, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    kc, vc = (torch.randn(b, HKV, S_MAX, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    pos = torch.randint(0, S_MAX - s, (b,), device="cuda", generator=g)
    return q, k, v, *rope, pos, kc, vc


@pytest.mark.parametrize("b, s", [(1, 1), (8, 1), (64, 1), (2, 7)])
def test_rope_kv_write_matches_torch(b, s, rope):
    from higgs_trt.builder.plugin_ops import rope_kv_write
    from higgs_trt.plugins import rope

    q, k, v, cos, sin, pos, kc, vc = rope_inputs(b, s, rope)
    exact = rope_kv_write(*(t.float() for t in (q, k, v, cos, sin)), pos, kc.float(), vc.float())
    bf16 = rope_kv_write(q, k, v, cos, sin, pos, kc, vc)  # torch's bf16 ops: a rounding per op
    q_out = torch.full_like(q, float("nan"))
    rope.rope_kv_write[(b * s,)](q, k, v, cos, sin, pos, kc, vc, s, S_MAX, q_out, kc, vc, Q_HEADS=HQ, KV_HEADS=HKV,
                                    HALF=D // 2)
    torch.cuda.synchronize()
    assert ((q_out.float() - exact[0]).abs() <= ulp(exact[0])).all()
    assert ((kc.float() - exact[1]).abs() <= ulp(exact[1])).all() and torch.equal(vc, bf16[2])
    # torch's bf16 ops round each product before subtracting: compare on the scale of the terms, not the result
    terms = q.float().abs() + torch.cat([q[..., D // 2:], q[..., :D // 2]], -1).float().abs()
    assert ((q_out.float() - bf16[0].float()).abs() <= 2 * ulp(terms)).all()


@pytest.mark.parametrize("b", [1, 8, 64])
def test_delayed_codebook_step_matches_torch(b):
    from higgs_trt.builder.plugin_ops import delayed_codebook_step
    from higgs_trt.plugins import codebook
    from higgs_trt.plugins.aot import NUM_WARPS, constants_for, grid

    g = torch.Generator(device="cuda").manual_seed(b)
    logits = torch.randn(b, K, V, device="cuda", generator=g) * 4
    logits[0, 3, 17] = logits[0, 3, 900] = 1e3  # a tie: the lower index must win
    table = torch.randn(K * V, HIDDEN, device="cuda", generator=g).bfloat16()
    row = torch.randint(0, 40, (b,), device="cuda", generator=g)
    end = torch.where(torch.rand(b, device="cuda", generator=g) < 0.5, 1 << 40, torch.randint(0, 30, (b,), device="cuda"))
    codes = torch.full((b, K), -7, device="cuda", dtype=torch.int32)
    embedding = torch.full((b, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    constants = constants_for("delayed_codebook_step", D, HIDDEN, HQ, HKV)
    codebook.delayed_codebook_step[grid("delayed_codebook_step", constants, b)](
        logits, row, end, table, codes, embedding, **constants, num_warps=NUM_WARPS["delayed_codebook_step"])
    ref_codes, ref_embedding = delayed_codebook_step(logits, row, end, table)
    assert torch.equal(codes, ref_codes)
    if row[0] >= 3 and end[0] > row[0] - 3:
        assert codes[0, 3] == 17
    exact = table.float()[ref_codes.long() + torch.arange(K, device="cuda") * V].sum(1)
    assert ((embedding.float() - exact).abs() <= ulp(exact)).all()


def test_sampling_kernel_matches_its_reference():
    from higgs_trt.plugins import codebook
    from higgs_trt.plugins.aot import NUM_WARPS, constants_for, grid
    from higgs_trt.runtime import sampling as reference

    b = 64
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(b, K, V, device="cuda", generator=g) * 3
    table = torch.randn(K * V, HIDDEN, device="cuda", generator=g).bfloat16()
    row, end = torch.full((b,), 30, device="cuda"), torch.full((b,), 1 << 40, device="cuda")
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * 16, device="cuda")
    top_k = torch.tensor([0, 50, 0, 5] * 16, device="cuda", dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5] * 16, device="cuda")
    seed = torch.arange(b, device="cuda")
    codes = torch.empty(b, K, device="cuda", dtype=torch.int32)
    embedding = torch.empty(b, HIDDEN, device="cuda", dtype=torch.bfloat16)
    constants = constants_for("delayed_codebook_step", D, HIDDEN, HQ, HKV)
    codebook.delayed_codebook_sample[grid("delayed_codebook_step", constants, b)](
        logits, row, end, table, temperature, top_k, top_p, seed, codes, embedding, torch.empty_like(row), **constants,
        num_warps=NUM_WARPS["delayed_codebook_step"])
    x, t, tk, tp = logits.cpu().numpy(), temperature.tolist(), top_k.tolist(), top_p.tolist()
    want = np.array([[reference.sample(x[i, k], t[i], tk[i], tp[i], reference.uniform(i, 30, k)) if t[i] > 0
                      else int(x[i, k].argmax()) for k in range(K)] for i in range(b)])
    agree = (codes.cpu().numpy() == want).mean()
    assert agree >= 0.99, agree  # fp32 sums in another order may move a draw sitting on a CDF boundary
    greedy = codes.cpu().numpy()[::4]
    assert np.array_equal(greedy, x[::4].argmax(-1))


def test_aot_ptx_launched_like_tensorrt_equals_the_jit_kernels(rope):
    """The PTX TensorRT would embed, launched through the CUDA driver with TensorRT's argument order."""
    from higgs_trt.plugins import codebook, rope
    from higgs_trt.plugins.aot import NUM_WARPS, compile_kernel, constants_for, grid
    from higgs_trt.plugins.launch import PtxKernel

    torch.cuda.init()
    b, s = 8, 1
    q, k, v, cos, sin, pos, kc, vc = rope_inputs(b, s, rope)
    kc2, vc2 = kc.clone(), vc.clone()
    jit_q = torch.empty_like(q)
    constants = constants_for("rope_kv_write", D, HIDDEN, HQ, HKV)
    rope.rope_kv_write[grid("rope_kv_write", constants, b, s)](q, k, v, cos, sin, pos, kc, vc, s, S_MAX, jit_q, kc,
                                                                  vc, **constants)
    aot = compile_kernel("rope_kv_write", constants)
    aot_q = torch.empty_like(q)
    PtxKernel(aot.ptx, aot.entry, aot.threads, aot.shared)(
        grid("rope_kv_write", constants, b, s), [t.data_ptr() for t in (q, k, v, cos, sin, pos, kc2, vc2)], [s, S_MAX],
        [aot_q.data_ptr(), kc2.data_ptr(), vc2.data_ptr()])
    torch.cuda.synchronize()
    assert torch.equal(aot_q, jit_q) and torch.equal(kc2, kc) and torch.equal(vc2, vc)

    logits = torch.randn(b, K, V, device="cuda")
    table = torch.randn(K * V, HIDDEN, device="cuda").bfloat16()
    row, end = torch.full((b,), 9, device="cuda"), torch.full((b,), 1 << 40, device="cuda")
    constants = constants_for("delayed_codebook_step", D, HIDDEN, HQ, HKV)
    outs = [(torch.empty(b, K, device="cuda", dtype=torch.int32), torch.empty(b, HIDDEN, device="cuda").bfloat16())
            for _ in range(2)]
    launch = grid("delayed_codebook_step", constants, b)
    codebook.delayed_codebook_step[launch](logits, row, end, table, *outs[0], **constants,
                                          num_warps=NUM_WARPS["delayed_codebook_step"])
    aot = compile_kernel("delayed_codebook_step", constants)
    PtxKernel(aot.ptx, aot.entry, aot.threads, aot.shared)(
        launch, [t.data_ptr() for t in (logits, row, end, table)], [], [t.data_ptr() for t in outs[1]])
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_runtime_cuda_helpers_capture_and_replay_a_step(rope):
    """runtime/cuda.py as the TensorRT backend uses it: pinned staging → device → kernel → pinned, in a graph."""
    from higgs_trt.plugins.aot import compile_kernel, constants_for, grid
    from higgs_trt.plugins.launch import PtxKernel
    from higgs_trt.runtime import cuda

    torch.cuda.init()
    stream = cuda.Stream()
    b = 4
    logits_host = cuda.PinnedArray((b, K, V), np.float32)
    logits_dev = cuda.DeviceArray((b, K, V), np.float32)
    state_host = cuda.PinnedArray((2, b), np.int64)  # row index, end frame: step-varying, written on the host
    state_dev = cuda.DeviceArray((2, b), np.int64)
    codes_dev, codes_host = cuda.DeviceArray((b, K), np.int32), cuda.PinnedArray((b, K), np.int32)
    embedding_dev = cuda.DeviceArray((b, HIDDEN), np.uint16)
    table = torch.randn(K * V, HIDDEN, device="cuda").bfloat16()
    constants = constants_for("delayed_codebook_step", D, HIDDEN, HQ, HKV)
    aot = compile_kernel("delayed_codebook_step", constants)
    step = PtxKernel(aot.ptx, aot.entry, aot.threads, aot.shared)

    def enqueue():
        cuda.copy_async(logits_dev.ptr, logits_host.ptr, logits_host.nbytes, stream)
        cuda.copy_async(state_dev.ptr, state_host.ptr, state_host.nbytes, stream)
        step(grid("delayed_codebook_step", constants, b), [logits_dev.ptr, state_dev.ptr, state_dev.ptr + 8 * b,
             table.data_ptr()], [], [codes_dev.ptr, embedding_dev.ptr], stream.ptr)
        cuda.copy_async(codes_host.ptr, codes_dev.ptr, codes_dev.nbytes, stream)
        return True

    graph = cuda.Graph(stream, enqueue)
    rng = np.random.default_rng(0)
    for row in range(12):
        logits_host.array[...] = rng.normal(size=(b, K, V)).astype(np.float32)
        state_host.array[0], state_host.array[1] = row, 1 << 40
        graph.launch()
        stream.synchronize()
        want = logits_host.array.argmax(-1)
        want[:, np.arange(K) > row] = 1024
        assert np.array_equal(codes_host.array, want), row


@pytest.mark.parametrize("b, s", [(1, 1), (64, 1), (2, 9)])
def test_decode_attention_plugin_aot_ptx_equals_jit_and_the_reference(b, s):
    """decode_attention's PTX launched with TensorRT's argument order (q, caches, write_pos; S, S_max; out)."""
    from higgs_trt.builder.plugin_ops import decode_attention
    from higgs_trt.plugins import attention
    from higgs_trt.plugins.aot import NUM_WARPS, compile_kernel, constants_for, grid
    from higgs_trt.plugins.launch import PtxKernel

    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(b * 10 + s)
    q = (torch.randn(b, HQ, s, D, device="cuda", generator=g) * D ** -0.5).bfloat16()
    kc, vc = (torch.randn(b, HKV, S_MAX, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    pos = torch.randint(0, S_MAX - s, (b,), device="cuda", generator=g)
    constants = constants_for("decode_attention", D, HIDDEN, HQ, HKV)
    launch = grid("decode_attention", constants, b, s)
    jit = torch.full_like(q, float("nan"))
    attention.decode_attention[launch](q, kc, vc, pos, s, S_MAX, jit, **constants, num_warps=NUM_WARPS["decode_attention"])
    aot = compile_kernel("decode_attention", constants)
    ptx = torch.full_like(q, float("nan"))
    PtxKernel(aot.ptx, aot.entry, aot.threads, aot.shared)(
        launch, [t.data_ptr() for t in (q, kc, vc, pos)], [s, S_MAX], [ptx.data_ptr()])
    torch.cuda.synchronize()
    assert torch.equal(jit, ptx)
    ref = decode_attention(q.float(), kc.float(), vc.float(), pos)
    assert ((jit.float() - ref).abs() <= 0.02 * ref.abs() + 2e-3).all()
