"""Every bad input gets one clear error, and no command destroys a user's files.

A table of malformed inputs grouped by kind (checkpoint, engine, text, options, outputs, prompts files), each driven
through the real CLI (in-process with click's CliRunner; a subprocess where the OS is part of the case). Each case
asserts exit code 1, exactly one `Error:` line that names the problem, no traceback, and a file system unchanged
(everything under the test's directory and the shared fixtures: type, size, mtime, inode). Then the other side:
valid inputs still accepted, outputs replaced only when they are what the command makes, a killed export's litter
removed by the next one, greedy runs byte-identical, sampled runs all terminating.
"""

import json
import os
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from higgs_trt.runtime.cli import main
from higgs_trt.runtime.manifest import MANIFEST, _seal, file_digest

LM_TENSOR = "body.layers.0.self_attn.q_proj.weight"


# ---- harness ----------------------------------------------------------------------------------------------------

def snapshot(*roots: Path) -> dict:
    """Every entry under `roots`, hidden ones included: (type, size, mtime, inode); directories by type only."""
    state = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                st = Path(dirpath, name).lstat()
                kind = stat.S_IFMT(st.st_mode)
                state[os.path.join(dirpath, name)] = (kind,) if stat.S_ISDIR(st.st_mode) else (
                    kind, st.st_size, st.st_mtime_ns, st.st_ino)
    return state


