"""`higgs-trt doctor` names what is missing for each mode and how to fix it. On this machine (no GPU, no datacenter
TensorRT) the real probes run; the GPU cases replace the CUDA probes (runtime/cuda.py) with fixed answers."""

from click.testing import CliRunner

from higgs_trt.runtime import cuda
from higgs_trt.runtime.cli import doctor, main


def modes():
    return {name: (ok, needs) for name, ok, needs in doctor.report()[1]}


def test_this_machine():
    r = CliRunner().invoke(main, ["doctor"])
    assert r.exit_code == 0 and "build --target smXX" in r.stdout
    ok, needs = modes()["build for the local GPU (TensorRT 10.15+)"]
    assert not ok and "pip install 'higgs-trt[trt]'" in needs


def fake_gpu(monkeypatch, capability, driver):
    monkeypatch.setattr(cuda, "gpu_problem", lambda: None if driver >= cuda.MIN_DRIVER_CUDA else
                        "the NVIDIA driver supports CUDA 12.4; … need … R580 or newer: update the driver")
    monkeypatch.setattr(cuda, "driver_version", lambda: driver)
    monkeypatch.setattr(doctor, "_gpus", lambda: [("GPU", capability)] if driver >= cuda.MIN_DRIVER_CUDA else [])


def test_an_old_gpu_is_named_for_fp8_and_the_plugin_ptx(monkeypatch):
    fake_gpu(monkeypatch, (7, 5), 13000)
    m = modes()
    assert m["FP8 engines on the local GPU"] == (False, "FP8 needs compute capability 8.9+ (Ada, Hopper or later); "
                                                        "this GPU is 7.5")
    ok, needs = m["--ops plugin plans on the local GPU (PTX sm_80, ISA 8.0)"]
    assert not ok and "compute capability 7.5 cannot run" in needs
    fake_gpu(monkeypatch, (9, 0), 13000)
    m = modes()
    assert m["FP8 engines on the local GPU"][0] and m["--ops plugin plans on the local GPU (PTX sm_80, ISA 8.0)"][0]


def test_an_old_driver_is_named_not_a_missing_gpu(monkeypatch):
    fake_gpu(monkeypatch, (9, 0), 12040)
    ok, needs = modes()["run --backend trt"]
    assert not ok and "R580 or newer" in needs


def test_plugin_ptx_constant_matches_what_export_compiles():
    from higgs_trt.plugins.aot import PTX_VERSION, TARGET

    assert doctor.PLUGIN_PTX == (f"sm_{TARGET[1]}", f"{PTX_VERSION // 10}.{PTX_VERSION % 10}")


def test_the_build_check_without_tensorrt_or_a_checkpoint_is_one_error_line(tiny_ckpt):
    refusals = {"Error: TensorRT (tensorrt) is not usable here": ["--checkpoint", str(tiny_ckpt)],
                "Error: --build-check needs --checkpoint": []}
    for message, args in refusals.items():
        r = CliRunner().invoke(main, ["doctor", "--build-check", *args])
        assert r.exit_code == 1 and r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr
        assert "Traceback" not in r.output
    for args in (["--target", "sm89"], ["--max-seq", "512"]):
        r = CliRunner().invoke(main, ["doctor", *args])
        assert r.exit_code == 1 and r.stderr == "Error: --checkpoint, --target and the limits apply to --build-check\n"


def test_the_build_check_builds_every_lm_variant_with_tensorrt_rtx(tiny_ckpt):
    """What runs here of the check: the export of one decoder layer and TensorRT-RTX's parser and builder for each
    variant; running the plans against ONNX Runtime needs datacenter TensorRT and a GPU."""
    import os

    import pytest

    if os.environ.get("HIGGS_REQUIRE_RTX") != "1":
        pytest.importorskip("tensorrt_rtx_bindings")
    r = CliRunner().invoke(main, ["doctor", "--build-check", "--checkpoint", str(tiny_ckpt), "--target", "sm89",
                                  "--max-seq", "160", "--max-batch", "2", "--max-prompt", "64"])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith(f"build check: one decoder layer of {tiny_ckpt}")
    variants = [line.split(":")[0].strip() for line in lines[1:]]
    assert variants == ["native fused bf16", "native fused fp8", "native matmul bf16", "native matmul fp8",
                        "plugin bf16", "plugin fp8"]
    assert all("for sm89 (TensorRT-RTX plans do not run here)" in line for line in lines[1:])
    assert all(("the text table stays FP8" in line) == line.split(":")[0].endswith("fp8") for line in lines[1:])
