"""FP8: fixed-prompt calibration, Q/DQ graphs, the accuracy gate, and that no request ever changes the scales."""

import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.builder.export import export_engine
from higgs_trt.builder.tiny import write_random_checkpoint
from higgs_trt.builder.torch_backend import bf16_reference
from higgs_trt.calibration.calibrate import _seal, calibrate, load_calibration, quantized_sites, write_calibration
from higgs_trt.runtime.backends.ort import OrtBackend
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.generate import generate, prefill_feeds
from higgs_trt.runtime.manifest import EngineDir
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from higgs_trt.runtime.stepper import HostStepper


def test_calibration_is_byte_identical_when_repeated(tiny_ckpt, tiny_calibration, tmp_path):
    again = tmp_path / "again.json"
    write_calibration(calibrate(bf16_reference(Checkpoint(tiny_ckpt))), again)
    assert again.read_bytes() == tiny_calibration.read_bytes()
    c = json.loads(again.read_text())
    assert set(c["activation_amax"]) == set(quantized_sites(2)) and c["tokens"] > 100
    amax = c["activation_amax"]
    assert amax["body.layers.0.self_attn.q_proj"] == amax["body.layers.0.self_attn.v_proj"]  # one input, one scale
    assert c["prompt_set"]["version"] == 1 and c["statistic"] == "p999"


def reseal(path, edit):
    c = json.loads(path.read_text())
    edit(c)
    c.pop("content_sha256")
    c["content_sha256"] = _seal(c)
    path.write_text(json.dumps(c))


def test_foreign_or_stale_calibration_is_refused(tiny_ckpt, tiny_calibration, tmp_path):
    fingerprint = Checkpoint(tiny_ckpt).fingerprint()
    assert load_calibration(tiny_calibration, fingerprint)["checkpoint"] == fingerprint
    other = Checkpoint(write_random_checkpoint(tmp_path / "other", seed=3)).fingerprint()
    with pytest.raises(HiggsError, match="another checkpoint"):
        load_calibration(tiny_calibration, other)
    old = tmp_path / "old.json"
    old.write_text(tiny_calibration.read_text())
    reseal(old, lambda c: c["prompt_set"].update(version=0))
    with pytest.raises(HiggsError, match="prompt set v0"):
        load_calibration(old, fingerprint)
    edited = tmp_path / "edited.json"
    c = json.loads(tiny_calibration.read_text())
    c["activation_amax"]["body.layers.0.mlp.down_proj"] *= 2
    edited.write_text(json.dumps(c))
    with pytest.raises(HiggsError, match="not an intact calibration"):
        load_calibration(edited, fingerprint)


def test_qdq_only_at_gemm_inputs(tiny_fp8_engine):
    engine = EngineDir(tiny_fp8_engine)
    for key in ("lm_fp8", "lm_fp8_ref", "lm_fp8_bf16ref"):
        graph = onnx.load(engine.file(key), load_external_data=False).graph
        ops = Counter(n.op_type for n in graph.node)
        assert ops["QuantizeLinear"] == 2 * 4  # qkv, o, gate/up, down per layer
        assert ops["DequantizeLinear"] == 2 * 4 + 2 * 7 + 1  # activations, 7 weights per layer, text embedding
        produced = {o: n for n in graph.node for o in n.output}
        for n in graph.node:
            if n.op_type == "QuantizeLinear":
                consumers = {m.op_type for m in graph.node if any(i.startswith(n.output[0]) for i in m.input)}
                assert consumers == {"DequantizeLinear"}
            if n.op_type in ("RotaryEmbedding", "Attention", "TensorScatter"):
                assert all(produced.get(i) is None or produced[i].op_type != "DequantizeLinear" for i in n.input)
        fp8 = [i for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN and i.external_data]
        assert len(fp8) == 2 * 7 + 1
        scales = {i.name: list(i.dims) for i in graph.initializer if i.name.endswith(".weight.scale")}
        assert scales["body.layers.0.mlp.down_proj.weight.scale"] == [64]  # per output channel
        assert scales["tied.embedding.text_embedding.weight.scale"] == [448]  # per row
        assert not any(n.input[0] == "tied.embedding.modality_embeddings.0.embedding.weight.dq" for n in graph.node)


