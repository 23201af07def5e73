"""A Higgs checkpoint directory, read by its own tensor names.

`model.safetensors` or a sharded `model.safetensors.index.json`; tensors are memory-mapped (safetensors'
`safe_open`), never copied to a renamed file. Consumers ask for the names and shapes they expect with
`take()`, which reports every missing or mis-shaped tensor in one error; tensors nobody asks for (codec encoders,
the semantic model, a stored text head) are simply never read.
"""

import hashlib
import itertools
import json
import math
import mmap
import re
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from higgs_trt.runtime.config import HiggsConfig, load_config
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.jsonfile import parse_json, read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LIST_LIMIT = 8  # names listed in one error before "and N more"
HEADER_LIMIT = 100_000_000  # the safetensors library refuses longer headers
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
# Float dtypes the model reads → (unsigned view, |x| bit mask, the bit pattern of inf): inf or NaN ⇔ |x| bits ≥ inf.
NONFINITE = {"BF16": (np.uint16, 0x7FFF, 0x7F80), "F16": (np.uint16, 0x7FFF, 0x7C00),
             "F32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
             "F64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
             "F8_E4M3": (np.uint8, 0x7F, 0x7F), "F8_E5M2": (np.uint8, 0x7F, 0x7C)}
FINITE_CHUNK = 1 << 24  # bytes read per step of the non-finite check
LAYER = re.compile(r"body\.layers\.(\d+)\.")


