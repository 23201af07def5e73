"""The two model steps that TensorRT gets as dedicated layers or plugins, in their native-path form.

In eager torch each function computes the reference semantics; under `torch.onnx.export(dynamo=True)` they
become the ONNX ops TensorRT maps to native layers:

- RoPE + KV-cache write + attention → `RotaryEmbedding`-23, `TensorScatter`-24, and `Attention`-23 (TensorRT's
  attention layer) or, with `--attention matmul`, MatMul + Softmax (`MatmulAttentionOps`, which every TensorRT builds);
- delayed-codebook step → `ArgMax` + `Less`/`Where` (ramp-up BOC, ramp-down EOC).
"""

import torch
from torch.onnx import ops as onnx_ops

from higgs_trt.runtime.decoding import BOC, EOC

ONNX_OPSET = 24  # TensorScatter is opset 24; RotaryEmbedding and Attention are 23


@torch.library.custom_op("higgs::cache_write", mutates_args=())
def cache_write(cache: torch.Tensor, update: torch.Tensor, write_pos: torch.Tensor) -> torch.Tensor:
    """cache [B,H,S_max,D] with update [B,H,S,D] written at rows write_pos[b] .. write_pos[b]+S-1."""
    rows = write_pos[:, None] + torch.arange(update.shape[2], device=update.device)[None, :]
    index = rows[:, None, :, None].expand(-1, update.shape[1], -1, update.shape[3])
    return cache.scatter(2, index, update)


@cache_write.register_fake
def _(cache, update, write_pos):
    return torch.empty_like(cache)


def cache_write_onnx(cache, update, write_pos):
    from onnxscript.values import Opset  # export-time only: onnxscript is slow to import

    return Opset("", ONNX_OPSET).TensorScatter(cache, update, write_pos, axis=-2, mode="linear")


ONNX_TRANSLATIONS = {torch.ops.higgs.cache_write.default: cache_write_onnx}


class NativeOps:
    """Standard-ONNX form of the two fused steps (the `--ops native` path), attention as ONNX `Attention`."""

    name = "native"
    attention = "fused"
    translations = ONNX_TRANSLATIONS

    @classmethod
    def rope_cache_attention(cls, q, k, v, cos, sin, positions, write_pos, k_cache, v_cache, mask):
        """q [B,Hq,S,D], k/v [B,Hkv,S,D] → attention output [B,Hq,S,D] and the updated caches.

        q is scaled by 1/sqrt(D) before attention because TensorRT's attention layer has no scale of its own.
        """
        q = onnx_ops.rotary_embedding(q, cos, sin, positions)
        k = onnx_ops.rotary_embedding(k, cos, sin, positions)
        k_cache = torch.ops.higgs.cache_write(k_cache, k, write_pos)
        v_cache = torch.ops.higgs.cache_write(v_cache, v, write_pos)
        return cls.attend(q * q.shape[-1] ** -0.5, k_cache, v_cache, mask), k_cache, v_cache

    @staticmethod
    def attend(q, k_cache, v_cache, mask):
        """q [B,Hq,S,D] (scaled) over the caches [B,Hkv,S_max,D] where mask [B,1,S,S_max] allows → [B,Hq,S,D]."""
        return onnx_ops.attention(q, k_cache, v_cache, mask, scale=1.0)[0]

    @staticmethod
    def codebook_step(logits, row_index, end_frame, table=None):
        """logits [B,K,V] fp32 → codes [B,K] int32: argmax (lowest index on ties) + the delay mask."""
        codebook = torch.arange(logits.shape[1], device=logits.device)[None, :]
        row = row_index[:, None]
        codes = torch.argmax(logits, dim=-1)
        codes = torch.where(row < codebook, BOC, codes)
        codes = torch.where(row - codebook >= end_frame[:, None], EOC, codes)
        return codes.to(torch.int32)


class MatmulAttentionOps(NativeOps):
    """The native path with attention as MatMul + Softmax (`--attention matmul`): layers every TensorRT version
    builds, where the attention layer needs a fused kernel for the GPU and profile (or its decomposed fallback)."""

    attention = "matmul"

    @staticmethod
    def attend(q, k_cache, v_cache, mask):
        """Grouped-query attention without repeating the caches: query heads [B, Hkv, G, S, D] against each KV head
        [B, Hkv, 1, S_max, D]; scores and softmax in fp32, as the attention layer accumulates."""
        b, hq, s, d = q.shape
        hkv = k_cache.shape[1]
        q = q.reshape(b, hkv, hq // hkv, s, d)
        scores = torch.matmul(q, k_cache.unsqueeze(2).transpose(-1, -2)).float()
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(weights, v_cache.unsqueeze(2)).reshape(b, hq, s, d)