def test_the_bf16_rounding_twin_keeps_the_fp8_graphs_roundings(tiny_fp8_engine, tiny_ckpt):
    """lm.fp8.bf16ref.onnx is lm.fp8.onnx computed in fp32 with each bf16 value rounded where that graph makes it:
    the keys and values it caches are bf16 numbers (the fp32 twin's are not), and it quantizes as the fp32 twin does
    (logits within a cosine of 0.99 of it)."""
    engine = EngineDir(tiny_fp8_engine)
    prompt = build_prompt(HiggsTokenizer(tiny_ckpt / "tokenizer.json"), "Rounded where the engine rounds.")
    logits, caches = {}, {}
    for graph in ("lm_fp8_ref", "lm_fp8_bf16ref"):
        twin = OrtBackend(engine, graph=graph, max_batch=1)
        logits[graph] = twin.lm(prefill_feeds([prompt]), slot=0)[0].ravel()
        caches[graph] = torch.from_numpy(np.concatenate([c[0, :, :len(prompt)].ravel() for c in twin.caches]))
    bf16_numbers = {g: torch.equal(c, c.bfloat16().float()) for g, c in caches.items()}
    assert bf16_numbers == {"lm_fp8_ref": False, "lm_fp8_bf16ref": True}
    a, b = (torch.from_numpy(logits[g]) for g in ("lm_fp8_ref", "lm_fp8_bf16ref"))
    assert 0.99 <= float(torch.nn.functional.cosine_similarity(a, b, dim=0)) < 1.0


def test_the_plugin_op_paths_fp8_twins_compute_what_the_native_ones_do(tiny_ckpt, tiny_calibration, tiny_fp8_engine,
                                                                       tmp_path):
    """The plugin nodes' reference bodies (model-local functions) compute what the native ops do, in both FP8 twins:
    the bf16-rounding one rounds the plugins' outputs as the native graph rounds the ops they replace."""
    from higgs_trt.builder.plugin_ops import PluginOps

    plugin = export_engine(Checkpoint(tiny_ckpt), tmp_path / "p8", max_seq=160, max_batch=4, max_prompt=96, ops=PluginOps,
                           say=lambda m: None, precision="fp8", calibration=tiny_calibration)
    prompt = build_prompt(HiggsTokenizer(tiny_ckpt / "tokenizer.json"), "Plugins or native ops, the same numbers.")
    for graph in ("lm_fp8_ref", "lm_fp8_bf16ref"):
        a, b = (torch.from_numpy(OrtBackend(EngineDir(d), graph=graph, max_batch=1).lm(prefill_feeds([prompt]), 0)[0])
                for d in (plugin, tiny_fp8_engine))
        assert float(torch.nn.functional.cosine_similarity(a.ravel(), b.ravel(), dim=0)) > 0.99999, graph


def test_ort_runs_the_fp8_twin_and_the_gate_is_recorded(tiny_fp8_engine):
    m = EngineDir(tiny_fp8_engine).manifest
    assert m["precision"] == "fp8" and m["calibration"]["file"] == "calibration.json"
    gate = m["fp8_gate"]
    assert gate["cosine_min"] >= gate["cosine_floor"] and gate["top1"] >= gate["top1_floor"]
    assert gate["steps"] > 100 and gate["worst_site"].startswith("body.layers.")


def test_requests_in_any_order_decode_identically(tiny_fp8_engine, tiny_ckpt):
    backend = OrtBackend(EngineDir(tiny_fp8_engine))
    tok = HiggsTokenizer(tiny_ckpt / "tokenizer.json")
    a, b = build_prompt(tok, "First request, with numbers 1 2 3."), build_prompt(tok, "Second!")
    forward = [generate(HostStepper(backend), [p], Sampling())[0].frames for p in (a, b)]
    backward = [generate(HostStepper(backend), [p], Sampling())[0].frames for p in (b, a)][::-1]
    assert all(np.array_equal(x, y) and len(x) for x, y in zip(forward, backward))


def test_gate_refuses_badly_scaled_fp8_with_its_default_floors(tiny_ckpt, tiny_calibration, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(tiny_calibration.read_text())
    reseal(broken, lambda c: c["activation_amax"].update({k: v / 1000 for k, v in c["activation_amax"].items()}))
    out = tmp_path / "e"
    with pytest.raises(HiggsError, match=r"refused by the accuracy gate.*worst site body\.layers\."):
        export_engine(Checkpoint(tiny_ckpt), out, max_seq=96, max_prompt=48, say=lambda m: None, precision="fp8",
                      calibration=broken)
    assert not out.exists() and not list(tmp_path.glob(".e.*"))
