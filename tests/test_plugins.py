"""The plugin op path on CPU: ONNX Runtime runs the plugin-path graphs through their reference functions, the
Triton kernels compute the same thing (Triton's interpreter), and their AOT PTX is what the manifest records."""

import hashlib
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from interpreted import run_interpreted

from higgs_trt.builder.plugin_ops import PluginOps
from higgs_trt.builder.torch_backend import TorchBackend
from higgs_trt.plugins.schemas import strip_functions
from higgs_trt.runtime.backends.ort import OrtBackend
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.generate import NO_END, generate, prefill_feeds, step_feeds
from higgs_trt.runtime.manifest import EngineDir
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from higgs_trt.runtime.stepper import HostStepper

pytest.importorskip("triton")


def test_plugin_nodes_and_functions(tiny_plugin_engine):
    model = onnx.load(tiny_plugin_engine / "lm.onnx", load_external_data=False)
    nodes = [n for n in model.graph.node if n.domain == "higgs"]
    assert Counter(n.op_type for n in nodes) == {"rope_kv_write": 2, "decode_attention": 2, "delayed_codebook_step": 1}
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs == {"plugin_namespace": b"higgs", "plugin_version": b"1", "aot": 1}
    ops = Counter(n.op_type for n in model.graph.node)
    assert not ops["RotaryEmbedding"] and not ops["TensorScatter"] and not ops["ArgMax"]
    assert not ops["Attention"]  # decode_attention reads each row's prefix, not all S_max cache rows
    assert {f.name for f in model.functions} == {"rope_kv_write", "delayed_codebook_step", "decode_attention"}
    stripped = strip_functions(model)
    assert not stripped.functions
    with pytest.raises(Exception, match="higgs"):  # without its functions only TensorRT (with the plugins) can run it
        ort.InferenceSession(stripped.SerializeToString())


def test_ort_plugin_path_matches_native_path_and_torch(tiny_plugin_engine, tiny_engine, tiny_ckpt):
    plugin, native = OrtBackend(EngineDir(tiny_plugin_engine)), OrtBackend(EngineDir(tiny_engine))
    torch_plugin = TorchBackend(tiny_ckpt, max_seq=160, max_batch=4)
    torch_plugin.model.ops = PluginOps  # the torch model on the plugin path: the custom ops' eager bodies
    tok = HiggsTokenizer(tiny_ckpt / "tokenizer.json")
    prompt = build_prompt(tok, "Plugins or not, the same numbers.")
    rng = np.random.default_rng(4)
    backends = (plugin, native, torch_plugin)
    outs = [be.lm(prefill_feeds([prompt])) for be in backends]
    worst = 0.0
    for step in range(33):
        (lp, cp), (ln, cn), (lt, ct) = outs
        worst = max(worst, float(np.abs(lp - ln).max()), float(np.abs(lp - lt).max()))
        assert np.array_equal(cp, cn) and np.array_equal(cp, ct), step
        forced = rng.integers(0, 1026, size=(1, 8))
        feeds = step_feeds(forced, [len(prompt) + step], step + 1, [NO_END])
        outs = [(lo.copy(), co.copy()) for lo, co in (be.lm(feeds) for be in backends)]
    assert worst < 1e-4, worst
    prompts = [build_prompt(tok, t) for t in ("Hello world.", "Numbers: 1, 2, 3!")]
    for a, b in zip(generate(HostStepper(plugin), prompts, Sampling()), generate(HostStepper(native), prompts, Sampling())):
        assert np.array_equal(a.frames, b.frames) and a.stop_reason == b.stop_reason


def test_manifest_records_the_plugins_and_their_ptx(tiny_plugin_engine):
    m = EngineDir(tiny_plugin_engine).manifest
    assert m["ops"] == "plugin" and set(m["plugins"]) == {"rope_kv_write", "delayed_codebook_step", "decode_attention"}
    for op, info in m["plugins"].items():
        ptx = (tiny_plugin_engine / info["file"]).read_text()
        assert info["ptx_sha256"] == hashlib.sha256(ptx.encode()).hexdigest()
        assert (info["target"], info["ptx_version"]) == ("sm_80", "8.0")  # plugins/aot.py TARGET, PTX_VERSION
        entry = ptx[ptx.index(f".entry {info['entry']}("):]
        params = entry[: entry.index(")")].count(".param")
        assert params == {"rope_kv_write": 13, "delayed_codebook_step": 6, "decode_attention": 7}[op]  # TRT's args
    assert m["plugins"]["rope_kv_write"]["constants"] == {"Q_HEADS": 4, "KV_HEADS": 2, "HALF": 8}


