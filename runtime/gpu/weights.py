"""An engine directory's weights.bin read by checkpoint tensor names (the manifest's weights index), so that one engine
directory runs on every backend: the GPU engine loads the language model and the codec from it as from a checkpoint
(same `take`/`names`/`shape` calls), memory-mapped."""

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from higgs_trt.runtime.config import HiggsConfig
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.manifest import EngineDir

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class WeightSource(Protocol):
    """Tensors by their checkpoint names: a checkpoint directory (builder/checkpoint.py) or an engine directory's
    weights.bin (EngineWeights)."""

    dir: Path
    config: HiggsConfig

    def __contains__(self, name: str) -> bool: ...

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def take(self, expected: dict[str, tuple[int, ...]], what: str) -> dict[str, torch.Tensor]:
        """The tensors named in `expected`, every missing or mis-shaped one reported in one error."""


class EngineWeights(WeightSource):
    def __init__(self, engine: EngineDir):
        m = engine.manifest
        if "weights" not in m:
            raise HiggsError(f"{engine.path}: no weights index in its manifest (exported by an older version); re-export")
        self.dir = engine.path
        self.config = HiggsConfig(**m["model"])
        self.index = m["weights"]["tensors"]
        self.file = np.memmap(Path(engine.path) / m["weights"]["file"], dtype=np.uint8, mode="r")

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self) -> list[str]:
        return sorted(self.index)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index[name]["shape"])

    def tensor(self, name: str) -> torch.Tensor:
        e = self.index[name]
        raw = self.file[e["offset"]:e["offset"] + e["bytes"]]
        return torch.frombuffer(raw, dtype=DTYPES[e["dtype"]]).reshape(e["shape"])

    def take(self, expected: dict[str, tuple[int, ...]], what: str) -> dict[str, torch.Tensor]:
        missing = sorted(n for n in expected if n not in self.index)
        wrong = sorted(n for n, s in expected.items() if n in self.index and self.shape(n) != tuple(s))
        if missing or wrong:
            raise HiggsError(f"{self.dir}: the weights index lacks or mis-shapes {what} tensors "
                             f"({', '.join((missing + wrong)[:4])}…); re-export")
        return {n: self.tensor(n) for n in expected}
