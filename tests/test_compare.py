"""higgs-trt compare: Polygraphy's Comparator over torch and ONNX Runtime, and replay with Polygraphy's own CLI."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from higgs_trt.builder.tiny import write_random_checkpoint
from higgs_trt.runtime.cli import main
from higgs_trt.runtime.manifest import EngineDir, write_manifest

pytest.importorskip("polygraphy")
PROMPTS = [{"text": "Hello world."}, {"text": "A clone.", "ref_codes": [[i * 8 + k for k in range(8)] for i in range(6)]}]


def run_compare(engine, *args, prompts=PROMPTS, tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    return CliRunner().invoke(main, ["compare", "--engine", str(engine), "--prompts", str(path), *map(str, args)])


def test_bf16_twin_matches_torch_and_saves_polygraphy_files(tiny_engine, tiny_ckpt, tmp_path):
    save = tmp_path / "saved"
    r = run_compare(tiny_engine, "--checkpoint", tiny_ckpt, "--steps", 12, "--save", save, tmp_path=tmp_path)
    assert r.exit_code == 0, r.output + r.stderr
    assert "skipping trt" in r.stderr  # no TensorRT here: said, not hidden
    assert "PASSED" in r.stdout and "ort vs torch   logits" in r.stdout
    report = json.loads((save / "report.json").read_text())
    assert report["passed"] and report["runners"] == ["torch", "ort"] and report["feeds"] == 2 * 13
    logits = [o for o in report["outputs"] if o["output"] == "logits"]
    assert len(logits) == 26 and max(o["max_abs"] for o in logits) < 1e-4
    # Polygraphy's own CLI replays the saved inputs on the reference twin against the saved outputs
    polygraphy = Path(sys.executable).with_name("polygraphy")
    cli = subprocess.run([str(polygraphy), "run", str(tiny_engine / "lm.ref.onnx"), "--onnxrt",
                          "--load-inputs", str(save / "inputs.json"), "--load-outputs", str(save / "outputs.json"),
                          "--atol", "1e-4", "--rtol", "1e-4"], capture_output=True, text=True)
    assert cli.returncode == 0 and "PASSED" in cli.stdout + cli.stderr, cli.stdout[-2000:] + cli.stderr[-2000:]


def test_fp8_twin_passes_with_fp8_tolerances(tiny_fp8_engine, tiny_ckpt, tmp_path):
    r = run_compare(tiny_fp8_engine, "--checkpoint", tiny_ckpt, "--steps", 12, "--save", tmp_path / "s", tmp_path=tmp_path)
    assert r.exit_code == 0, r.output + r.stderr
    report = json.loads((tmp_path / "s" / "report.json").read_text())
    logits = [o for o in report["outputs"] if o["output"] == "logits"]
    assert all(o["tolerance"] == "fp8" for o in logits)
    assert 1e-3 < max(o["max_abs"] for o in logits)  # quantization shows, within the FP8 tolerance
    assert min(o["cosine"] for o in logits) > 0.99


def test_a_perturbed_weight_fails_and_names_the_output(tiny_engine, tiny_ckpt, tmp_path):
    engine = shutil.copytree(tiny_engine, tmp_path / "e")
    name = "body.layers.1.mlp.down_proj.weight"
    info = next({e.key: e.value for e in t.external_data} for t in onnx.load(engine / "lm.ref.onnx",
                load_external_data=False).graph.initializer if t.name == name)
    data = bytearray((engine / "weights.bin").read_bytes())
    at = int(info["offset"]) + 2 * 17  # one bf16 element of that weight
    value = np.frombuffer(bytes(data[at:at + 2]) + b"", dtype=np.uint16).astype(np.uint32) << 16
    data[at:at + 2] = ((value.view(np.float32) + np.float32(0.5)).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    (engine / "weights.bin").write_bytes(bytes(data))
    # reseal, as a buggy export would have: the manifest cannot catch it, the comparison must
    manifest = json.loads((engine / "manifest.json").read_text())
    write_manifest(engine, manifest, list(manifest["files"]))
    r = run_compare(engine, "--checkpoint", tiny_ckpt, "--steps", 4, "--runners", "torch,ort", "--per-layer",
                    tmp_path=tmp_path)
    assert r.exit_code == 1
    assert "FAILED" in r.stdout and "ort vs torch: logits" in r.stdout
    assert "present_key_0" not in r.stdout.split("FAILED")[-1]  # layer 0 is untouched: its cache still matches
    # per-layer mode names the first tensor that differs, and the weight behind it
    first = r.stdout.split("first to differ: ")[1]
    assert "(body.layers.1.mlp.down_proj.weight)" in first.splitlines()[0], r.stdout
    EngineDir(engine)  # the resealed directory itself is accepted


def test_refusals(tiny_engine, tmp_path):
    r = run_compare(tiny_engine, "--runners", "torch,ort", tmp_path=tmp_path)
    assert r.exit_code == 1 and "the torch runner needs --checkpoint" in r.stderr
    other = write_random_checkpoint(tmp_path / "other", seed=5)
    r = run_compare(tiny_engine, "--checkpoint", other, tmp_path=tmp_path)
    assert r.exit_code == 1 and "built from another checkpoint" in r.stderr
    r = run_compare(tiny_engine, "--runners", "ort", tmp_path=tmp_path)
    assert r.exit_code == 1 and "at least two runners" in r.stderr