def _names(items: list[str]) -> str:
    more = f" and {len(items) - LIST_LIMIT} more" if len(items) > LIST_LIMIT else ""
    return ", ".join(items[:LIST_LIMIT]) + more


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, byte offset where tensor data starts) of a safetensors file.

    Checked by the rules the safetensors library applies when it opens the file (JSON object header, known dtypes,
    sizes matching shapes, tensors packed back to back over the whole data), so a bad file is refused here, in one
    line naming the file and the tensor, rather than deep inside a load."""
    def bad(problem: str) -> HiggsError:
        return HiggsError(f"{path}: not a valid safetensors file: {problem}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > min(size - 8, HEADER_LIMIT):
                raise bad(f"header length {n} runs past the end of the file" if n > size - 8
                          else f"header length {n} is over the library's limit")
            text = f.read(n).decode("utf-8")
    except OSError as e:
        raise HiggsError(f"{path}: unreadable ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise bad("header is not UTF-8") from None
    header = parse_json(text, f"{path} (safetensors header)")
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad("__metadata__ must map names to strings")
    data_size, spans = size - 8 - n, []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"tensor {name}: entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise bad(f"tensor {name}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"tensor {name}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise bad(f"tensor {name}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise bad(f"tensor {name}: data_offsets [{begin}, {end}] are reversed or negative")
        if end > data_size:
            raise HiggsError(f"{path}: truncated (tensor {name} ends past the end of the file)")
        if math.prod(shape) * DTYPE_BITS[dtype] != 8 * (end - begin):
            raise bad(f"tensor {name}: {dtype} {shape} does not take the {end - begin} bytes its data_offsets give")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, previous), (begin, _, name) in zip(spans, spans[1:]):
        if begin < end:
            raise bad(f"tensor {name} overlaps tensor {previous}")
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise bad(f"{begin - at} unused bytes before tensor {name}")
        at = end
    if at != data_size:
        raise bad(f"{data_size - at} bytes after the last tensor")
    return header, 8 + n


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
                if name in self._where:
                    raise HiggsError(f"{self.dir}: tensor {name} is in both {self._where[name].name} and {path.name}")
                self._where[name] = path
                self._info[name] = {**info, "data_start": data_start}
        self._check_layers()
        self._handles: dict[Path, object] = {}
        self._finite: set[str] = set()

    def _shard_files(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.exists():
            raw = read_json(index)
            weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise HiggsError(f"{index}: no weight_map object of tensor → file names")
            odd = [f for f in weight_map.values() if not isinstance(f, str) or f in ("", ".", "..") or Path(f).name != f]
            if odd:
                raise HiggsError(f"{index}: shard {odd[0]!r} is not a file name in {self.dir}")
            files = sorted({self.dir / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise HiggsError(f"{index}: shard(s) not found: {_names(missing)}")
            special = [f.name for f in files if not f.is_file()]  # a device, a fifo, a directory
            if special:
                raise HiggsError(f"{index}: shard(s) not regular files: {_names(special)}")
            return files
        if (self.dir / SINGLE_FILE).is_file():
            return [self.dir / SINGLE_FILE]
        raise HiggsError(f"{self.dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")

    def _check_layers(self) -> None:
        """config.json's layer count against the layers whose tensors are here, before anything is built from it."""
        layers: dict[int, list[str]] = {}
        for name in self._where:
            if m := LAYER.match(name):
                layers.setdefault(int(m.group(1)), []).append(name)
        n = self.config.num_layers
        extra = sorted(name for i, names in layers.items() if i >= n for name in names)
        if extra:
            raise HiggsError(f"{self.dir}: config.json says num_hidden_layers {n}, but the checkpoint holds "
                             f"{len(extra)} tensor(s) of layers past it: {_names(extra)}")
        absent = [str(i) for i in range(n) if i not in layers]
        if absent:
            raise HiggsError(f"{self.dir}: config.json says num_hidden_layers {n}, but the checkpoint holds no "
                             f"tensors of layer(s) {_names(absent)}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def dtype(self, name: str) -> str:
        """safetensors dtype string, e.g. 'BF16'."""
        return self._info[name]["dtype"]

    def nbytes(self, name: str) -> int:
        begin, end = self._info[name]["data_offsets"]
        return end - begin

    def raw_bytes(self, name: str) -> bytes:
        """The tensor's bytes as stored, read with plain file I/O (no mapping stays resident)."""
        info = self._info[name]
        begin, end = info["data_offsets"]
        with open(self._where[name], "rb") as f:
            f.seek(info["data_start"] + begin)
            return f.read(end - begin)

    def tensor(self, name: str) -> torch.Tensor:
        path = self._where[name]
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(str(path), framework="pt")
            return self._handles[path].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise HiggsError(f"{path}: cannot read tensor {name} ({e})") from None

    def check_finite(self, names) -> None:
        """Refuse inf or NaN in these tensors, naming the first found. The file is memory-mapped and each tensor
        tested 16 MiB at a time on its bits (|x|'s bits ≥ the bits of inf); pages are released as soon as they are
        tested, so resident memory stays flat (export's peak is unchanged). Costs one pass over the weights (`bench
        checkpoint`)."""
        todo = sorted((n for n in names if n not in self._finite),
                      key=lambda n: (self._where[n], self._info[n]["data_offsets"][0]))
        scratch = np.empty(FINITE_CHUNK, np.uint8)
        for path, group in itertools.groupby(todo, key=self._where.get):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                bad = next((n for n in group if not self._finite_in(n, mapped, scratch)), None)
            if bad:
                raise HiggsError(f"{self.dir}: tensor {bad} holds inf or NaN values")

    def _finite_in(self, name: str, mapped: mmap.mmap, scratch: np.ndarray) -> bool:
        view, mask, inf = NONFINITE[self.dtype(name)]
        begin, end = (self._info[name]["data_start"] + o for o in self._info[name]["data_offsets"])
        for at in range(begin, end, FINITE_CHUNK):
            k = min(FINITE_CHUNK, end - at)
            data = np.frombuffer(mapped, view, count=k // np.dtype(view).itemsize, offset=at)
            if np.bitwise_and(data, mask, out=scratch[:k].view(view)).max() >= inf:
                return False
            del data  # the mapping closes only once no array points into it
            page = at - at % mmap.PAGESIZE
            mapped.madvise(mmap.MADV_DONTNEED, page, at + k - page)
        self._finite.add(name)
        return True

    def take(self, expected: dict[str, tuple[int, ...]], what: str) -> dict[str, torch.Tensor]:
        """The expected tensors, memory-mapped, after one error naming every missing or mis-shaped one, then any
        of a dtype the model cannot use, then any holding inf or NaN."""
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
        bad = sorted(f"{n} ({self.dtype(n)})" for n in expected if self.dtype(n) not in NONFINITE)
        if bad:
            raise HiggsError(f"{self.dir}: {what}: tensor(s) of a dtype it cannot use: {_names(bad)} "
                             f"(expected {', '.join(NONFINITE)})")
        self.check_finite(expected)
        return {n: self.tensor(n) for n in expected}

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
