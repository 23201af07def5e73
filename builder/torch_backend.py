"""The torch reference as an engine graph (`--backend torch` on the CPU): fp32, caches in slots like the engines'."""

from pathlib import Path

import numpy as np
import torch

from higgs_trt.runtime.gpu.codec import CodecDecoder
from higgs_trt.runtime.request import MIN_ROWS

from .checkpoint import Checkpoint
from .model import HiggsLM


class TorchBackend:
    name = "torch"

    def __init__(self, checkpoint: Path | Checkpoint, max_seq: int = 2048, max_batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        self.device = torch.device(device)
        self.max_seq, self.max_batch, self.max_prompt = max_seq, max_batch, max_seq - MIN_ROWS
        self.checkpoint = ckpt
        self.model = HiggsLM.from_checkpoint(ckpt, max_seq, dtype).to(self.device)
        self.codec_model = CodecDecoder.from_checkpoint(ckpt).to(self.device)
        self.codec_strides = self.codec_model.dims.strides
        self.caches = self.model.new_caches(max_batch, self.device)

    @torch.inference_mode()
    def lm(self, feeds: dict[str, np.ndarray], slot: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One graph call on slot `slot` (batch 1), or on the first B slots."""
        rows = slice(slot, slot + 1) if slot is not None else slice(0, len(feeds["write_pos"]))
        caches = tuple(c[rows] for c in self.caches)
        inputs = {k: torch.from_numpy(v).to(self.device) for k, v in feeds.items()}
        logits, codes, *updated = self.model(**inputs, caches=caches)
        for cache, new in zip(caches, updated):
            cache.copy_(new)
        return logits.cpu().numpy(), codes.cpu().numpy()

    def read_cache(self, slot: int, positions: int) -> list[torch.Tensor]:
        """A copy of the keys and values of cache rows [0, positions) of `slot` (the prefix cache's)."""
        return [cache[slot, :, :positions].clone() for cache in self.caches]

    def write_cache(self, slot: int, rows: list[torch.Tensor]) -> None:
        for cache, kept in zip(self.caches, rows):
            cache[slot, :, :kept.shape[1]] = kept

    @torch.inference_mode()
    def codec(self, codes: np.ndarray) -> np.ndarray:
        return self.codec_model(torch.from_numpy(codes).to(self.device)).cpu().numpy()


def bf16_reference(ckpt: Checkpoint, device: str | None = None) -> TorchBackend:
    """The BF16 torch reference that FP8 calibration and the accuracy gate observe (calibration/calibrate.observe):
    batch 1, a cache long enough for the prompt set, on the GPU when torch sees one."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return TorchBackend(ckpt, max_seq=1024, max_batch=1, dtype=torch.bfloat16, device=device)
