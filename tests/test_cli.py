"""The main job end to end through the console script, and bad inputs: one line, exit ≠ 0, no partial files."""

import json
import re
import subprocess
import sys
import wave

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from higgs_trt.runtime.cli import main


def higgs(*args):
    """The real console entry point in a subprocess: exit code and stderr exactly as a user sees them."""
    return subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", *map(str, args)], capture_output=True, text=True)


def higgs_in_process(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_tiny_checkpoint_then_torch_run_writes_a_wav(tiny_ckpt, tmp_path):
    out, codes = tmp_path / "out.wav", tmp_path / "codes.npy"
    r = higgs("run", "--checkpoint", tiny_ckpt, "--backend", "torch", "--text", "Hello world.", "--out", out,
              "--codes-out", codes, "--temperature", "0")
    assert r.returncode == 0, r.stderr
    frames = np.load(codes)
    assert frames.ndim == 2 and frames.shape[1] == 8 and len(frames) > 0
    assert frames.min() >= 0 and frames.max() <= 1023
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.getnframes() == 960 * len(frames)
    assert not list(tmp_path.glob(".*higgs-trt-*"))


def test_seeded_sampling_is_reproducible(tiny_ckpt, tmp_path):
    runs = [higgs_in_process("run", "--checkpoint", tiny_ckpt, "--text", "Numbers 1 2 3.", "--out", tmp_path / f"{i}.wav",
                             "--codes-out", tmp_path / f"{i}.npy", "--seed", seed, "--temperature", "1.0", "--top-k", "50")
            for i, seed in enumerate([7, 7, 8])]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    a, b, c = (np.load(tmp_path / f"{i}.npy") for i in range(3))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def bad(tmp_path, *args, message):
    out = tmp_path / "out.wav"
    r = higgs_in_process("run", "--text", "Hello.", "--out", out, *args)
    assert r.exit_code != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".*higgs-trt-*"))


def test_missing_tensor(tiny_copy, tmp_path):
    index = tiny_copy / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    from safetensors.torch import load_file, save_file
    file = tiny_copy / raw["weight_map"]["body.norm.weight"]
    tensors = load_file(file)
    del tensors["body.norm.weight"]
    save_file(tensors, file)
    bad(tmp_path, "--checkpoint", tiny_copy, message="missing 1 tensor(s): body.norm.weight")


def test_bad_config(tiny_copy, tmp_path):
    (tiny_copy / "config.json").write_text("{")
    bad(tmp_path, "--checkpoint", tiny_copy, message="config.json: unreadable")


def test_missing_special_token(tiny_copy, tmp_path):
    path = tiny_copy / "tokenizer.json"
    raw = json.loads(path.read_text())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] != "<|tts|>"]
    path.write_text(json.dumps(raw))
    bad(tmp_path, "--checkpoint", tiny_copy, message="<|tts|>")


def test_empty_text(tiny_ckpt, tmp_path):
    r = higgs("run", "--checkpoint", tiny_ckpt, "--text", "  ", "--out", tmp_path / "out.wav")
    assert r.returncode == 1 and r.stderr.strip() == "Error: text is empty" and not (tmp_path / "out.wav").exists()


def test_unwritable_output(tiny_ckpt, tmp_path):
    r = higgs_in_process("run", "--checkpoint", tiny_ckpt, "--text", "Hi.", "--out", tmp_path / "no" / "such.wav")
    assert r.exit_code != 0 and "does not exist" in r.stderr


def test_text_longer_than_a_prompt_is_spoken_in_segments(tiny_ckpt, tmp_path):
    out = tmp_path / "out.wav"
    r = higgs_in_process("run", "--checkpoint", tiny_ckpt, "--max-seq", "32", "--text", "word " * 40,
                         "--max-new-tokens", 8, "--out", out)
    assert r.exit_code == 0 and re.search(r"rows in \d+ segments", r.stderr), r.stderr
    assert out.stat().st_size > 44


def test_not_a_checkpoint(tmp_path):
    bad(tmp_path, "--checkpoint", tmp_path / "nowhere", message="checkpoint directory not found")


def test_bad_reference_codes(tiny_ckpt, tmp_path):
    np.save(tmp_path / "ref.npy", np.full((5, 8), 4000))
    bad(tmp_path, "--checkpoint", tiny_ckpt, "--ref-codes", tmp_path / "ref.npy", message="0..1023")


def test_help_lists_commands():
    r = higgs_in_process("--help")
    assert r.exit_code == 0 and "run" in r.stdout and "tiny-checkpoint" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without an NVIDIA GPU")
@pytest.mark.parametrize("command, args", [("kernels", ()), ("linear", ()), ("attention", ()), ("profile", ()),
                                           ("codec", ("--checkpoint", "ckpt"))])
def test_gpu_benchmarks_without_a_gpu_are_refused_in_one_line(command, args):
    r = higgs_in_process("bench", command, *args)
    assert r.exit_code == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"Error: bench {command} needs torch built with CUDA and an NVIDIA GPU"


def test_bench_weight_stream_refuses_a_missing_compiler_and_small_rings_in_one_line(tmp_path):
    r = higgs("bench", "weight-stream", "--nvcc", tmp_path / "no-nvcc")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"Error: bench weight-stream needs the CUDA compiler: '{tmp_path / 'no-nvcc'}' not found (--nvcc PATH)"
    r = higgs("bench", "weight-stream", "--rings", "32,8")
    assert r.returncode == 1 and r.stderr.strip() == "Error: --rings: each ring must hold at least 16 KB"