def higgs(*args) -> tuple[int, str]:
    """The CLI in-process: (exit code, stderr); an exception escaping the CLI fails the test (it is a traceback)."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), f"traceback: {r.exception!r}\n{r.stderr}"
    return r.exit_code, r.stderr


def higgs_subprocess(*args, env=None) -> tuple[int, str]:
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    r = subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", *argv], capture_output=True,
                       env={**os.environ, **(env or {})})
    return r.returncode, r.stderr.decode("utf-8", "backslashreplace")


@dataclass
class World:
    """Where a case builds its damaged inputs (tmp) from the shared, read-only fixtures."""
    tmp: Path
    ckpt: Path
    engine: Path

    @property
    def out(self) -> Path:
        return self.tmp / "out.wav"

    def run_torch(self, ckpt: Path, *extra, out=None) -> list:
        return ["run", "--backend", "torch", "--checkpoint", ckpt, "--text", "Hello.", "--out", out or self.out, *extra]

    def run_ort(self, engine: Path, *extra, text="Hello.", out=None) -> list:
        return ["run", "--engine", engine, "--text", text, "--out", out or self.out, *extra]

    # checkpoints
    def ckpt_copy(self) -> Path:
        return Path(shutil.copytree(self.ckpt, self.tmp / "ckpt"))

    def config(self, edit) -> Path:
        ck = self.ckpt_copy()
        raw = json.loads((ck / "config.json").read_text())
        edit(raw["text_config"], raw)
        (ck / "config.json").write_text(json.dumps(raw))
        return ck

    def shard_of(self, ck: Path, tensor: str = LM_TENSOR) -> Path:
        return ck / json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"][tensor]

    def header(self, edit=None, raw_header: bytes | None = None) -> Path:
        """A checkpoint whose shard holding LM_TENSOR has its header edited in place by edit(header), or replaced
        by raw_header; the data bytes are kept."""
        ck = self.ckpt_copy()
        shard = self.shard_of(ck)
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        if edit:
            edit(header)
        body = raw_header if raw_header is not None else json.dumps(header).encode()
        shard.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
        return ck

    def shard_bytes(self, make) -> Path:
        ck = self.ckpt_copy()
        shard = self.shard_of(ck)
        shard.write_bytes(make(shard.read_bytes()))
        return ck

    def tensors(self, edit, tensor: str = LM_TENSOR) -> Path:
        ck = self.ckpt_copy()
        shard = self.shard_of(ck, tensor)
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, shard)
        return ck

    def ckpt_file(self, name: str, content: str | bytes | None) -> Path:
        """A checkpoint with one file replaced (None: removed)."""
        return _put(self.ckpt_copy(), name, content)

    def engine_file(self, name: str, content: str | bytes | None) -> Path:
        """An engine directory with one file replaced (None: removed), its manifest left as it was."""
        return _put(self.engine_copy(), name, content)

    def tokenizer(self, edit, ck: Path | None = None) -> Path:
        ck = ck or self.ckpt_copy()
        raw = json.loads((ck / "tokenizer.json").read_text())
        edit(raw)
        (ck / "tokenizer.json").write_text(json.dumps(raw))
        return ck

    def index(self, edit) -> Path:
        ck = self.ckpt_copy()
        path = ck / "model.safetensors.index.json"
        raw = json.loads(path.read_text())
        raw = edit(raw) or raw
        path.write_text(json.dumps(raw))
        return ck

    # engines
    def engine_copy(self) -> Path:
        return Path(shutil.copytree(self.engine, self.tmp / "engine"))

    def manifest(self, edit, reseal: bool = True) -> Path:
        """An engine whose manifest is edited and (by default) sealed again, as a tool that wrote it would."""
        e = self.engine_copy()
        m = json.loads((e / MANIFEST).read_text())
        edit(m, e)
        if reseal:
            m["manifest_sha256"] = _seal(m)
        (e / MANIFEST).write_text(json.dumps(m))
        return e

    def prompts(self, content) -> Path:
        path = self.tmp / "prompts.json"
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        return path

    def compare(self, prompts: Path) -> list:
        return ["compare", "--engine", self.engine, "--prompts", prompts]


def _put(directory: Path, name: str, content) -> Path:
    path = directory / name
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return directory


def _special(directory: Path, name: str, kind: str) -> Path:
    """`directory` with its file `name` replaced by a fifo (a read blocks forever), a link to /dev/zero (a read never
    ends) or a sparse 100 GiB file."""
    path = directory / name
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(100 << 30)
    return directory


def _voice(w: World) -> Path:
    import soundfile

    soundfile.write(w.tmp / "voice.flac", 0.5 * np.sin(np.arange(48000) * 2 * np.pi * 220 / 24000), 24000)
    return w.tmp / "voice.flac"


def _hard_link(source: Path, link: Path) -> Path:
    os.link(source, link)
    return link


def _file(w: World, content: str = "x") -> Path:
    (w.tmp / "f").write_text(content)
    return w.tmp / "f"


def _empty_dir(w: World) -> Path:
    (w.tmp / "empty").mkdir()
    return w.tmp / "empty"


def _bytes(w: World, content: bytes) -> Path:
    (w.tmp / "b").write_bytes(content)
    return w.tmp / "b"


def _in_two_shards(w: World) -> Path:
    ck = w.ckpt_copy()
    first, second = sorted(ck.glob("model-*.safetensors"))
    a, b = load_file(first), load_file(second)
    name = sorted(b)[0]
    save_file({**a, name: b[name]}, first)
    return ck


def _resealed_file(m: dict, e: Path, name: str, data: bytes) -> None:
    (e / name).write_bytes(data)
    m["files"][name] = file_digest(e / name)


def _audio_outside_vocab(raw: dict) -> None:
    for t in raw["added_tokens"]:
        if t["content"] == "<|audio|>":
            t["id"] = 100000
    raw["model"]["vocab"]["<|audio|>"] = 100000


def _swap_offsets(h: dict) -> None:
    h[LM_TENSOR]["data_offsets"].reverse()


def _overlap(h: dict) -> None:
    other = next(n for n in h if n not in (LM_TENSOR, "__metadata__"))
    h[other] = dict(h[LM_TENSOR])


def _set_value(value: float, dtype=torch.bfloat16):
    def edit(t):
        x = t[LM_TENSOR].to(dtype)
        x.view(-1)[5] = value
        t[LM_TENSOR] = x
    return edit


def _mkfifo(w: World) -> Path:
    os.mkfifo(w.tmp / "fifo")
    return w.tmp / "fifo"


def _socket(w: World) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(w.tmp / "sock"))
    s.close()
    return w.tmp / "sock"


def _victim(w: World, name: str = "victim") -> Path:
    d = w.tmp / name
    d.mkdir()
    (d / "notes.txt").write_text("my notes\n")
    return d


def _empty(w: World) -> Path:
    (w.tmp / "empty").mkdir()
    return w.tmp / "empty"


def _symlink(w: World, to: Path, name: str = "link.wav") -> Path:
    (w.tmp / name).symlink_to(to)
    return w.tmp / name


def _loop(w: World) -> Path:
    (w.tmp / "loop1").symlink_to(w.tmp / "loop2")
    (w.tmp / "loop2").symlink_to(w.tmp / "loop1")
    return w.tmp / "loop1"


def _engine_with_notes(w: World, name: str = "notes.txt") -> Path:
    e = w.engine_copy()
    (e / name).write_text("mine\n")
    return e


def _other_checkpoint(w: World) -> Path:
    from higgs_trt.builder.tiny import write_random_checkpoint

    return write_random_checkpoint(w.tmp / "other", seed=1)


def _ref(w: World, codes) -> Path:
    np.save(w.tmp / "ref.npy", np.asarray(codes))
    return w.tmp / "ref.npy"


def _npz(w: World) -> Path:
    np.savez(w.tmp / "ref.npz", codes=np.zeros((3, 8), np.int32))
    return w.tmp / "ref.npz"


def _shard_a_device(w: World) -> Path:
    ck = w.ckpt_copy()
    shard = next(ck.glob("model-00001-of-*.safetensors"))
    shard.unlink()
    shard.symlink_to("/dev/zero")
    return ck


def _ref_claiming(w: World, shape) -> Path:
    """An .npy file whose header claims `shape` (int32) over 64 bytes of data."""
    path = w.tmp / "claims.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i4", "fortran_order": False, "shape": shape})
        f.write(bytes(64))
    return path


def _bench_engine(w: World, *extra) -> list:
    return ["bench", "decode", "--engine", w.engine, *extra]


@dataclass
class Case:
    name: str
    args: Callable[[World], list]
    message: str  # must appear in the one Error: line
    subprocess: bool = False
    without_gpu: bool = False  # bad input only where torch has no CUDA


CHECKPOINT = [
    Case("config-a-fifo", lambda w: w.run_torch(_special(w.ckpt_copy(), "config.json", "fifo")),
         "config.json: is a fifo, not a regular file"),
    Case("index-a-device", lambda w: w.run_torch(_special(w.ckpt_copy(), "model.safetensors.index.json", "zero")),
         "model.safetensors.index.json: is a character device, not a regular file"),
    Case("tokenizer-a-fifo", lambda w: w.run_torch(_special(w.ckpt_copy(), "tokenizer.json", "fifo")),
         "tokenizer.json: is a fifo, not a regular file"),
    Case("config-100-gib", lambda w: w.run_torch(_special(w.ckpt_copy(), "config.json", "sparse")),
         "config.json: 102,400 MiB, more than such a file may hold (64 MiB)"),
    Case("directory-missing", lambda w: w.run_torch(w.tmp / "nowhere"), "checkpoint directory not found"),
    Case("config-missing", lambda w: w.run_torch(w.ckpt_file("config.json", None)), "config.json: not found"),
    Case("config-not-json", lambda w: w.run_torch(w.ckpt_file("config.json", "{")), "not valid JSON"),
    Case("config-a-list", lambda w: w.run_torch(w.ckpt_file("config.json", "[1]")), "not a JSON object"),
    Case("config-not-utf8", lambda w: w.run_torch(w.ckpt_file("config.json", b'{"a": "\xff"}')), "not UTF-8"),
    Case("config-duplicate-key", lambda w: w.run_torch(w.ckpt_file("config.json", (w.ckpt / "config.json").read_text()
                                                                   .replace('"model_type"', '"model_type": "x", "model_type"', 1))),
         "key 'model_type' appears twice"),
    Case("hidden-size-a-string", lambda w: w.run_torch(w.config(lambda t, r: t.update(hidden_size="64"))),
         "text_config.hidden_size must be an integer, got '64'"),
    Case("rms-eps-a-string", lambda w: w.run_torch(w.config(lambda t, r: t.update(rms_norm_eps="1e-6"))),
         "text_config.rms_norm_eps must be a number"),
    Case("rope-theta-a-string", lambda w: w.run_torch(w.config(lambda t, r: t["rope_parameters"].update(rope_theta="1e6"))),
         "rope_theta must be a number"),
    Case("head-dim-a-float", lambda w: w.run_torch(w.config(lambda t, r: t.update(head_dim=16.0))),
         "head_dim must be an integer"),
    Case("vocab-a-bool", lambda w: w.run_torch(w.config(lambda t, r: t.update(vocab_size=True))),
         "vocab_size must be an integer"),
    Case("layers-a-billion", lambda w: w.run_torch(w.config(lambda t, r: t.update(num_hidden_layers=1_000_000_000))),
         "num_hidden_layers is 1000000000, outside 1..1024"),
    Case("fewer-layers-than-tensors", lambda w: w.run_torch(w.config(lambda t, r: t.update(num_hidden_layers=1))),
         "holds 11 tensor(s) of layers past it: body.layers.1."),
    Case("more-layers-than-tensors", lambda w: w.run_torch(w.config(lambda t, r: t.update(num_hidden_layers=5))),
         "holds no tensors of layer(s) 2, 3, 4"),
    Case("zero-kv-heads", lambda w: w.run_torch(w.config(lambda t, r: t.update(num_key_value_heads=0))),
         "num_key_value_heads is 0, outside 1..1024"),
    Case("max-positions-negative", lambda w: w.run_torch(w.config(lambda t, r: t.update(max_position_embeddings=-1))),
         "max_position_embeddings is -1"),
    Case("max-positions-below-a-cache", lambda w: ["export", "--checkpoint", w.config(
        lambda t, r: t.update(max_position_embeddings=15)), "--out", w.tmp / "e"],
         "text_config.max_position_embeddings is 15, outside 16..4194304"),  # exported an engine that cannot speak
    Case("rope-parameters-a-list", lambda w: w.run_torch(w.config(lambda t, r: t.update(rope_parameters=[1]))),
         "rope_parameters and rope_scaling must be objects"),
    Case("delay-pattern-a-string", lambda w: w.run_torch(w.config(
        lambda t, r: r["audio_encoder_config"].update(use_delay_pattern="true"))), "use_delay_pattern must be true"),
    Case("codebooks-a-float", lambda w: w.run_torch(w.config(
        lambda t, r: r["audio_encoder_config"].update(num_codebooks=8.0))), "num_codebooks is 8.0, expected 8"),
    Case("offsets-reversed", lambda w: w.run_torch(w.header(_swap_offsets)), "are reversed or negative"),
    Case("offsets-missing", lambda w: w.run_torch(w.header(lambda h: h[LM_TENSOR].pop("data_offsets"))),
         f"tensor {LM_TENSOR}: data_offsets None is not [begin, end]"),
    Case("header-a-list", lambda w: w.run_torch(w.header(raw_header=b"[1, 2]")), "header is a JSON list, not an object"),
    Case("header-not-json", lambda w: w.run_torch(w.header(raw_header=b"{nope")), "not valid JSON"),
    Case("header-not-utf8", lambda w: w.run_torch(w.header(raw_header=b'{"\xff": 1}')),
         "header is not UTF-8"),
    Case("unknown-dtype", lambda w: w.run_torch(w.header(lambda h: h[LM_TENSOR].update(dtype="Q7"))),
         f"tensor {LM_TENSOR}: unknown dtype 'Q7'"),
    Case("shape-not-sizes", lambda w: w.run_torch(w.header(lambda h: h[LM_TENSOR].update(shape=[-1, 64]))),
         "is not a list of sizes"),
    Case("shape-disagrees-with-bytes", lambda w: w.run_torch(w.header(lambda h: h[LM_TENSOR].update(shape=[3, 64]))),
         "does not take the"),
    Case("ranges-overlap", lambda w: w.run_torch(w.header(_overlap)), "overlaps tensor"),
    Case("range-past-end", lambda w: w.run_torch(w.shard_bytes(lambda b: b[:-100])), "truncated"),
    Case("bytes-after-last-tensor", lambda w: w.run_torch(w.shard_bytes(lambda b: b + b"\0" * 64)),
         "64 bytes after the last tensor"),
    Case("header-length-past-end", lambda w: w.run_torch(w.shard_bytes(lambda b: struct.pack("<Q", 1 << 40) + b[8:])),
         "runs past the end of the file"),
    Case("file-of-4-bytes", lambda w: w.run_torch(w.shard_bytes(lambda b: b[:4])), "shorter than the 8-byte header"),
    Case("metadata-not-strings", lambda w: w.run_torch(w.header(lambda h: h.update(__metadata__={"format": 1}))),
         "__metadata__ must map names to strings"),
    Case("tensor-in-two-shards", lambda w: w.run_torch(_in_two_shards(w)), "is in both"),
    Case("index-weight-map-a-list", lambda w: w.run_torch(w.index(lambda r: {"weight_map": [1]})), "no weight_map object"),
    Case("index-shard-outside", lambda w: w.run_torch(w.index(
        lambda r: r["weight_map"].update({LM_TENSOR: "../x.safetensors"}))), "'../x.safetensors' is not a file name"),
    Case("index-shard-missing", lambda w: w.run_torch(w.index(
        lambda r: r["weight_map"].update({LM_TENSOR: "model-9.safetensors"}))), "shard(s) not found: model-9.safetensors"),
    Case("shard-a-device", lambda w: w.run_torch(_shard_a_device(w)), "shard(s) not regular files: model-00001-of"),
    Case("nan-weight", lambda w: w.run_torch(w.tensors(_set_value(float("nan")))), f"tensor {LM_TENSOR} holds inf or NaN"),
    Case("inf-weight-f32", lambda w: w.run_torch(w.tensors(_set_value(float("inf"), torch.float32))),
         f"tensor {LM_TENSOR} holds inf or NaN"),
    Case("neg-inf-weight-f16", lambda w: w.run_torch(w.tensors(_set_value(float("-inf"), torch.float16))),
         f"tensor {LM_TENSOR} holds inf or NaN"),
    Case("integer-weight", lambda w: w.run_torch(w.tensors(lambda t: t.update({LM_TENSOR: t[LM_TENSOR].to(torch.int32)}))),
         f"of a dtype it cannot use: {LM_TENSOR} (I32)"),
    Case("tensor-missing", lambda w: w.run_torch(w.tensors(lambda t: t.pop(LM_TENSOR))), f"missing 1 tensor(s): {LM_TENSOR}"),
    Case("tensor-misshaped", lambda w: w.run_torch(w.tensors(
        lambda t: t.update({LM_TENSOR: torch.zeros(3, 64, dtype=torch.bfloat16)}))), f"{LM_TENSOR} is [3, 64], expected [64, 64]"),
    Case("special-token-outside-vocab", lambda w: w.run_torch(w.tokenizer(_audio_outside_vocab)),
         "lie outside the model's text vocabulary of 448: <|audio|> (100000)"),
    Case("tokenizer-lacks-tts", lambda w: w.run_torch(w.tokenizer(
        lambda r: r.update(added_tokens=[t for t in r["added_tokens"] if t["content"] != "<|tts|>"]))),
         "lacks the Higgs special token(s) <|tts|>"),
    Case("tokenizer-not-json", lambda w: w.run_torch(w.ckpt_file("tokenizer.json", "{")), "cannot load tokenizer"),
    Case("export-offsets-reversed", lambda w: ["export", "--checkpoint", w.header(_swap_offsets), "--out", w.tmp / "e"],
         "are reversed or negative"),
    Case("export-nan-weight", lambda w: ["export", "--checkpoint", w.tensors(_set_value(float("nan"))), "--out",
                                        w.tmp / "e"], "holds inf or NaN"),
    Case("calibrate-header-a-list", lambda w: ["calibrate", "--checkpoint", w.header(raw_header=b"[1]"), "--out",
                                              w.tmp / "c.json"], "header is a JSON list"),
    Case("calibrate-unknown-dtype", lambda w: ["calibrate", "--checkpoint", w.header(
        lambda h: h[LM_TENSOR].update(dtype="BF17")), "--out", w.tmp / "c.json"], "unknown dtype 'BF17'"),
]

ENGINE = [
    Case("manifest-a-device", lambda w: w.run_ort(_special(w.engine_copy(), MANIFEST, "zero")),
         "manifest.json: is a character device, not a regular file"),
    Case("manifest-a-fifo", lambda w: w.run_ort(_special(w.engine_copy(), MANIFEST, "fifo")),
         "manifest.json: is a fifo, not a regular file"),
    Case("weights-a-fifo", lambda w: w.run_ort(_special(w.engine_copy(), "weights.bin", "fifo")),
         "weights.bin is a fifo, not a regular file"),
    Case("directory-missing", lambda w: w.run_ort(w.tmp / "nowhere"), "not an engine directory"),
    Case("a-file", lambda w: w.run_ort(_file(w)), "unreadable"),
    Case("empty-directory", lambda w: w.run_ort(_empty(w)), "no manifest.json"),
    Case("manifest-not-json", lambda w: w.run_ort(w.engine_file(MANIFEST, "{")), "manifest.json: unreadable"),
    Case("manifest-a-list", lambda w: w.run_ort(w.engine_file(MANIFEST, "[]")), "format None is not 1"),
    Case("manifest-nested-too-deeply", lambda w: w.run_ort(w.engine_file(MANIFEST, "[" * 100_000 + "]" * 100_000)),
         "manifest.json: unreadable: JSON nested too deeply"),
    # json.loads kept the last of two equal keys, so the seal still matched
    Case("manifest-key-twice", lambda w: w.run_ort(w.engine_file(MANIFEST, (w.engine / MANIFEST).read_text().replace(
        "{", '{"format": 1, ', 1))), "manifest.json: unreadable: not valid JSON (key 'format' appears twice)"),
    Case("resealed-without-codec", lambda w: w.run_ort(w.manifest(lambda m, e: m.pop("codec"))),
         "no valid codec strides"),
    Case("manifest-format-2", lambda w: w.run_ort(w.manifest(lambda m, e: m.update(format=2))), "format 2 is not 1"),
    Case("manifest-edited", lambda w: w.run_ort(w.manifest(lambda m, e: m["limits"].update(max_seq=4096), reseal=False)),
         "has been edited by hand"),
    Case("weights-missing", lambda w: w.run_ort(w.engine_file("weights.bin", None)), "weights.bin is missing"),
    Case("tokenizer-changed", lambda w: w.run_ort(w.engine_file("tokenizer.json", (w.engine / "tokenizer.json")
                                                                .read_text() + " ")),
         "tokenizer.json does not match the manifest"),
    Case("resealed-without-limits", lambda w: w.run_ort(w.manifest(lambda m, e: m.pop("limits"))), "no valid limits"),
    Case("resealed-limits-as-strings", lambda w: w.run_ort(w.manifest(lambda m, e: m["limits"].update(max_seq="160"))),
         "no valid limits"),
    Case("resealed-longer-max-seq", lambda w: w.run_ort(w.manifest(lambda m, e: m["limits"].update(
        max_seq=m["limits"]["max_seq"] * 4)), text="word " * 60), "but the manifest's max_seq is"),
    Case("resealed-nan-weights", lambda w: w.run_ort(w.manifest(lambda m, e: _resealed_file(
        m, e, "weights.bin", b"\xff" * (e / "weights.bin").stat().st_size))), "the decoded audio holds NaN"),
    Case("resealed-file-outside", lambda w: w.run_ort(w.manifest(
        lambda m, e: m["files"].update({"../etc.txt": {"bytes": 1, "sha256": "0"}}))), "outside its directory: ../etc.txt"),
    Case("resealed-files-a-list", lambda w: w.run_ort(w.manifest(lambda m, e: m.update(files=[]))), "no file list"),
    Case("resealed-garbage-graph", lambda w: w.run_ort(w.manifest(
        lambda m, e: _resealed_file(m, e, "lm.ref.onnx", b"not onnx"))), "ONNX Runtime cannot load it"),
    Case("resealed-token-outside-vocab", lambda w: w.run_ort(w.manifest(lambda m, e: _resealed_file(
        m, e, "tokenizer.json", json.dumps((lambda r: (_audio_outside_vocab(r), r)[1])(
            json.loads((e / "tokenizer.json").read_text()))).encode()))), "outside the model's text vocabulary"),
    Case("other-precision", lambda w: w.run_ort(w.engine, "--precision", "fp8"), "holds bf16 engines, not fp8"),
    Case("other-checkpoint", lambda w: w.run_ort(w.engine, "--checkpoint", _other_checkpoint(w)),
         "was built from another checkpoint"),
    Case("bench-engine-missing", lambda w: ["bench", "decode", "--engine", w.tmp / "nowhere"], "not an engine directory"),
    Case("compare-engine-missing", lambda w: ["compare", "--engine", w.tmp / "nowhere"], "not an engine directory"),
]

TEXT = [
    *[Case(f"structural-{t.strip('<|>')}", lambda w, t=t: w.run_ort(w.engine, text=f"Hello {t} there."),
           f"may not contain the prompt token(s) {t}")
      for t in ("<|audio|>", "<|eoc|>", "<|audio_end|>", "<|endoftext|>", "<|tts|>", "<|text|>", "<|ref_audio|>",
                "<|ref_text|>", "<|text_end|>")],
    Case("empty", lambda w: w.run_ort(w.engine, text=""), "text is empty"),
    Case("whitespace", lambda w: w.run_ort(w.engine, text=" \n\t "), "text is empty"),
    Case("invisible-only", lambda w: w.run_ort(w.engine, text="\u200b\u200d \ufeff\u2060"),
         "text has nothing to say: only invisible format characters and spaces"),
    Case("unknown-tag", lambda w: w.run_ort(w.engine, text="Hi <|emotion:rage|>"), "unknown control tag(s) <|emotion:rage|>"),
    Case("lone-surrogate", lambda w: w.run_ort(w.engine, text="Hi \udcff"), "not valid UTF-8"),
    Case("nul", lambda w: w.run_ort(w.engine, text="Hi\x00there"), "control character U+0000"),
    Case("escape", lambda w: w.run_ort(w.engine, text="Hi\x1b[31m"), "control character U+001B"),
    Case("ref-text-structural", lambda w: w.run_ort(w.engine, "--ref-codes", _ref(w, np.zeros((3, 8), int)),
                                                    "--ref-text", "I said <|audio|>"),
         "reference text may not contain the prompt token(s) <|audio|>"),
    Case("ref-codes-a-fifo", lambda w: w.run_ort(w.engine, "--ref-codes", _mkfifo(w)), "fifo: is a fifo, not a regular file"),
    Case("calibration-a-fifo", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.tmp / "e", "--precision", "fp8",
                                          "--calibration", _mkfifo(w)], "fifo: is a fifo, not a regular file"),
    Case("ref-text-without-codes", lambda w: w.run_ort(w.engine, "--ref-text", "hello"), "--ref-text needs --ref-codes"),
    Case("ref-codes-header-claims-terabytes", lambda w: w.run_ort(w.engine, "--ref-codes", _ref_claiming(w, (10**12, 8))),
         "cannot read reference codes"),
    Case("ref-codes-truncated", lambda w: w.run_ort(w.engine, "--ref-codes", _ref_claiming(w, (100, 8))),
         "cannot read reference codes"),
    Case("ref-codes-text", lambda w: w.run_ort(w.engine, "--ref-codes", _file(w, "RIFF and more")),
         "not an .npy file (codes [T, 8]"),  # numpy called it pickled data
    Case("ref-codes-npz", lambda w: w.run_ort(w.engine, "--ref-codes", _npz(w)), "not an .npy file"),  # 'got [1]'
    Case("encode-audio-cuda-without-a-gpu", lambda w: ["encode-audio", "--checkpoint", w.ckpt, "--device", "cuda",
                                                       "--audio", _voice(w), "--out", w.tmp / "c.npy"],
         "--device cuda needs torch built with CUDA", without_gpu=True),  # torch's AssertionError traceback
    Case("bench-encode-cuda-without-a-gpu", lambda w: ["bench", "encode", "--checkpoint", w.ckpt, "--device", "cuda"],
         "--device cuda needs torch built with CUDA", without_gpu=True),
    Case("ref-audio-a-device", lambda w: w.run_ort(w.engine, "--ref-audio", "/dev/zero"),
         "/dev/zero: reference audio is not a regular file"),  # 'not found'
    Case("reference-too-long-for-engine", lambda w: w.run_ort(w.engine, "--ref-codes", _ref(w, np.zeros((200, 8), int))),
         "text and reference audio too long: the prompt takes"),
    Case("reference-too-long-for-cache", lambda w: w.run_torch(w.ckpt, "--max-seq", "32", "--ref-codes",
                                                               _ref(w, np.zeros((20, 8), int))),
         "the engine's prefill takes at most 24"),
    Case("text-and-text-file", lambda w: w.run_ort(w.engine, "--text-file", _file(w, "Hi.")), "one of them"),
    Case("text-file-missing", lambda w: ["run", "--engine", w.engine, "--text-file", w.tmp / "none.txt", "--out", w.out],
         "none.txt: not found"),
    Case("text-file-not-utf8", lambda w: ["run", "--engine", w.engine, "--text-file", _bytes(w, b"caf\xe9"), "--out",
                                          w.out], "not UTF-8 text"),
    Case("speaker-malformed", lambda w: w.run_ort(w.engine, "--speaker", "alice"), "give TAG=VOICE"),
    Case("speaker-twice", lambda w: w.run_ort(w.engine, "--speaker", "S1=default", "--speaker", "S1=default"),
         "--speaker S1 is given twice"),
    Case("speaker-unknown-voice", lambda w: w.run_ort(w.engine, "--speaker", "S1=nobody"), "no voice 'nobody'"),
    Case("speaker-tag-unmapped", lambda w: w.run_ort(w.engine, "--speaker", "S1=default", text="[S1] Hi. [S2] Yo."),
         "[S2] is not mapped to a voice"),
    Case("speaker-tag-without-speakers", lambda w: w.run_ort(w.engine, text="[S1] Hi."),
         "needs a `speakers` mapping"),
    Case("voices-without-speaker", lambda w: w.run_ort(w.engine, "--voices", _empty_dir(w)),
         "--voices applies to --speaker"),
    Case("max-new-tokens-too-few", lambda w: w.run_ort(w.engine, "--max-new-tokens", 3),
         "--max-new-tokens must lie in 8..2048"),
    Case("argv-not-utf8", lambda w: ["run", "--engine", w.engine, "--text", b"caf\xe9 \xff", "--out", w.out],
         "text is not valid UTF-8", subprocess=True),
    Case("bench-text-structural", lambda w: _bench_engine(w, "--text", "x <|eoc|>"), "<|eoc|>"),
]

OPTIONS = [
    Case("temperature-nan", lambda w: w.run_ort(w.engine, "--temperature", "nan"), "--temperature must be a finite"),
    Case("temperature-inf", lambda w: w.run_ort(w.engine, "--temperature", "inf"), "--temperature must be a finite"),
    Case("temperature-negative", lambda w: w.run_ort(w.engine, "--temperature", "-0.5"), "got -0.5"),
    Case("temperature-denormal", lambda w: w.run_ort(w.engine, "--temperature", "1e-320"), "too small to sample"),
    Case("temperature-beyond-float32", lambda w: w.run_ort(w.engine, "--temperature", "1e39"), "float32's range"),
    Case("top-p-zero", lambda w: w.run_ort(w.engine, "--top-p", "0"), "--top-p must lie in (0, 1]"),
    Case("top-p-above-one", lambda w: w.run_ort(w.engine, "--top-p", "1.5"), "--top-p must lie in (0, 1]"),
    Case("top-p-nan", lambda w: w.run_ort(w.engine, "--top-p", "nan"), "--top-p must lie in (0, 1]"),
    Case("top-k-negative", lambda w: w.run_ort(w.engine, "--top-k", "-1"), "--top-k must be ≥ 0"),
    Case("seed-negative", lambda w: w.run_ort(w.engine, "--seed", "-1"), "--seed must lie in 0..9223372036854775807"),
    Case("seed-2-63", lambda w: w.run_ort(w.engine, "--seed", str(2**63)), "--seed must lie in"),
    Case("max-seq-with-ort", lambda w: w.run_ort(w.engine, "--max-seq", "0"), "--max-seq applies to --backend torch"),
    Case("max-seq-with-trt", lambda w: w.run_ort(w.engine, "--backend", "trt", "--max-seq", "64"),
         "--max-seq applies to --backend torch"),
    Case("max-seq-zero", lambda w: w.run_torch(w.ckpt, "--max-seq", "0"), "--max-seq must lie in 16..32768"),
    Case("max-seq-negative", lambda w: w.run_torch(w.ckpt, "--max-seq", "-5"), "got -5"),
    Case("max-seq-beyond-model", lambda w: w.run_torch(w.ckpt, "--max-seq", "1000000000"),
         "the model's max_position_embeddings"),
    Case("device-lean-with-ort", lambda w: w.run_ort(w.engine, "--device", "lean"), "--device lean does not apply to --backend ort"),
    Case("device-cpu-with-trt", lambda w: w.run_ort(w.engine, "--backend", "trt", "--device", "cpu"),
         "--device cpu does not apply to --backend trt"),
    Case("device-lean-with-torch", lambda w: w.run_torch(w.ckpt, "--device", "lean"), "does not apply to --backend torch"),
    Case("precision-with-torch-cpu", lambda w: w.run_torch(w.ckpt, "--precision", "bf16", "--device", "cpu"),
         "--precision does not apply"),
    Case("engine-with-torch-cpu", lambda w: w.run_torch(w.ckpt, "--engine", w.engine, "--device", "cpu"),
         "--engine does not apply"),
    Case("codec-precision-with-ort", lambda w: w.run_ort(w.engine, "--codec-precision", "tf32"),
         "--codec-precision applies to the GPU engine (--backend torch on a GPU); --backend ort decodes"),
    Case("codec-precision-with-torch-cpu", lambda w: w.run_torch(w.ckpt, "--codec-precision", "fp16", "--device", "cpu"),
         "the CPU reference decodes audio in fp32"),
    Case("bench-codec-precision-with-ort", lambda w: ["bench", "stream", "--engine", w.engine, "--codec-precision",
                                                      "fp16"], "--codec-precision applies to the GPU engine"),
    Case("bench-encode-seconds-nan", lambda w: ["bench", "encode", "--engine", w.engine, "--seconds", "nan"],
         "--seconds must lie in 1..30 seconds, got nan"),
    Case("bench-serve-url-no-scheme", lambda w: ["bench", "serve", "--url", "not a url"],
         "--url must be a server's address, http(s)://HOST[:PORT] and no path, got 'not a url'"),
    Case("bench-serve-empty-text", lambda w: ["bench", "serve", "--url", "http://127.0.0.1:9", "--text", ""],
         "--text is empty"),  # sent to the server as it was
    Case("bench-decode-batches-empty", lambda w: _bench_engine(w, "--batches", ""),
         "--batches takes comma-separated integers, got ''"),  # the default was used
    Case("bench-serve-url-broken-ipv6", lambda w: ["bench", "serve", "--url", "http://[::1"], "Invalid IPv6 URL"),
    Case("bench-serve-port-out-of-range", lambda w: ["bench", "serve", "--url", "http://127.0.0.1:99999"],
         "Port out of range"),
    Case("bench-serve-wait-nan", lambda w: ["bench", "serve", "--wait", "nan"], "--wait must lie in 0..86400 seconds"),
    Case("bench-serve-wait-inf", lambda w: ["bench", "serve", "--wait", "inf"], "--wait must lie in 0..86400 seconds"),
    Case("torch-cpu-without-checkpoint", lambda w: w.run_ort(w.engine, "--backend", "torch", "--device", "cpu"),
         "it needs --checkpoint"),
    Case("ort-without-engine", lambda w: ["run", "--backend", "ort", "--checkpoint", w.ckpt, "--text", "Hi", "--out", w.out],
         "--backend ort needs --engine"),
    Case("no-model", lambda w: ["run", "--text", "Hi", "--out", w.out], "give --engine DIR"),
    Case("export-max-batch-zero", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.tmp / "e", "--max-batch", 0],
         "--max-batch must lie in 1..1024, got 0"),
    Case("export-max-prompt-zero", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.tmp / "e", "--max-prompt", 0],
         "--max-prompt must lie in 1..2047 (below --max-seq, 2048), got 0"),
    Case("export-max-seq-beyond-model", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.tmp / "e",
                                                   "--max-seq", 10**9], "max_position_embeddings), got 1000000000"),
    Case("export-calibration-with-bf16", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.tmp / "e",
                                                    "--calibration", w.tmp / "c.json"], "--calibration applies to --precision fp8 only"),
    Case("build-gate-with-bf16", lambda w: ["build", "--checkpoint", w.ckpt, "--out", w.tmp / "e", "--gate-top1", "0.5"],
         "--gate-top1 applies to --precision fp8 only"),
    Case("export-gate-cosine-2", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.tmp / "e", "--precision", "fp8",
                                            "--gate-cosine", "2"], "--gate-cosine must lie in [-1, 1]"),
    Case("build-lean-with-target", lambda w: ["build", "--checkpoint", w.ckpt, "--out", w.tmp / "e", "--lean",
                                              "--target", "sm89"], "--lean makes plans for tensorrt_lean"),
    Case("bench-batch-zero", lambda w: _bench_engine(w, "--batches", 0), "--batches must lie in 1..512"),
    Case("bench-batch-above-engine", lambda w: _bench_engine(w, "--batches", 5), "--batches must lie in 1..4"),
    Case("bench-repeats-zero", lambda w: _bench_engine(w, "--repeats", 0), "--repeats must lie in 1..1000"),
    Case("bench-max-seq-with-ort", lambda w: _bench_engine(w, "--max-seq", 64), "--max-seq applies to --backend torch"),
    Case("compare-steps-zero", lambda w: ["compare", "--engine", w.engine, "--steps", 0], "--steps must lie in 1..160"),
    Case("compare-one-runner", lambda w: ["compare", "--engine", w.engine, "--runners", "ort"], "at least two runners"),
    Case("compare-same-runner-twice", lambda w: ["compare", "--engine", w.engine, "--runners", "ort,ort"],
         "at least two runners"),
    Case("compare-unknown-runner", lambda w: ["compare", "--engine", w.engine, "--runners", "ort,foo"], "unknown runner 'foo'"),
    Case("compare-per-layer-without-checkpoint", lambda w: ["compare", "--engine", w.engine, "--per-layer"],
         "--per-layer needs --checkpoint"),
    Case("tiny-checkpoint-seed-negative", lambda w: ["tiny-checkpoint", w.tmp / "t", "--seed", -3], "--seed must lie in"),
]

OUTPUTS = [
    Case("out-a-directory", lambda w: w.run_ort(w.engine, out=_victim(w)), "is a directory, not a file"),
    Case("out-a-fifo", lambda w: w.run_ort(w.engine, out=_mkfifo(w)), "is a fifo, not a file"),
    Case("out-a-socket", lambda w: w.run_ort(w.engine, out=_socket(w)), "is a socket, not a file"),
    Case("codes-out-a-fifo", lambda w: w.run_ort(w.engine, "--codes-out", _mkfifo(w)), "is a fifo, not a file"),
    Case("out-a-dangling-symlink", lambda w: w.run_ort(w.engine, out=_symlink(w, w.tmp / "gone.wav")),
         "is a symlink to nothing"),
    Case("out-a-symlink-to-a-directory", lambda w: w.run_ort(w.engine, out=_symlink(w, _victim(w))),
         "is a directory, not a file"),
    Case("out-through-a-symlink-loop", lambda w: w.run_ort(w.engine, out=_loop(w) / "x.wav"), "cannot be resolved"),
    Case("out-equals-codes-out", lambda w: w.run_ort(w.engine, "--codes-out", w.out), "name the same file"),
    Case("out-inside-checkpoint", lambda w: w.run_torch(w.ckpt, out=w.ckpt / "out.wav"), "lies inside"),
    Case("out-replaces-checkpoint-config", lambda w: w.run_torch(w.ckpt, out=w.ckpt / "config.json"), "lies inside"),
    Case("out-inside-engine", lambda w: w.run_ort(w.engine, out=w.engine / "x.wav"), "lies inside"),
    Case("out-is-ref-codes", lambda w: w.run_ort(w.engine, "--ref-codes", _ref(w, np.zeros((3, 8), int)),
                                                 out=w.tmp / "ref.npy"), "is an input of this command"),
    Case("out-a-hard-link-of-ref-codes", lambda w: w.run_ort(w.engine, "--ref-codes", _ref(w, np.zeros((3, 8), int)),
                                                            out=_hard_link(w.tmp / "ref.npy", w.tmp / "out.wav")),
         "out.wav: is an input of this command"),
    Case("out-a-name-too-long-for-its-temp-name", lambda w: w.run_ort(w.engine, out=w.tmp / ("z" * 230 + ".wav")),
         "name too long: it is written first under a temporary name"),  # "cannot be written in DIR (File name too long)"
    Case("out-parent-missing", lambda w: w.run_ort(w.engine, out=w.tmp / "no" / "such.wav"), "does not exist"),
    Case("out-parent-a-file", lambda w: w.run_ort(w.engine, out=_file(w) / "x.wav"), "is not a directory"),
    Case("out-inside-another-engine", lambda w: w.run_ort(w.engine, out=w.engine_copy() / MANIFEST),
         "engine, an engine directory; write somewhere else"),
    Case("out-inside-a-checkpoint-not-an-input", lambda w: w.run_ort(w.engine, out=w.ckpt / "config.json"),
         "a checkpoint; write somewhere else"),
    Case("codes-out-inside-another-engine", lambda w: w.run_ort(w.engine, "--codes-out", w.engine_copy() / "c.npy"),
         "an engine directory"),
    Case("calibrate-over-an-engine-manifest", lambda w: ["calibrate", "--checkpoint", w.ckpt, "--out",
                                                         w.engine / MANIFEST], "an engine directory"),
    Case("tiny-checkpoint-inside-an-engine", lambda w: ["tiny-checkpoint", w.engine / "ck"], "an engine directory"),
    Case("out-unwritable", lambda w: w.run_ort(w.engine, out=Path("/proc/x.wav")), "cannot be written in /proc"),
    Case("stream-out-unwritable", lambda w: w.run_ort(w.engine, "--stream", out=Path("/proc/x.wav")),
         "cannot be written in /proc"),
    Case("export-unwritable", lambda w: ["export", "--checkpoint", w.ckpt, "--out", "/proc/e"],
         "cannot be written in /proc"),
    Case("tiny-checkpoint-unwritable", lambda w: ["tiny-checkpoint", "/proc/ck"], "cannot be written in /proc"),
    Case("out-name-too-long", lambda w: w.run_ort(w.engine, out=w.tmp / ("a" * 250 + ".wav")), "name too long"),
    Case("codes-out-dash", lambda w: w.run_ort(w.engine, "--codes-out", "-"), "--codes-out takes a file path"),
    Case("export-over-a-directory-of-notes", lambda w: ["export", "--checkpoint", w.ckpt, "--out", _victim(w)],
         "holds no higgs-trt manifest.json"),
    Case("export-over-checkpoint-config", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.ckpt / "config.json"],
         "lies inside"),
    Case("export-over-the-checkpoint", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.ckpt], "is an input"),
    Case("export-over-a-parent-of-the-checkpoint", lambda w: ["export", "--checkpoint", w.ckpt, "--out", w.ckpt.parent],
         "contains"),
    Case("export-over-an-engine-with-notes", lambda w: ["export", "--checkpoint", w.ckpt, "--out", _engine_with_notes(w)],
         "holds files an engine directory does not (notes.txt)"),
    Case("export-over-an-engine-with-hidden-notes", lambda w: ["export", "--checkpoint", w.ckpt, "--out",
                                                               _engine_with_notes(w, ".my-notes.tmp")],
         "holds files an engine directory does not (.my-notes.tmp)"),
    Case("export-over-a-file", lambda w: ["export", "--checkpoint", w.ckpt, "--out",
                                          _file(w)], "is a file, not an engine"),
    Case("export-over-a-fifo", lambda w: ["export", "--checkpoint", w.ckpt, "--out", _mkfifo(w)], "is a fifo"),
    Case("build-over-a-directory-of-notes", lambda w: ["build", "--checkpoint", w.ckpt, "--out", _victim(w)],
         "holds no higgs-trt manifest.json"),
    Case("calibrate-over-a-directory", lambda w: ["calibrate", "--checkpoint", w.ckpt, "--out", _victim(w)],
         "is a directory, not a file"),
    Case("calibrate-inside-checkpoint", lambda w: ["calibrate", "--checkpoint", w.ckpt, "--out",
                                                   w.ckpt / "calibration.json"], "lies inside"),
    Case("compare-save-over-notes", lambda w: ["compare", "--engine", w.engine, "--save", _victim(w)],
         "holds files compare --save does not write (notes.txt)"),
    Case("compare-save-over-a-file", lambda w: ["compare", "--engine", w.engine, "--save", _file(w)], "is a file"),
    Case("compare-save-inside-engine", lambda w: ["compare", "--engine", w.engine, "--save", w.engine / "s"], "lies inside"),
    Case("tiny-checkpoint-over-notes", lambda w: ["tiny-checkpoint", _victim(w)], "holds no higgs-trt-random.json"),
    Case("tiny-checkpoint-over-a-real-checkpoint", lambda w: ["tiny-checkpoint", w.ckpt_file("higgs-trt-random.json", None)],
         "holds no higgs-trt-random.json"),
    Case("tiny-checkpoint-over-a-file", lambda w: ["tiny-checkpoint", _file(w)], "is a file"),
]

PROMPTS = [
    Case("a-fifo", lambda w: w.compare(_mkfifo(w)), "fifo: is a fifo, not a regular file"),
    Case("missing", lambda w: w.compare(w.tmp / "none.json"), "none.json: not found"),
    Case("not-json", lambda w: w.compare(w.prompts(b"[{")), "not valid JSON"),
    Case("not-utf8", lambda w: w.compare(w.prompts(b'[{"text": "caf\xe9"}]')), "not UTF-8 (byte 0xe9"),
    Case("an-object", lambda w: w.compare(w.prompts({"text": "hi"})), "expected a non-empty JSON list"),
    Case("empty-list", lambda w: w.compare(w.prompts([])), "expected a non-empty JSON list"),
    Case("item-a-string", lambda w: w.compare(w.prompts(["hi"])), 'prompt 0 is not a {"text": ...} object'),
    Case("item-without-text", lambda w: w.compare(w.prompts([{"ref_text": "x"}])), "prompt 0 is not a"),
    Case("text-a-number", lambda w: w.compare(w.prompts([{"text": 5}])), "prompt 0 text must be a string, got int"),
    Case("text-with-nul", lambda w: w.compare(w.prompts([{"text": "ok"}, {"text": "a\u0000b"}])),
         "prompt 1 text contains the control character U+0000"),
    Case("text-lone-surrogate", lambda w: w.compare(w.prompts(b'[{"text": "a\\ud800b"}]')), "not valid UTF-8"),
    Case("text-structural", lambda w: w.compare(w.prompts([{"text": "say <|audio|>"}])),
         "prompt 0: text may not contain the prompt token(s) <|audio|>"),
    Case("ref-codes-wrong-shape", lambda w: w.compare(w.prompts([{"text": "hi", "ref_codes": [[1] * 7] * 3}])),
         "must have shape [T, 8] with T ≥ 1, got [3, 7]"),
    Case("ref-codes-out-of-range", lambda w: w.compare(w.prompts([{"text": "hi", "ref_codes": [[1024] * 8]}])),
         "must lie in 0..1023"),
    Case("ref-codes-ragged", lambda w: w.compare(w.prompts([{"text": "hi", "ref_codes": [[1] * 8, [1]]}])),
         "a ragged or non-numeric list"),
    Case("ref-codes-floats", lambda w: w.compare(w.prompts([{"text": "hi", "ref_codes": [[0.5] * 8]}])),
         "must be integers"),
    Case("ref-codes-a-boolean", lambda w: w.compare(w.prompts([{"text": "hi", "ref_codes": [[1, True] + [1] * 6]}])),
         "reference codes must be integers, got a boolean"),  # numpy took true as the code 1
    Case("ref-codes-past-int64", lambda w: w.compare(w.prompts([{"text": "hi", "ref_codes": [[2**70] * 8]}])),
         "reference codes must lie in 0..1023"),  # "must be integers, got object"
    Case("ref-codes-a-string", lambda w: w.compare(w.prompts([{"text": "hi", "ref_codes": [["abc"] * 8]}])),
         "reference codes must be integers, got a string"),  # "got []"
    Case("ref-codes-nan", lambda w: w.compare(w.prompts(b'[{"text": "hi", "ref_codes": [[NaN, 1, 1, 1, 1, 1, 1, 1]]}]')),
         "NaN is not a JSON number"),
    Case("ref-text-without-codes", lambda w: w.compare(w.prompts([{"text": "hi", "ref_text": "x"}])),
         "ref_text without ref_codes"),
    Case("unknown-key", lambda w: w.compare(w.prompts([{"text": "hi", "ref_txt": "x"}])), "unknown key(s) 'ref_txt'"),
    Case("duplicate-key", lambda w: w.compare(w.prompts(b'[{"text": "a", "text": "b"}]')), "key 'text' appears twice"),
    Case("too-long-for-engine", lambda w: w.compare(w.prompts([{"text": "word " * 120}])),
         "prompt 0: text too long"),
    Case("nested-too-deeply", lambda w: w.compare(w.prompts(b"[" * 100_000 + b"]" * 100_000)), "nested too deeply"),
]

GROUPS = {"checkpoint": CHECKPOINT, "engine": ENGINE, "text": TEXT, "options": OPTIONS, "outputs": OUTPUTS,
          "prompts": PROMPTS}
CASES = [pytest.param(case, id=f"{group}/{case.name}") for group, cases in GROUPS.items() for case in cases]


def test_the_table_is_large_and_covers_every_kind():
    assert len(CASES) >= 60 and all(len(cases) >= 10 for cases in GROUPS.values())


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_in_one_line(case, tiny_ckpt, tiny_engine, tmp_path):
    if case.without_gpu and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    w = World(tmp_path, tiny_ckpt, tiny_engine)
    args = case.args(w)
    before = snapshot(tmp_path, tiny_ckpt, tiny_engine)
    code, stderr = higgs_subprocess(*args) if case.subprocess else higgs(*args)
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert code == 1, stderr
    assert len(errors) == 1 and case.message in errors[0], stderr
    assert "Traceback" not in stderr
    assert snapshot(tmp_path, tiny_ckpt, tiny_engine) == before, "the file system changed"


# ---- valid inputs are still accepted ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, options", [
    ("Hello 😀🎉 world, 👩‍👩‍👧 family.", ()),
    ("שלום עולם, مرحبا بالعالم", ()),
    ("zero\u200bwidth\u200djoiner\u200f and\ufeffmarks\u2060here", ()),
    ("Wow <|emotion:elation|> that is great <|prosody:pause|> indeed.", ()),
    ("Tabs\tand\nnew lines\r\nare fine.", ()),
    ("A very long seed.", ("--seed", str(2**63 - 1), "--temperature", "0.7")),
    ("A large top-k.", ("--top-k", str(10**12), "--top-p", "0.9")),
    ("Greedy.", ("--temperature", "0")),
    ("A nucleus below float32's range keeps the best code.", ("--top-p", "1e-300")),
])
def test_valid_inputs_are_accepted(tiny_engine, tmp_path, text, options):
    out = tmp_path / "out.wav"
    code, stderr = higgs("run", "--engine", tiny_engine, "--text", text, "--out", out, *options)
    assert code == 0, stderr
    assert out.stat().st_size > 44 and "Error" not in stderr


def test_a_model_with_fewer_positions_than_the_default_cache_takes_them_all(tiny_ckpt, tmp_path):
    """--max-seq (and --max-prompt) left out default to what the model allows, not to an error naming an option the
    user never gave."""
    from higgs_trt.builder.checkpoint import Checkpoint
    from higgs_trt.builder.export import engine_limits
    from higgs_trt.runtime.errors import HiggsError

    w = World(tmp_path, tiny_ckpt, None)
    ckpt = w.config(lambda text, raw: text.update(max_position_embeddings=600))
    code, stderr = higgs(*w.run_torch(ckpt))
    assert code == 0 and w.out.stat().st_size > 44, stderr
    config = Checkpoint(ckpt).config
    assert engine_limits(config, None, 8, None) == {"max_seq": 600, "max_batch": 8, "max_prompt": 300}
    with pytest.raises(HiggsError, match="--max-seq must lie in 16..600 .the model's max_position_embeddings., got 2048"):
        engine_limits(config, 2048, 8, None)


@pytest.mark.parametrize("argv, message", [
    (["run", "--engine", "E", "--text", "Hi.", "--out", ""], "an empty path names no file or directory"),
    (["tiny-checkpoint", ""], "an empty path names no file or directory"),
    (["export", "--checkpoint", "C", "--out", ""], "an empty path names no file or directory"),
    (["run", "--engine", ""], "an empty path names no file or directory"),
    (["run", "--engine", "E", "--text", "Hi.", "--out", "x.wav/"], "'x.wav/' names a directory"),
    (["run", "--engine", "E", "--text", "Hi.", "--out", "x.wav", "--codes-out", "c.npy/."], "'c.npy/.' names a directory"),
    (["run", "--engine", "E", "--text", "Hi.", "--out", "a" * 256], "a part of it is 256 bytes long"),  # traceback
    (["encode-audio", "--engine", "E", "--audio", "x" * 300 + ".wav", "--out", "c.npy"], "304 bytes long"),
], ids=["run-out", "tiny-checkpoint", "export-out", "run-engine", "out-slash", "codes-out-slash-dot", "out-256-bytes",
        "input-300-bytes"])
def test_an_empty_path_or_a_file_named_as_a_directory_is_a_usage_error(argv, message, tiny_ckpt, tiny_engine, tmp_path,
                                                                        monkeypatch):
    """Path("") is "." and Path("x.wav/") is "x.wav": `--out ""` was taken for the current directory ("Error: .: is a
    directory"), and `--out x.wav/` wrote the file x.wav."""
    monkeypatch.chdir(tmp_path)
    argv = [{"E": tiny_engine, "C": tiny_ckpt}.get(a, a) for a in argv]
    r = CliRunner().invoke(main, [str(a) for a in argv])
    assert r.exit_code == 2 and message in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stdout, message", [("/dev/full", "standard output: cannot write (No space left on device)"),
                                             (None, "--out -: standard output is closed")])
