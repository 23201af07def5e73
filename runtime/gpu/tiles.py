"""The linear kernel's tile shapes (TileConfig: they fix the K order every row is summed in, so a row's numbers do not
depend on the batch), the default for a shape no table names, and the tuned tables: one JSON file per GPU model in
runtime/gpu/tiles/, written by `higgs-trt bench linear --write` and read when an engine starts.

A GPU without a file of its own takes the table of a GPU with the same compute capability and multiprocessor count
(an H100 SXM takes the H200's: same SMs, same shared memory); failing that, default_tiles for every shape."""

import json
from dataclasses import asdict, dataclass, fields
from functools import cache
from pathlib import Path

import torch

TILES_DIR = Path(__file__).with_name("tiles")
SHARED_MEMORY = 200 * 1024  # of Hopper's 227 KiB per block, leaving room for the compiler's own
NESTED = ("wide", "wide32", "prefill")

Key = tuple[int, int, bool]  # (N, K, fp8) of a weight


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_k: int
    split_k: int
    warps: int = 4
    stages: int = 4
    in_program_from: int = 64  # x rows per product (16/32/64) from which the K ranges run in one program
    rows: int = 64  # the most x rows per product; more rows go to more programs
    persistent: int = 0  # split programs: this many per multiprocessor, each taking every n-th unit (0: one per unit)
    wide: "TileConfig | None" = None  # the tiles for 17 to 64 rows of x (a decode step's batch)
    wide32: "TileConfig | None" = None  # the tiles for 17 to 32 rows, where they differ from the wide ones
    prefill: "TileConfig | None" = None  # the tiles of every prefill pass, whatever its rows
    tma: bool = False  # tiles by bulk tensor copies (Hopper's TMA) instead of per-thread loads: the same sums
    # under PDL, the next kernel's programs launch as these tiles' programs finish instead of as soon as all of them
    # have started: the same sums; whether it is faster is measured per shape, why is not established
    late_launch: bool = False

    def __post_init__(self):
        # A row's numbers depend on the K ranges and on the MMA instruction (16 or 32 weight rows: mma.sync; 64 or
        # more: Hopper's wgmma), nothing else: the wide tiles may change anything but those. The prefill tiles may
        # change those too: a prompt's rows are only ever summed by a prefill and every prefill takes them (one
        # prompt or many, any number of rows), so prefills agree with each other, decode steps with each other.
        for wide in (self.wide, self.wide32):
            if wide is not None and (wide.split_k != self.split_k or (wide.block_n >= 64) != (self.block_n >= 64)):
                raise ValueError(f"tiles {wide} would sum rows differently from {self}")
        for other in (self.wide, self.wide32, self.prefill):
            if other is not None and (other.wide or other.wide32 or other.prefill):
                raise ValueError(f"tiles {other} nest tiles of their own")

    def for_rows(self, m: int, prefill: bool = False) -> "TileConfig":
        if prefill and self.prefill is not None:
            return self.prefill
        if 16 < m <= 32 and self.wide32 is not None:
            return self.wide32
        return self.wide if self.wide is not None and m > 16 else self


def default_tiles(n: int, k: int, fp8: bool, device: str = "cuda") -> TileConfig:
    """Enough programs for every SM several times over (a GEMV is bound by its weight read), 16 weight rows
    each, K split when the columns alone give too few programs. `higgs-trt bench linear` measures alternatives.
    On the CPU (Triton's interpreter, tests only) few large programs are fastest."""
    if device == "cpu":
        return TileConfig(64, 64, 1)
    block_n = 16
    split = 1
    while (n // block_n) * split < 512 and split < 8:
        split *= 2
    return TileConfig(block_n, 512 if fp8 else 256, split)


def stage_bytes(block_n: int, block_k: int, rows: int, fp8: bool, gated: bool) -> int:
    """Shared memory of one pipeline stage: a weight tile (two when gated) and the x rows' tile."""
    return block_k * (block_n * (1 if fp8 else 2) * (2 if gated else 1) + rows * 2)


def _to_json(tiles: TileConfig) -> dict:
    """The fields that differ from TileConfig's defaults, nested tiles likewise."""
    defaults = {f.name: f.default for f in fields(TileConfig)}
    out = {}
    for name, value in asdict(tiles).items():
        if name in NESTED:
            value = getattr(tiles, name)
            if value is not None:
                out[name] = _to_json(value)
        elif name not in defaults or value != defaults[name]:
            out[name] = value
    return out


def _from_json(entry: dict) -> TileConfig:
    return TileConfig(**{k: _from_json(v) if k in NESTED else v for k, v in entry.items()})


def read_table(path: Path) -> dict[Key, TileConfig]:
    raw = json.loads(Path(path).read_text())
    return {(e["n"], e["k"], e["fp8"]): _from_json(e["tiles"]) for e in raw["tiles"]}


def file_name(gpu: str) -> str:
    """The table file of a GPU model: its name in lower case, words joined by '-' (NVIDIA H200 → nvidia-h200.json)."""
    return "-".join(gpu.lower().split()) + ".json"


def write_table(table: dict[Key, TileConfig], device, directory: Path = TILES_DIR) -> Path:
    """The table as the file of `device`'s GPU model, with what the fallback rule matches on."""
    props = torch.cuda.get_device_properties(device)
    path = Path(directory) / file_name(props.name)
    body = {"gpu": props.name, "compute_capability": [props.major, props.minor],
            "multiprocessors": props.multi_processor_count, "written_by": "higgs-trt bench linear --write",
            "tiles": [{"n": n, "k": k, "fp8": fp8, "tiles": _to_json(t)} for (n, k, fp8), t in sorted(table.items())]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)
    return path


@cache
def _table_of(gpu: str, capability: tuple[int, int], multiprocessors: int) -> dict[Key, TileConfig]:
    own = TILES_DIR / file_name(gpu)
    if own.is_file():
        return read_table(own)
    for path in sorted(TILES_DIR.glob("*.json")):
        raw = json.loads(path.read_text())
        if tuple(raw["compute_capability"]) == capability and raw["multiprocessors"] == multiprocessors:
            return read_table(path)
    return {}


def tuned_tiles(device="cuda") -> dict[Key, TileConfig]:
    """This GPU's table (module docstring); empty on the CPU. One dict per GPU model for the process: a tile sweep
    that writes into it changes the tiles every later Linear takes."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    return _table_of(props.name, (props.major, props.minor), props.multi_processor_count)
