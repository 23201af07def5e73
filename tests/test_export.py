"""Export: ONNX Runtime on the fp32 twin against the torch reference, cache semantics, engine-dir checks."""

import json
from collections import Counter

import numpy as np
import onnx
import pytest

from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.builder.export import export_engine
from higgs_trt.builder.tiny import write_random_checkpoint
from higgs_trt.builder.torch_backend import TorchBackend
from higgs_trt.runtime.backends.ort import OrtBackend
from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.generate import NO_END, generate, prefill_feeds, step_feeds
from higgs_trt.runtime.manifest import EngineDir
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from higgs_trt.runtime.stepper import HostStepper

PROMPTS = ["Hello world.", "It was 3:45 pm, and the temperature was 21.5 degrees!", "Can you call me back?"]


@pytest.fixture(scope="module")
def backends(tiny_ckpt, tiny_engine):
    engine = EngineDir(tiny_engine)
    return OrtBackend(engine), TorchBackend(tiny_ckpt, max_seq=engine.manifest["limits"]["max_seq"], max_batch=4)


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return HiggsTokenizer(tiny_ckpt / "tokenizer.json")


def test_teacher_forced_logits_match_torch_over_40_steps(backends, tok):
    ort, ref = backends
    prompts = [build_prompt(tok, PROMPTS[0]), build_prompt(tok, PROMPTS[1])]  # batch of 2, different lengths
    rng = np.random.default_rng(0)
    worst = 0.0
    outs = [be.lm(prefill_feeds(prompts)) for be in backends]
    lens = np.array([len(p) for p in prompts])
    for step in range(41):
        (la, ca), (lb, cb) = outs
        worst = max(worst, float(np.abs(la - lb).max()))
        assert np.array_equal(ca, cb), step
        forced = rng.integers(0, 1026, size=(2, 8))  # teacher forcing: both sides get the same rows
        feeds = step_feeds(forced, lens + step, step + 1, np.full(2, NO_END))
        outs = [(lg.copy(), c.copy()) for lg, c in (be.lm(feeds) for be in backends)]
    assert worst < 1e-4, worst


@pytest.mark.parametrize("clone", [False, True])
def test_greedy_free_run_matches_torch(backends, tok, clone):
    ref_codes = np.random.default_rng(1).integers(0, 1024, size=(12, 8)).astype(np.int32)
    prompts = [build_prompt(tok, text, ref_codes if clone else None, "A reference." if clone else None) for text in PROMPTS]
    ort_results = generate(HostStepper(backends[0]), prompts, Sampling())
    torch_results = generate(HostStepper(backends[1]), prompts, Sampling())
    for a, b in zip(ort_results, torch_results):
        assert a.stop_reason == b.stop_reason and np.array_equal(a.frames, b.frames) and len(a.frames) > 0
        assert np.abs(a.audio - b.audio).max() < 1e-4


def test_codec_matches_torch(backends):
    codes = np.random.default_rng(2).integers(0, 1024, size=(2, 8, 17)).astype(np.int32)
    a, b = (be.codec(codes) for be in backends)
    assert a.shape == b.shape == (2, 1, 960 * 17) and np.abs(a - b).max() < 1e-4


def test_cache_rows_are_written_once_and_prefix_plus_step_equals_prefill(tiny_engine, tok):
    ort = OrtBackend(EngineDir(tiny_engine), max_batch=1)  # fresh caches: all zero
    p = build_prompt(tok, PROMPTS[1])
    n = len(p)
    ort.lm(prefill_feeds([p]), slot=0)
    before = [c.copy() for c in ort.caches]
    assert all((c[:, :, n:] == 0).all() and (np.abs(c[:, :, :n]).sum(-1) > 0).all() for c in before)
    row = np.random.default_rng(3).integers(0, 1026, size=(1, 8))
    logits_step, _ = ort.lm(step_feeds(row, [n], 1, [NO_END]))
    logits_step = logits_step.copy()
    after = ort.caches
    for b, a in zip(before, after):
        changed = np.flatnonzero(np.abs(a - b).sum(axis=(0, 1, 3)) > 0)
        assert list(changed) == [n]  # exactly the step's own position

    # the same row appended to the prompt and prefilled in one call gives the same logits
    full = prefill_feeds([p])
    full = {k: np.concatenate([v, v[:, -1:]], axis=1) if v.ndim > 1 else v for k, v in full.items()}
    full["audio_codes"][0, -1], full["is_audio"][0, -1], full["new_len"][:] = row[0], True, n + 1
    full["row_index"][:] = 1
    logits_full, _ = ort.lm(full)
    assert np.abs(logits_full - logits_step).max() < 1e-5