def test_streaming_to_a_stdout_that_fails_is_one_line(tiny_engine, stdout, message):
    run = [sys.executable, "-m", "higgs_trt.runtime.cli", "run", "--engine", str(tiny_engine), "--text", "Hi.",
           "--stream", "--out", "-"]
    if stdout is None:  # closed: the shell's >&-
        r = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *run], stderr=subprocess.PIPE, text=True)
    else:
        with open(stdout, "wb") as sink:
            r = subprocess.run(run, stdout=sink, stderr=subprocess.PIPE, text=True)
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 and errors == [f"Error: {message}"], r.stderr
    assert "Traceback" not in r.stderr


def test_out_dev_stdout_into_a_pipe_is_named_a_fifo(tiny_engine):
    """/dev/stdout resolves to /proc/PID/fd/pipe:[N], no path at all: 'cannot be written in /proc/PID/fd' before."""
    code, stderr = higgs_subprocess("run", "--engine", tiny_engine, "--text", "Hi.", "--out", "/dev/stdout")
    assert code == 1 and stderr.strip() == "Error: /dev/stdout: is a fifo, not a file; refusing to replace it", stderr


@pytest.mark.parametrize("command", ["tiny-checkpoint", "export", "encode-audio"])
def test_a_full_disk_is_one_line_and_leaves_nothing(command, tiny_ckpt, tiny_engine, tmp_path):
    """A file-size limit stands in for a full disk (write and close fail the same way): one Error line naming the
    output, nothing under its name, no litter beside it. Before: tracebacks from tiny-checkpoint (the safetensors
    writer's own error) and export, and encode-audio reported a truncated .npy as written (np.save's missed flush)."""
    import soundfile

    ref, out = tmp_path / "ref.wav", tmp_path / "out"
    soundfile.write(ref, np.random.default_rng(0).uniform(-0.5, 0.5, 3 * 24000), 24000, subtype="PCM_16")
    argv, limit = {"tiny-checkpoint": (["tiny-checkpoint", out], 100 << 10),  # past tokenizer.json: a shard fails
                   "export": (["export", "--checkpoint", tiny_ckpt, "--out", out], 100 << 10),
                   "encode-audio": (["encode-audio", "--engine", tiny_engine, "--audio", ref, "--out", out], 1024),
                   }[command]
    r = subprocess.run([sys.executable, "-m", "higgs_trt.runtime.cli", *map(str, argv)], capture_output=True,
                       text=True, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{out}" in errors[0] or "cannot write" in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.wav"]


