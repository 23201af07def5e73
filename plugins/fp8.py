"""The FP8 number format every FP8 path shares: E4M3 codes, per-tensor activation scales and per-row weight scales,
each scale amax/448 rounded to bf16 once, so the ONNX Q/DQ graphs (calibration/qdq.py), the GPU engine's linear and
its kernels quantize with identical scales. Torch only: no Triton here."""

import torch

FP8_MAX = 448.0  # the largest finite E4M3 value
FP8_CODES = torch.float8_e4m3fn


def bf16_scale(amax) -> torch.Tensor:
    """amax/448 rounded to bf16 (never zero), as fp32."""
    scale = (torch.as_tensor(amax, dtype=torch.float32) / FP8_MAX).bfloat16().float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] → (FP8 E4M3 [N, K], per-row scale [N] fp32): round to nearest even, clipped to ±448."""
    w = w.float()
    scale = bf16_scale(w.abs().amax(dim=1))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_CODES), scale


def fake_quantize_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] as an FP8 engine multiplies it: quantized per row (quantize_weight), dequantized to fp32."""
    codes, scale = quantize_weight(w)
    return codes.float() * scale[:, None]