def test_graphs_and_manifest(tiny_engine, tiny_ckpt):
    engine = EngineDir(tiny_engine)
    m = engine.manifest
    assert m["checkpoint"]["fingerprint"] == Checkpoint(tiny_ckpt).fingerprint()
    assert m["precision"] == "bf16" and m["ops"] == "native" and m["limits"]["max_seq"] == 160
    lm = onnx.load(engine.file("lm"), load_external_data=False)
    ops = Counter(n.op_type for n in lm.graph.node)
    assert ops["RotaryEmbedding"] == 2 * 2 and ops["TensorScatter"] == 2 * 2 and ops["Attention"] == 2
    assert max(o.version for o in lm.opset_import if o.domain == "") == 24
    io = {t["name"]: t for t in m["graphs"]["lm"]["inputs"] + m["graphs"]["lm"]["outputs"]}
    assert io["past_key_0"]["dtype"] == "bfloat16" and io["past_key_0"]["shape"] == ["batch", 2, 160, 16]
    assert io["present_key_0"]["shape"] == io["past_key_0"]["shape"]
    assert io["logits"]["shape"] == ["batch", 8, 1026] and io["codes"]["dtype"] == "int32"
    assert m["graphs"]["lm_ref"]["inputs"][7]["dtype"] == "float32"
    assert m["graphs"]["codec"]["outputs"][0]["shape"][2] != 0


def external(path):
    model = onnx.load(path, load_external_data=False)
    return {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer if t.external_data}


def test_weights_are_stored_once_and_shared(tiny_engine, tiny_ckpt):
    bf16, twin = external(tiny_engine / "lm.onnx"), external(tiny_engine / "lm.ref.onnx")
    ckpt = Checkpoint(tiny_ckpt)
    name = "body.layers.0.self_attn.q_proj.weight"
    assert bf16[name] == twin[name] and bf16[name]["location"] == "weights.bin"
    assert int(bf16[name]["length"]) == 64 * 64 * 2
    raw = (tiny_engine / "weights.bin").read_bytes()
    offset = int(bf16[name]["offset"])
    assert raw[offset:offset + 64 * 64 * 2] == ckpt.raw_bytes(name)
    lm_bytes = sum(np.prod(ckpt.shape(n)) * 2 for n in bf16 if n in ckpt)
    assert len(raw) < 1.2 * lm_bytes + 2 * (tiny_engine / "codec.onnx").stat().st_size + 4 * 1024 * 1024


def test_engine_from_another_checkpoint_is_refused(tiny_engine, tmp_path):
    other = write_random_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(HiggsError, match="built from another checkpoint"):
        EngineDir(tiny_engine).check_checkpoint(Checkpoint(other).fingerprint(), other)


def test_hand_edited_manifest_is_refused(engine_copy):
    path = engine_copy / "manifest.json"
    m = json.loads(path.read_text())
    m["limits"]["max_seq"] = 4096
    path.write_text(json.dumps(m))
    with pytest.raises(HiggsError, match="edited by hand"):
        EngineDir(engine_copy)


def test_swapped_or_missing_files_are_refused(engine_copy, tiny_fp8_engine, tmp_path):
    (engine_copy / "weights.bin").write_bytes((tiny_fp8_engine / "weights.bin").read_bytes())  # another export's
    with pytest.raises(HiggsError, match="weights.bin does not match the manifest"):
        EngineDir(engine_copy)
    (engine_copy / "weights.bin").unlink()
    with pytest.raises(HiggsError, match="weights.bin is missing"):
        EngineDir(engine_copy)
    with pytest.raises(HiggsError, match="not an engine directory"):
        EngineDir(tmp_path)


def test_export_replaces_atomically_and_leaves_nothing_on_failure(tiny_ckpt, tmp_path):
    out = tmp_path / "e"
    bad = write_random_checkpoint(tmp_path / "bad", seed=0)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(HiggsError, match="tokenizer.json not found"):
        export_engine(Checkpoint(bad), out, max_seq=64, max_prompt=32, say=lambda m: None)
    assert not out.exists() and not list(tmp_path.glob(".e.*"))


def test_the_matmul_attention_graph_computes_what_the_attention_op_does(tiny_matmul_lm, tiny_engine, tok):
    """--attention matmul: MatMul + Softmax in place of ONNX Attention, the same numbers (fp32 twins, ONNX Runtime),
    step after teacher-forced step."""
    import onnxruntime

    from higgs_trt.builder.compare import teacher_forced

    ops = Counter(n.op_type for n in onnx.load(tiny_matmul_lm["lm"]["file"], load_external_data=False).graph.node)
    assert not ops["Attention"] and ops["Softmax"] == 2 and ops["MatMul"] == 2 * 2 and ops["TensorScatter"] == 2 * 2
    onnxruntime.set_default_logger_severity(3)  # TensorScatter warns on every call that it copies the cache
    fused, matmul = (onnxruntime.InferenceSession(str(f), providers=["CPUExecutionProvider"])
                     for f in (tiny_engine / "lm.ref.onnx", tiny_matmul_lm["lm_ref"]["file"]))
    names = [o.name for o in fused.get_outputs()]

    def run(session, feed):
        return dict(zip(names, session.run(None, feed)))

    caches = {t.name: np.zeros((1, *t.shape[1:]), np.float32) for t in fused.get_inputs() if t.name.startswith("past_")}
    feeds = teacher_forced(lambda f: run(fused, f), build_prompt(tok, PROMPTS[1]), 8, 160, caches)
    for feed in feeds:
        want, got = run(fused, feed), run(matmul, feed)
        assert np.array_equal(want["codes"], got["codes"])
        assert max(float(np.abs(want[n] - got[n]).max()) for n in names if n != "codes") < 1e-4