@pytest.mark.gpu
def test_bench_weight_stream_gemvs_sum_as_the_host_does():
    """The hand-written GEMVs of `bench weight-stream` (nvcc on the GPU host) against double-precision sums: every
    shape, precision and launch mode whose loads differ."""
    r = higgs("bench", "weight-stream", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    checks = [line for line in r.stdout.splitlines() if line.startswith("check")]
    assert len(checks) == 2 * 4 * 3 and not any("FAILED" in line for line in checks), r.stdout


def test_bench_stream_prints_figures_per_level(tiny_engine):
    """Closed-loop streams per level: audio-s/s, first audio, underruns, how long requests waited for a slot, and the
    scheduler loop's phases."""
    r = higgs("bench", "stream", "--engine", tiny_engine, "--concurrency", "1,4", "--requests", 6, "--rows", 24)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("concurrency")]
    assert len(lines) == 2 and all("6 requests" in line for line in lines), r.stdout
    assert all(float(re.search(r"= +([\d.]+) audio-s/s", line)[1]) > 0 for line in lines), r.stdout
    waits = [float(re.search(r"queue wait mean ([\d.]+) ms", line)[1]) for line in lines]
    assert all(w >= 0 for w in waits) and "loop prefill" in lines[0], r.stdout


@pytest.mark.parametrize("args", [["--backend", "ort"], ["--backend", "torch", "--device", "cpu"]])
def test_bench_stream_timeline_is_refused_off_the_gpu_engine(tiny_engine, tiny_ckpt, args):
    source = ["--engine", tiny_engine] if "ort" in args else ["--checkpoint", tiny_ckpt]
    r = higgs("bench", "stream", *source, *args, "--concurrency", "1", "--rows", 24, "--timeline")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith("Error: --timeline profiles the GPU engine"), r.stderr


def test_bench_stream_staggers_its_clients_on_request(tiny_engine):
    """All at once, four clients' windows fall due on the same steps (one codec call takes four); staggered, their
    requests join and end at different steps (a call takes one)."""
    def windows_per_call(*flags):
        r = higgs("bench", "stream", "--engine", tiny_engine, "--concurrency", "4", "--requests", 4, "--rows", 40, *flags)
        assert r.returncode == 0, r.stderr
        return float(re.search(r"codec calls of ([\d.]+) windows", r.stdout)[1])

    assert windows_per_call() == 4.0 and windows_per_call("--stagger") == 1.0


def test_bench_stream_takes_the_window_sizes_of_run(tiny_engine):
    r = higgs("bench", "stream", "--engine", tiny_engine, "--concurrency", "1", "--requests", 2, "--rows", 24,
              "--first-chunk", 2, "--chunk", 10)
    assert r.returncode == 0 and "first chunk 2 frames, then 10" in r.stderr, r.stderr
    r = higgs("bench", "stream", "--engine", tiny_engine, "--first-chunk", 0)
    assert r.returncode == 1 and r.stderr.strip().startswith("Error: --first-chunk must be at least 1 frame, got 0"), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bench_stream_carries_a_reference_on_request(tiny_engine):
    """--ref-seconds 1: every prompt carries 25 reference frames (32 delayed rows) and a transcript; a reference
    shorter than 1 s or longer than 30 s, or one whose prompt the engine's prefill cannot take, is one error line."""
    def prompt_tokens(*flags):
        r = higgs("bench", "stream", "--engine", tiny_engine, "--concurrency", "1", "--requests", 1, "--rows", 16,
                  "--text", "Hi there.", *flags)
        assert r.returncode == 0 and "1 requests" in r.stdout, r.stderr
        return int(re.search(r"prompt of (\d+) tokens", r.stderr)[1])

    alone, cloned = prompt_tokens(), prompt_tokens("--ref-seconds", 1)
    assert cloned - alone > 32, (alone, cloned)
    for seconds, words in ((31, "lie in 1..30"), (0.5, "lie in 1..30"), (20, "the engine's prefill takes at most")):
        r = higgs("bench", "stream", "--engine", tiny_engine, "--ref-seconds", seconds)
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("Error:"), r.stderr
        assert words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_stream_puts_each_feature_beside_the_plain_request(tiny_engine):
    """--segments, --voice and --text-rate each measure the feature and the plain request in one run, with the
    ratio; they are separate benchmarks."""
    base = ["bench", "stream", "--engine", tiny_engine, "--concurrency", 1, "--requests", 1, "--rows", 16]
    r = higgs_in_process(*base, "--segments", 3)
    labels = [line.split(",")[0] for line in r.stdout.splitlines()]
    assert r.exit_code == 0 and labels[:2] == ["1 segment", "3 segments"], r.output
    assert re.search(r"against the 1 segment: 3 segments [\d.]+×", r.stdout), r.stdout
    r = higgs_in_process(*base, "--voice", "--ref-seconds", 1)
    labels = [line.split(", concurrency")[0] for line in r.stdout.splitlines()[:3]]
    assert labels == ["default voice", "1 s voice, cache off", "1 s voice, cache on"], r.output
    r = higgs_in_process("bench", "stream", "--engine", tiny_engine, "--rows", 16, "--text-rate", 5000, "--segments", 2)
    assert r.exit_code == 0 and r.stdout.startswith("text at 5000 chars/s, 2 segments"), r.output
    assert re.search(r"cut → first audio p50 +[\d.]+ ms, the segment's prompt one-shot +[\d.]+ ms", r.stdout), r.stdout
    r = higgs("bench", "stream", "--engine", tiny_engine, "--voice", "--segments", 2)
    assert r.returncode == 1 and "separate benchmarks" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_decode_on_an_engine_with_few_slots_runs_with_the_defaults(tiny_engine):
    """The default batch sizes (1, 8, 64) are for the GPU engine; a host-driven engine with 4 slots takes 4."""
    r = higgs("bench", "decode", "--engine", tiny_engine, "--rows", 8, "--repeats", 1)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["greedy", "T=1"], r.stdout