KERNEL_CHECK = r"""
import numpy as np, torch
from higgs_trt.plugins import codebook, rope
from higgs_trt.runtime import sampling as reference
from higgs_trt.builder.plugin_ops import rope_kv_write, delayed_codebook_step
from higgs_trt.plugins.rope_table import rope_table
from higgs_trt.runtime.config import HiggsConfig
torch.manual_seed(0)
B, Hq, Hkv, S, D, SM = 2, 4, 2, 3, 16, 32
cfg = HiggsConfig(64, 1, Hq, Hkv, D, 128, 100, 1e-6, 1e6, 32768)
cos, sin = rope_table(cfg, SM, torch.bfloat16)
q, k, v = (torch.randn(B, h, S, D).bfloat16() for h in (Hq, Hkv, Hkv))
wp = torch.tensor([0, SM - S])
kc, vc = torch.randn(B, Hkv, SM, D).bfloat16(), torch.randn(B, Hkv, SM, D).bfloat16()
# the kernel rotates in fp32 and rounds once: within one bf16 ulp of the fp32 rotation of the same bf16 inputs
# (not half: its fp32 arithmetic may contract to FMAs and land on the other side of a rounding boundary)
ref = rope_kv_write(*(t.float() for t in (q, k, v, cos, sin)), wp, kc.float(), vc.float())
qo, kc2, vc2 = torch.empty_like(q), kc.clone(), vc.clone()
rope.rope_kv_write[(B * S,)](q, k, v, cos, sin, wp, kc2, vc2, S, SM, qo, kc2, vc2, Q_HEADS=Hq, KV_HEADS=Hkv, HALF=D // 2)
ulp = lambda x: x.abs().clamp(min=2 ** -20) * 2 ** -7
assert ((qo.float() - ref[0]).abs() <= ulp(ref[0])).all()
assert ((kc2.float() - ref[1]).abs() <= ulp(ref[1])).all() and torch.equal(vc2.float(), ref[2])
# rows at or past the end of the cache are dropped (as TensorRT's KV-cache layer does), the rest written
kc3, vc3 = kc.clone(), vc.clone()
rope.rope_kv_write[(B * S,)](q, k, v, cos, sin, torch.tensor([0, SM - 1]), kc3, vc3, S, SM, qo, kc3, vc3,
                                Q_HEADS=Hq, KV_HEADS=Hkv, HALF=D // 2)
assert torch.equal(vc3[1, :, SM - 1], v[1, :, 0]) and torch.equal(vc3[1, :, :SM - 1], vc[1, :, :SM - 1])
V, K, H = 1026, 8, 64
logits = torch.randn(B, K, V) * 3
logits[0, 2, 5] = logits[0, 2, 7] = 100.0  # a tie: the lower index wins
row, end, table = torch.tensor([3, 20]), torch.tensor([1 << 40, 15]), torch.randn(K * V, H).bfloat16()
rc, re = delayed_codebook_step(logits, row, end, table)
codes, emb = torch.empty(B, K, dtype=torch.int32), torch.empty(B, H, dtype=torch.bfloat16)
codebook.delayed_codebook_step[(B, 2)](logits, row, end, table, codes, emb, K=K, VOCAB=V, HIDDEN=H, BLOCK_V=2048, BLOCK_H=32)
assert torch.equal(codes, rc) and codes[0, 2] == 5 and codes[0, 4] == 1024 and codes[1, 0] == 1025
exact = table.float()[(rc.long() + torch.arange(K) * V)].sum(1)  # fp32 sum, rounded once by the kernel
assert ((emb.float() - exact).abs() <= ulp(exact)).all()
temp = torch.tensor([0.0, 1.0]); topk = torch.tensor([0, 50], dtype=torch.int32); topp = torch.tensor([1.0, 0.9])
seed = torch.tensor([7, 8]); row = torch.tensor([30, 30]); end = torch.tensor([1 << 40, 1 << 40])
end_next = torch.empty(B, dtype=torch.int64)
codebook.delayed_codebook_sample[(B, 2)](logits, row, end, table, temp, topk, topp, seed, codes, emb, end_next, K=K,
                                      VOCAB=V, HIDDEN=H, BLOCK_V=2048, BLOCK_H=32)
want = [[reference.sample(logits[b, k].numpy(), float(temp[b]), int(topk[b]), float(topp[b]),
                          reference.uniform(int(seed[b]), 30, k)) if temp[b] > 0 else int(logits[b, k].argmax())
         for k in range(K)] for b in range(B)]
assert codes.tolist() == want, (codes.tolist(), want)
"""


def test_kernels_compute_the_reference_semantics_in_tritons_interpreter():
    run_interpreted(KERNEL_CHECK)