@pytest.mark.parametrize("full", ["wav", "codes"])
def test_a_streamed_run_onto_a_full_disk_is_one_line_and_leaves_nothing(full, tiny_engine, tmp_path):
    """A truly full file system (a tmpfs: needs root), where the file-size limit above cannot stand in: flushing the
    growing wav failed again while it was being removed (a traceback, the partial file left), and a --codes-out that
    failed left the streamed wav's partial file beside its target."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        with open(disk / "fill", "wb") as f:
            try:
                f.write(bytes(1 << 20))
            except OSError:
                pass
        out = disk / "o.wav" if full == "wav" else tmp_path / "o.wav"
        extra = ["--codes-out", disk / "c.npy"] if full == "codes" else []
        code, stderr = higgs("run", "--engine", tiny_engine, "--text", "Hello there, a few words.", "--out", out,
                             "--stream", *extra)
        errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
        assert code == 1 and len(errors) == 1 and "No space left on device" in errors[0], stderr
        assert sorted(p.name for p in disk.iterdir()) == ["fill"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("command", ["tiny-checkpoint", "export"])
def test_an_empty_mount_point_as_out_is_refused_before_any_work(command, tiny_ckpt, tmp_path):
    """An output directory is swapped in by a rename, which a mount point refuses: before, the whole export ran, then
    a traceback (EBUSY) and an empty .NAME.higgs-trt-old.* directory were left. A real tmpfs mount: needs root."""
    out = tmp_path / "volume"
    out.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(out)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        argv = ["tiny-checkpoint", out] if command == "tiny-checkpoint" else ["export", "--checkpoint", tiny_ckpt,
                                                                             "--out", out]
        code, stderr = higgs(*argv)
        errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
        assert code == 1 and errors == [f"Error: {out}: is a mount point, which cannot be replaced; give a directory "
                                        "inside it"], stderr
        assert not any(out.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["volume"]
    finally:
        subprocess.run(["umount", str(out)], check=True)


def test_an_interrupt_that_python_only_prints_still_stops_the_output(tmp_path):
    """Ctrl-C landing inside a __del__ or a weakref callback: Python prints that KeyboardInterrupt and goes on (an
    export then put its output in place and exited 0); remembered, it stops the directory and the file from being
    put in place. Here the interrupt is sent from inside a __del__, where it is raised and only printed."""
    code = """
