"""TensorRT builds in CI: TensorRT-RTX parses our graphs and builds real plans for SM89 on a CPU-only machine."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from conftest import LM_VARIANTS

from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.builder.tiny import write_random_checkpoint
from higgs_trt.builder.trt_build import build, build_plan, lm_ranges, profiles_for, text_table_stays_fp8
from higgs_trt.runtime.cli import main
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.manifest import EngineDir

if os.environ.get("HIGGS_REQUIRE_RTX") != "1":  # CI sets it, so a broken install fails instead of skipping
    pytest.importorskip("tensorrt_rtx_bindings")

LIMITS = {"max_seq": 160, "max_batch": 4, "max_prompt": 96}  # those of the tiny_engine fixture: its ONNX is reused
NATIVE_LAYERS = {"ROTARY_EMBEDDING", "KV_CACHE_UPDATE", "ATTENTION_INPUT", "ATTENTION_OUTPUT", "TOPK"}


@pytest.fixture(scope="module")
def built(tiny_ckpt, tiny_engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "engine"
    shutil.copytree(tiny_engine, out)
    messages = []
    build(Checkpoint(tiny_ckpt), out, "bf16", "sm89", False, LIMITS, messages.append)
    return out, messages


def test_native_layers_are_in_the_built_network(built):
    out, messages = built
    assert any("reusing the ONNX graphs" in m for m in messages)  # the export was not repeated
    m = EngineDir(out).manifest
    layers = m["engines"]["lm"]["layers"]
    assert NATIVE_LAYERS <= set(layers), layers
    assert layers["ROTARY_EMBEDDING"] == 4 and layers["KV_CACHE_UPDATE"] == 4  # q,k per layer; k,v per layer
    assert "DECONVOLUTION" in m["engines"]["codec"]["layers"]
    encoder = m["engines"]["codec_encoder"]["layers"]  # DAC + HuBERT convs, attention written out, ArgMax as TopK
    assert {"CONVOLUTION", "MATRIX_MULTIPLY", "SOFTMAX", "NORMALIZATION", "TOPK"} <= set(encoder), encoder
    assert encoder["CONVOLUTION"] == 56 and encoder["TOPK"] == 8


def test_plans_and_manifest(built):
    out, _ = built
    m = EngineDir(out).manifest
    assert m["build"]["builder"] == "tensorrt-rtx" and m["build"]["target"] == "sm89" and m["build"]["version"]
    assert m["precision"] == "bf16"
    for key in ("lm", "codec", "codec_encoder"):
        plan = out / m["engines"][key]["file"]
        assert plan.stat().st_size > 1 << 20 and len(set(plan.read_bytes()[:4096])) > 16
        assert m["files"][plan.name]["bytes"] == plan.stat().st_size
    prefill, decode = m["engines"]["lm"]["profiles"]  # in profile-index order
    assert (prefill["name"], decode["name"]) == ("prefill", "decode")
    assert prefill["shapes"]["input_ids"] == [[1, 1], [1, 64], [4, 96]]
    assert decode["shapes"]["audio_codes"] == [[1, 1, 8], [1, 1, 8], [4, 1, 8]]
    assert decode["shapes"]["past_key_0"][2] == [4, 2, 160, 16]  # static S_max cache
    # the codec decodes streaming windows: 1..max_batch of them, 1..CODEC_MAX_FRAMES frames, tuned for 10 + 25 + 10
    assert m["engines"]["codec"]["profiles"][0]["shapes"]["codes"] == [[1, 8, 1], [1, 8, 45], [4, 8, 128]]
    (encode,) = m["engines"]["codec_encoder"]["profiles"]  # 1..30 s references, 10 s optimal; 24 kHz + hop/2 pads
    assert encode["shapes"] == {"audio_24k": [[1, 1, 24000], [1, 1, 240000], [1, 1, 720960]],
                                "audio_16k": [[1, 1, 16000], [1, 1, 160000], [1, 1, 480000]]}


def test_trt_backend_refusals_on_this_machine(built, tiny_engine):
    from higgs_trt.runtime.backends.trt import TrtBackend

    with pytest.raises(HiggsError, match="no TensorRT engines"):
        TrtBackend(EngineDir(tiny_engine))
    with pytest.raises(HiggsError, match="needs an NVIDIA GPU"):  # RTX plans need TensorRT-RTX and a GPU
        TrtBackend(EngineDir(built[0]))


def test_corrupted_plan_is_refused(built, tmp_path):
    out = shutil.copytree(built[0], tmp_path / "e")
    plan = out / "lm.plan"
    data = bytearray(plan.read_bytes())
    data[len(data) // 2] ^= 0xFF
    plan.write_bytes(bytes(data))
    with pytest.raises(HiggsError, match="lm.plan does not match the manifest"):
        EngineDir(out)


def test_bad_build_requests(tiny_ckpt, tmp_path):
    with pytest.raises(HiggsError, match="unknown target 'sm90'"):
        build(Checkpoint(tiny_ckpt), tmp_path / "e", "bf16", "sm90", False, LIMITS, print)
    assert not (tmp_path / "e").exists()  # refused before any export
    r = CliRunner().invoke(main, ["build", "--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "e"),
                                  "--target", "sm89", "--lean"])
    assert r.exit_code == 1 and "tensorrt_lean" in r.stderr


def test_a_build_for_another_checkpoint_re_exports(built, tmp_path):
    other = write_random_checkpoint(tmp_path / "other", seed=1)
    out = shutil.copytree(built[0], tmp_path / "e")
    before = EngineDir(out).fingerprint
    messages = []
    build(Checkpoint(other), out, "bf16", "sm89", False, LIMITS, messages.append)
    assert any(m.startswith("exporting") for m in messages)
    assert EngineDir(out).fingerprint != before
    assert json.loads((out / "manifest.json").read_text())["engines"]["lm"]["file"] == "lm.plan"


def test_a_recipe_fills_what_the_command_does_not_give(tiny_ckpt, built, tmp_path):
    """rtx-sm89-ci: max_seq 512, max_batch 4, max_prompt 256, target sm89. The flags given win over it."""
    out = shutil.copytree(built[0], tmp_path / "e")
    r = CliRunner().invoke(main, ["build", "--checkpoint", str(tiny_ckpt), "--out", str(out), "--recipe", "rtx-sm89-ci",
                                  "--max-seq", "160", "--max-prompt", "96"])
    assert r.exit_code == 0, r.stderr
    m = EngineDir(out).manifest
    assert m["build"]["target"] == "sm89" and m["precision"] == "bf16"
    assert m["engines"]["lm"]["profiles"][1]["shapes"]["past_key_0"][2] == [4, 2, 160, 16]  # batch 4 from the recipe
    assert m["engines"]["lm"]["profiles"][0]["shapes"]["input_ids"][2] == [4, 96]
    r = CliRunner().invoke(main, ["build", "--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "f"),
                                  "--recipe", "h100"])
    assert r.exit_code == 1 and "no recipe 'h100'; known: h200-bf16, h200-fp8, rtx-sm89-ci, tiny" in r.stderr
    assert not (tmp_path / "f").exists()


def _state(directory):
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in directory.iterdir()}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_a_rebuild_stopped_while_building_plans_leaves_the_old_engine(tiny_ckpt, built, tmp_path, sig):
    """The plans are built in a staging copy: Ctrl-C (raised inside TensorRT's build, which must not swallow it and
    exit 0) ends the command with exit 1, and a kill leaves litter the next build removes; the old engine stays whole
    either way."""
    target = shutil.copytree(built[0], tmp_path / "engine")
    before = _state(target)
    args = ["build", "--checkpoint", tiny_ckpt, "--out", target, "--target", "sm89", "--max-seq", 160,
            "--max-batch", 4, "--max-prompt", 96]
    child = subprocess.Popen([sys.executable, "-m", "higgs_trt.runtime.cli", *map(str, args)], text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in child.stderr:  # reusing the graphs, then "building lm.plan …": TensorRT is at work
        lines.append(line)
        if "building lm.plan" in line:
            break
    time.sleep(1)
    child.send_signal(sig)
    lines += child.stderr.readlines()
    child.wait()
    assert _state(target) == before, "".join(lines)  # not a file of the old engine touched
    EngineDir(target)
    litter = [p.name for p in tmp_path.iterdir() if p.name != "engine"]
    if sig == signal.SIGINT:
        assert child.returncode == 1 and lines[-1] == "Aborted!\n" and litter == [], "".join(lines)
    else:
        assert len(litter) == 1 and litter[0].startswith(".engine.higgs-trt-staging.")
        messages = []
        build(Checkpoint(tiny_ckpt), target, "bf16", "sm89", False, LIMITS, messages.append)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
        assert _state(target).keys() == before.keys() and EngineDir(target).manifest["build"]["target"] == "sm89"


def test_fp8_engines_build_with_fp8_layers(tiny_ckpt, tiny_fp8_engine, tiny_calibration, tmp_path):
    out = shutil.copytree(tiny_fp8_engine, tmp_path / "fp8")
    messages = []
    build(Checkpoint(tiny_ckpt), out, "fp8", "sm89", False, LIMITS, messages.append, calibration=tiny_calibration)
    assert any("reusing the ONNX graphs" in m for m in messages)
    m = EngineDir(out).manifest
    lm = m["engines"]["lm"]
    assert lm["graph"] == "lm_fp8" and m["precision"] == "fp8"
    assert lm["layers"]["QUANTIZE"] == 2 * 4 and lm["layers"]["DEQUANTIZE"] == 2 * 4 + 2 * 7 + 1
    assert NATIVE_LAYERS <= set(lm["layers"])
    assert (out / "lm.plan").stat().st_size > 1 << 20 and (out / "codec.plan").stat().st_size > 1 << 20


def test_plugin_path_builds_with_plugin_layers(tiny_ckpt, tiny_plugin_engine, tmp_path):
    pytest.importorskip("triton")
    out = shutil.copytree(tiny_plugin_engine, tmp_path / "plugin")
    messages = []
    build(Checkpoint(tiny_ckpt), out, "bf16", "sm89", False, LIMITS, messages.append, ops="plugin")
    assert any("reusing the ONNX graphs" in m for m in messages)
    m = EngineDir(out).manifest
    layers = m["engines"]["lm"]["layers"]
    assert layers["PLUGIN_V3"] == 2 * 2 + 1  # rope_kv_write and decode_attention per layer, one delayed_codebook_step
    assert not {"ROTARY_EMBEDDING", "KV_CACHE_UPDATE", "TOPK", "ATTENTION_INPUT", "ATTENTION_OUTPUT"} & set(layers)
    assert m["build"]["plugins"].startswith("build-only") and not list(out.glob(".*for-tensorrt.onnx"))
    from higgs_trt.runtime.backends.trt import TrtBackend

    with pytest.raises(HiggsError, match="build-only twins"):
        TrtBackend(EngineDir(out))


def test_a_local_gpu_build_here_is_one_error_line_before_any_export(tiny_ckpt, tmp_path):
    for ops in ("native", "plugin"):
        r = CliRunner().invoke(main, ["build", "--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / ops),
                                      "--ops", ops])
        assert r.exit_code == 1 and r.stderr.startswith("Error: TensorRT (tensorrt) is not usable here")
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.output + r.stderr
        assert not (tmp_path / ops).exists()


def test_datacenter_tensorrt_older_than_10_15_is_named():
    from types import SimpleNamespace

    from higgs_trt.runtime.trt_shim import version_problem

    assert version_problem(SimpleNamespace(__version__="10.15.1.29")) is None
    assert version_problem(SimpleNamespace(__version__="11.4.0.106")) is None
    assert "TensorRT 10.14.1 is too old: the graphs need 10.15+" in version_problem(SimpleNamespace(__version__="10.14.1"))


@pytest.mark.parametrize("variant", LM_VARIANTS, ids=lambda v: "-".join(v))
def test_every_lm_variant_export_can_produce_builds(lm_variants, variant):
    """op path × attention × precision, each lm graph built by TensorRT-RTX's real parser and builder for SM89."""
    import tensorrt_rtx_bindings as trt

    from higgs_trt.builder.trt_build import _without_plugin_functions
    from higgs_trt.plugins import rtx_build

    ops, attention, precision = variant
    graph = lm_variants[variant]
    registered = rtx_build.register(trt) if ops == "plugin" else None
    path = _without_plugin_functions(graph["file"]) if ops == "plugin" else graph["file"]
    try:
        plan = build_plan(trt, path, profiles_for(graph["io"], lm_ranges(LIMITS)), "sm89", False, None,
                          layer_info=precision == "fp8")
    finally:
        if path != graph["file"]:
            path.unlink()
    del registered
    layers = plan.layers
    assert len(plan.data) > 1 << 20
    if ops == "plugin":  # rope_kv_write and decode_attention per layer, one delayed_codebook_step
        assert layers["PLUGIN_V3"] == 2 * 2 + 1 and not {"KV_CACHE_UPDATE", "ATTENTION_OUTPUT"} & set(layers)
    elif attention == "fused":
        assert layers["ATTENTION_OUTPUT"] == 2 and layers["KV_CACHE_UPDATE"] == 4
    else:  # q·kᵀ and p·v per layer as matrix multiplies, the cache still updated in place by the KV-cache layer
        assert "ATTENTION_OUTPUT" not in layers and layers["SOFTMAX"] == 2 and layers["KV_CACHE_UPDATE"] == 4
    if precision == "fp8":
        assert layers["QUANTIZE"] == 2 * 4
        # the FP8 text-embedding table stays FP8 in the plan: one kernel gathers the prompt's rows from it
        assert text_table_stays_fp8(plan.layer_info), plan.layer_info[:2000]


def test_lean_and_attention_refusals_are_one_error_line_before_any_work(tiny_ckpt, tmp_path):
    refusals = {"--lean with --ops plugin: version-compatible plans take plugins only from plugin libraries":
                ["--ops", "plugin", "--lean"],
                "--attention matmul applies to --ops native": ["--ops", "plugin", "--attention", "matmul"]}
    for message, args in refusals.items():
        r = CliRunner().invoke(main, ["build", "--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "e"), *args])
        assert r.exit_code == 1 and r.stderr.startswith(f"Error: {message}") and r.stderr.count("\n") == 1, r.stderr
        assert not (tmp_path / "e").exists()
    r = CliRunner().invoke(main, ["export", "--checkpoint", str(tiny_ckpt), "--out", str(tmp_path / "x"),
                                  "--ops", "plugin", "--attention", "matmul"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "applies to --ops native" in r.stderr
