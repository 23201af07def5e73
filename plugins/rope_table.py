"""The RoPE table the kernels and the torch reference read. Torch only: no Triton here."""

import torch

from higgs_trt.runtime.config import HiggsConfig


def rope_table(cfg: HiggsConfig, max_seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq, D/2], computed in fp32 and rounded to bf16 as Higgs was trained."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    angles = torch.arange(max_seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().bfloat16().to(dtype), angles.sin().bfloat16().to(dtype)
