"""The torch reference as a decode-loop backend (`higgs-trt run --backend torch`)."""

from pathlib import Path

import numpy as np
import torch

from .checkpoint import Checkpoint
from .codec import CodecDecoder
from .model import HiggsLM


class TorchBackend:
    name = "torch"

    def __init__(self, checkpoint: Path | Checkpoint, max_seq: int = 2048, max_batch: int = 8,
                 dtype: torch.dtype | None = None, device: str | None = None):
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.max_seq, self.max_batch = max_seq, max_batch
        self.checkpoint = ckpt
        self.model = HiggsLM.from_checkpoint(ckpt, max_seq, dtype).to(self.device)
        self.codec_model = CodecDecoder.from_checkpoint(ckpt).to(self.device)
        self.caches: tuple[torch.Tensor, ...] = ()

    def start(self, batch: int) -> None:
        self.caches = self.model.new_caches(batch, self.device)

    @torch.inference_mode()
    def lm(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        inputs = {k: torch.from_numpy(v).to(self.device) for k, v in feeds.items()}
        logits, codes, *self.caches = self.model(**inputs, caches=self.caches)
        return logits.cpu().numpy(), codes.cpu().numpy()

    @torch.inference_mode()
    def codec(self, codes: np.ndarray) -> np.ndarray:
        return self.codec_model(torch.from_numpy(codes).to(self.device)).cpu().numpy()
