"""The engine directory's `manifest.json`: what was built from what, and the graph contracts.

The manifest records the checkpoint's fingerprint, precision, op path, cache and batch bounds, every graph's
I/O (names, shapes, dtypes), the tool version and a digest of every file. It is sealed with a hash of its own
content, so a hand-edited manifest or a file swapped in from another export is refused at load.
"""

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .errors import HiggsError
from .inputs import kind_of
from .jsonfile import read_json

MANIFEST = "manifest.json"
FORMAT = 1
SAMPLES = 64  # windows hashed in a large file
WINDOW = 1 << 16


def tool_version() -> str:
    try:
        return version("higgs-trt")
    except PackageNotFoundError:
        return "unknown"


def file_digest(path: Path) -> dict:
    """Full sha256 for files up to 64 MiB; size + 64 sampled 64 KiB windows for larger ones (weights)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLES * WINDOW * 16:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return {"bytes": size, "sha256": h.hexdigest()}
        for i in range(SAMPLES):
            f.seek((size - WINDOW) * i // (SAMPLES - 1))
            h.update(f.read(WINDOW))
    return {"bytes": size, "sampled_sha256": h.hexdigest()}


def _seal(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, manifest: dict, files: list[str]) -> None:
    """Seal `manifest` with the digests of `files` and write it (atomically: it is the directory's commit point)."""
    manifest = {**manifest, "format": FORMAT, "tool_version": tool_version(),
                "files": {f: file_digest(directory / f) for f in sorted(set(files))}}
    manifest.pop("manifest_sha256", None)
    manifest["manifest_sha256"] = _seal(manifest)
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / MANIFEST)


def _malformed(m: dict) -> str | None:
    """What a sealed manifest lacks that the runtime reads (a seal proves the content unchanged, not well-formed)."""
    files = m.get("files")
    if not isinstance(files, dict) or not all(isinstance(d, dict) for d in files.values()):
        return "no file list"
    outside = [n for n in files if n in ("", ".", "..") or "/" in n or "\\" in n]
    if outside:
        return f"names file(s) outside its directory: {', '.join(outside[:3])}"
    limits = m.get("limits")
    if not isinstance(limits, dict) or not all(type(limits.get(k)) is int and limits[k] > 0
                                               for k in ("max_seq", "max_batch", "max_prompt")):
        return "no valid limits"
    checkpoint = m.get("checkpoint")
    if m.get("precision") not in ("bf16", "fp8") or not (isinstance(checkpoint, dict)
                                                         and isinstance(checkpoint.get("fingerprint"), str)):
        return "no valid precision or checkpoint fingerprint"
    if not isinstance(m.get("model"), dict) or type(m["model"].get("text_vocab_size")) is not int:
        return "no model dimensions"
    strides = m.get("codec", {}).get("strides") if isinstance(m.get("codec"), dict) else None
    if not (isinstance(strides, list) and strides and all(type(s) is int and s > 0 for s in strides)):
        return "no valid codec strides"
    graphs = m.get("graphs")
    if not isinstance(graphs, dict) or not all(
            isinstance(g, dict) and g.get("file") in files and isinstance(g.get("inputs"), list)
            and isinstance(g.get("outputs"), list) for g in graphs.values()):
        return "no valid graph list"
    return None


class EngineDir:
    """A loaded, verified engine directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        file = self.path / MANIFEST
        if self.path.is_dir() and not file.exists():
            raise HiggsError(f"{self.path}: not an engine directory (no {MANIFEST}); create one with `higgs-trt export`")
        if not self.path.exists():
            raise HiggsError(f"{self.path}: not an engine directory (it does not exist); create one with `higgs-trt export`")
        self.manifest = read_json(file)  # strictly, as every JSON file a user hands us
        m = self.manifest
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise HiggsError(f"{file}: format {m.get('format') if isinstance(m, dict) else None!r} is not {FORMAT}; re-export")
        if m.get("manifest_sha256") != _seal(m):
            raise HiggsError(f"{file}: has been edited by hand (its seal does not match); re-export the engine directory")
        problem = _malformed(m)
        if problem:
            raise HiggsError(f"{file}: {problem}; re-export the engine directory")
        for name, digest in m["files"].items():
            path = self.path / name
            if not path.is_file():
                what = f"{kind_of(path.stat().st_mode)}, not a regular file" if path.exists() else "missing"
                raise HiggsError(f"{self.path}: {name} is {what}")
            if file_digest(path) != digest:
                raise HiggsError(f"{self.path}: {name} does not match the manifest (changed, or copied from another export)")

    @property
    def fingerprint(self) -> str:
        return self.manifest["checkpoint"]["fingerprint"]

    def check_checkpoint(self, fingerprint: str, checkpoint: Path) -> None:
        if fingerprint != self.fingerprint:
            raise HiggsError(f"{self.path} was built from another checkpoint than {checkpoint} "
                             f"(fingerprint {self.fingerprint[:12]}… vs {fingerprint[:12]}…)")

    def graph(self, name: str) -> dict:
        try:
            return self.manifest["graphs"][name]
        except KeyError:
            raise HiggsError(f"{self.path}: has no {name} graph (built with another precision or version?)") from None

    def file(self, name: str) -> Path:
        return self.path / self.graph(name)["file"]
