"""The inputs of a decode-attention step that starts from the q|k|v projection's rows, shared by the interpreter test
(tests/test_gpu_kernels.py, in its child process) and the H200 one (tests/test_gpu_engine.py)."""

import torch
from torch.onnx import ops as onnx_ops

from higgs_trt.builder.model import RMSNorm
from higgs_trt.plugins.rope_table import rope_table
from higgs_trt.runtime.config import HiggsConfig


def decode_rows(lengths: list[int], hq: int, hkv: int, d: int, s_max: int):
    """One q|k|v row per batch row, the q/k norm weights, the RoPE table, caches that are NaN from each row's new
    position on (the kernel writes that row and must read nothing past it), the positions, and the new keys as the
    formula gives them (normalised per head, rotated at the row's position, fp32) with the new values."""
    b = len(lengths)
    cos, sin = rope_table(HiggsConfig(64, 1, hq, hkv, d, 128, 100, 1e-6, 1e6, 32768), s_max, torch.bfloat16)
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    q_norm.weight.data = (1 + 0.1 * torch.randn(d)).bfloat16()
    k_norm.weight.data = (1 + 0.1 * torch.randn(d)).bfloat16()
    qkv = torch.randn(b, (hq + 2 * hkv) * d).bfloat16()
    kc, vc = torch.randn(b, hkv, s_max, d).bfloat16(), torch.randn(b, hkv, s_max, d).bfloat16()
    for i, n in enumerate(lengths):
        kc[i, :, n - 1:] = float("nan")
        vc[i, :, n - 1:] = float("nan")
    pos = torch.tensor(lengths) - 1
    x = qkv.view(b, 1, -1)
    with torch.no_grad():
        k = k_norm(x[..., hq * d:(hq + hkv) * d].reshape(b, 1, hkv, d)).transpose(1, 2)
    k_ref = onnx_ops.rotary_embedding(k.float(), cos.float(), sin.float(), pos[:, None])[:, :, 0]
    v = x[..., (hq + hkv) * d:].reshape(b, hkv, d)
    return qkv, q_norm.weight.data, k_norm.weight.data, cos, sin, kc, vc, pos, k_ref, v
