"""A Higgs checkpoint directory, read by its own tensor names.

`model.safetensors` or a sharded `model.safetensors.index.json`; tensors are memory-mapped (safetensors'
`safe_open`), never copied to a renamed file. Consumers ask for the names and shapes they expect with
`take()`, which reports every missing or mis-shaped tensor in one error; tensors nobody asks for (codec encoders,
the semantic model, a stored text head) are simply never read.
"""

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from higgs_trt.runtime.errors import HiggsError

from .config import HiggsConfig, load_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LIST_LIMIT = 8  # names listed in one error before "and N more"


def _names(items: list[str]) -> str:
    more = f" and {len(items) - LIST_LIMIT} more" if len(items) > LIST_LIMIT else ""
    return ", ".join(items[:LIST_LIMIT]) + more


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, byte offset where tensor data starts) of a safetensors file, checked for sanity."""
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header length beyond end of file")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise HiggsError(f"{path}: not a readable safetensors file ({e})") from None
    data_start = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if data_start + end > size:
            raise HiggsError(f"{path}: truncated (tensor {name} ends past the end of the file)")
    header.pop("__metadata__", None)
    return header, data_start


class Checkpoint:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise HiggsError(f"{self.dir}: checkpoint directory not found")
        self.config: HiggsConfig = load_config(self.dir)
        self.files = self._shard_files()
        self._where: dict[str, Path] = {}
        self._info: dict[str, dict] = {}
        for path in self.files:
            header, data_start = read_safetensors_header(path)
            for name, info in header.items():
                self._where[name] = path
                self._info[name] = {**info, "data_start": data_start}
        self._handles: dict[Path, object] = {}

    def _shard_files(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HiggsError(f"{index}: unreadable index ({e})") from None
            files = sorted({self.dir / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise HiggsError(f"{index}: shard(s) not found: {_names(missing)}")
            return files
        if (self.dir / SINGLE_FILE).exists():
            return [self.dir / SINGLE_FILE]
        raise HiggsError(f"{self.dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def dtype(self, name: str) -> str:
        """safetensors dtype string, e.g. 'BF16'."""
        return self._info[name]["dtype"]

    def raw_bytes(self, name: str) -> bytes:
        """The tensor's bytes as stored, read with plain file I/O (no mapping stays resident)."""
        info = self._info[name]
        begin, end = info["data_offsets"]
        with open(self._where[name], "rb") as f:
            f.seek(info["data_start"] + begin)
            return f.read(end - begin)

    def tensor(self, name: str) -> torch.Tensor:
        path = self._where[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)

    def take(self, expected: dict[str, tuple[int, ...]], what: str) -> dict[str, torch.Tensor]:
        """The expected tensors, memory-mapped; one error naming every missing or mis-shaped one."""
        missing = sorted(n for n in expected if n not in self._where)
        wrong = sorted(f"{n} is {list(self.shape(n))}, expected {list(s)}"
                       for n, s in expected.items() if n in self._where and self.shape(n) != tuple(s))
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
        if wrong:
            problems.append(f"{len(wrong)} tensor(s) of the wrong shape: {_names(wrong)}")
        if problems:
            raise HiggsError(f"{self.dir}: {what} does not match config.json: " + "; ".join(problems))
        tensors = {n: self.tensor(n) for n in expected}
        bad = sorted(n for n, t in tensors.items() if not t.dtype.is_floating_point)
        if bad:
            raise HiggsError(f"{self.dir}: {what}: non-float tensor(s) {_names(bad)}")
        return tensors

    def fingerprint(self) -> str:
        """Identity of config + weights, cheap enough for a 9 GB checkpoint.

        Hashes config.json, every safetensors header (names, dtypes, shapes, offsets) and three 256-byte
        samples of every tensor's data (start, middle, end). Different checkpoints differ in all of these;
        a single edited weight is left to the numerical comparisons to find.
        """
        h = hashlib.blake2b(digest_size=16)
        h.update((self.dir / "config.json").read_bytes())
        for path in self.files:
            header, data_start = read_safetensors_header(path)
            h.update(json.dumps(header, sort_keys=True).encode())
            with open(path, "rb") as f:
                for name in sorted(header):
                    begin, end = header[name]["data_offsets"]
                    for at in sorted({begin, (begin + end) // 2, max(begin, end - 256)}):
                        f.seek(data_start + at)
                        h.update(f.read(min(256, end - at)))
        return h.hexdigest()