import os, signal, sys
from pathlib import Path
from higgs_trt.runtime import outputs

class Interrupting:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # the handler runs here and its KeyboardInterrupt is printed, not raised

signal.signal(signal.SIGINT, signal.default_int_handler)  # a job started in the background inherits SIGINT ignored
outputs.remember_interrupts()
try:
    with outputs.staged_dir(Path(sys.argv[1]) / "directory") as staging:
        (staging / "file").write_text("x")
        Interrupting()
except KeyboardInterrupt:
    try:
        outputs.write_file(Path(sys.argv[1]) / "file", lambda tmp: tmp.write_text("x"))
    except KeyboardInterrupt:
        sys.exit(130)
"""
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 130 and "KeyboardInterrupt" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


# ---- outputs: replaced only when they are what the command makes ---------------------------------------------------

def test_an_existing_file_and_a_symlinked_file_are_replaced(tiny_engine, tmp_path):
    from higgs_trt.runtime.outputs import umask

    out, real, link, new = tmp_path / "out.wav", tmp_path / "real.wav", tmp_path / "link.wav", tmp_path / "new.wav"
    out.write_text("old")
    out.chmod(0o600)
    real.write_text("old")
    link.symlink_to(real)
    for path in (out, link, new):
        code, stderr = higgs("run", "--engine", tiny_engine, "--text", "Hi.", "--out", path, "--temperature", "0")
        assert code == 0, stderr
    assert all(p.read_bytes()[:4] == b"RIFF" for p in (out, real, new))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # a replaced file keeps its permissions
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask()  # a new one gets the usual ones
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.wav", "new.wav", "out.wav", "real.wav"]


def test_tiny_checkpoint_replaces_its_own_output_also_through_a_symlink(tmp_path):
    out, link = tmp_path / "ck", tmp_path / "link"
    link.symlink_to(out)
    for seed, path in ((0, out), (1, out), (2, link)):
        code, stderr = higgs("tiny-checkpoint", path, "--seed", seed, "--shards", 1)
        assert code == 0, stderr
    assert json.loads((out / "higgs-trt-random.json").read_text())["seed"] == 2
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["ck", "link"]
    from higgs_trt.runtime.outputs import umask

    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask()}, modes  # safetensors' own files were 0600


def test_compare_save_replaces_an_earlier_save(tiny_engine, tiny_ckpt, tmp_path):
    save = tmp_path / "saved"
    for _ in range(2):
        code, stderr = higgs("compare", "--engine", tiny_engine, "--checkpoint", tiny_ckpt, "--runners", "torch,ort",
                             "--steps", 2, "--save", save)
        assert code == 0, stderr
    assert sorted(p.name for p in save.iterdir()) == ["inputs.json", "outputs.json", "report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_a_killed_export_leaves_the_old_engine_and_the_next_export_removes_its_litter(tiny_ckpt, tiny_engine, tmp_path):
    from higgs_trt.runtime.manifest import EngineDir

    target = shutil.copytree(tiny_engine, tmp_path / "engine")
    args = ["--checkpoint", tiny_ckpt, "--out", target, "--max-seq", 160, "--max-batch", 4, "--max-prompt", 96]
    child = subprocess.Popen([sys.executable, "-m", "higgs_trt.runtime.cli", "export", *map(str, args)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".engine.higgs-trt-staging.*/weights.bin")) and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    litter = list(tmp_path.glob(f".engine.higgs-trt-staging.{child.pid}.*"))
    assert len(litter) == 1, "the export was not caught mid-way"
    assert EngineDir(target).manifest["limits"]["max_seq"] == 160  # the old engine is intact

    from higgs_trt.runtime.outputs import staged_dir

    with pytest.raises(KeyboardInterrupt), staged_dir(target):  # the next export's first step, stopped right there
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]  # litter gone, nothing else left beside it
    EngineDir(target)


def test_a_terminated_export_cleans_up_after_itself(tiny_ckpt, tiny_engine, tmp_path):
    """SIGTERM (a supervisor stopping the command) is handled like Ctrl-C: the staging directory goes, the old engine
    stays, exit code 143, rather than the process dying where the signal landed and leaving its staging directory."""
    from higgs_trt.runtime.manifest import EngineDir

    target = shutil.copytree(tiny_engine, tmp_path / "engine")
    args = ["--checkpoint", tiny_ckpt, "--out", target, "--max-seq", 160, "--max-batch", 4, "--max-prompt", 96]
    child = subprocess.Popen([sys.executable, "-m", "higgs_trt.runtime.cli", "export", *map(str, args)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".engine.higgs-trt-staging.*/weights.bin")) and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 143 and "Traceback" not in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]
    assert EngineDir(target).manifest["limits"]["max_seq"] == 160


def test_only_the_litter_of_dead_processes_is_removed(tmp_path):
    from higgs_trt.runtime.outputs import remove_stale

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f".out.wav.higgs-trt-partial.{gone.pid}.abc123"
    live = tmp_path / f".out.wav.higgs-trt-partial.{os.getpid()}.def456"
    other = tmp_path / f".other.wav.higgs-trt-partial.{gone.pid}.ghi789"
    staging = tmp_path / f".out.wav.higgs-trt-staging.{gone.pid}.jkl012"
    for p in (dead, live, other):
        p.write_text("x")
    staging.mkdir()
    (staging / "weights.bin").write_text("x")
    assert sorted(remove_stale(tmp_path / "out.wav")) == sorted([dead, staging])
    assert live.exists() and other.exists()


# ---- decoding: greedy is reproducible, sampling always terminates --------------------------------------------------

def test_a_greedy_run_is_byte_identical_run_to_run(tiny_engine, tmp_path):
    files = []
    for i in range(2):
        wav, codes = tmp_path / f"{i}.wav", tmp_path / f"{i}.npy"
        code, stderr = higgs("run", "--engine", tiny_engine, "--text", "Same words, same audio.", "--out", wav,
                             "--codes-out", codes, "--temperature", "0")
        assert code == 0, stderr
        files.append((wav.read_bytes(), codes.read_bytes()))
    assert files[0] == files[1] and len(files[0][0]) > 44


def test_thirty_sampled_runs_all_terminate(tiny_engine):
    from higgs_trt.runtime.backends.ort import OrtBackend
    from higgs_trt.runtime.cli.engines import Sources, load_tokenizer
    from higgs_trt.runtime.decoding import Sampling, row_cap
    from higgs_trt.runtime.generate import generate
    from higgs_trt.runtime.manifest import EngineDir
    from higgs_trt.runtime.prompt import build_prompt
    from higgs_trt.runtime.stepper import HostStepper

    engine = EngineDir(tiny_engine)
    backend = HostStepper(OrtBackend(engine))
    prompt = build_prompt(load_tokenizer(Sources("ort", engine, None)), "Every decode ends.")
    cap = min(row_cap(prompt.text_chars), backend.max_seq - len(prompt))

    def hang(*_):
        raise TimeoutError("a sampled decode did not terminate")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(300)
    try:
        results = [generate(backend, [prompt], Sampling(temperature=1.0, seed=seed))[0] for seed in range(30)]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert all(r.stop_reason in ("eoc", "repeat", "cap") and r.rows <= cap for r in results)
    assert len({r.frames.tobytes() for r in results}) > 1  # the seeds do sample differently
