"""The plugin op path (`--ops plugin`): the fused steps as TensorRT plugin nodes.

In torch they are custom ops whose eager bodies are the reference semantics (the native path's ops, so both paths
compute the same thing); under dynamo export they become bare `higgs::rope_kv_write`,
`higgs::decode_attention` and `higgs::delayed_codebook_step` nodes (plugins/schemas.py registers their schemas), to which the exporter attaches
model-local functions with the same semantics in standard ops, so ONNX Runtime runs the same file.
"""

import torch
import torch.nn.functional as F
from torch.onnx import ops as onnx_ops

from higgs_trt.plugins import schemas

from .ops import NativeOps


@torch.library.custom_op("higgs::rope_kv_write", mutates_args=())
def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  write_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    positions = write_pos[:, None] + torch.arange(q.shape[2], device=q.device)[None, :]
    q = onnx_ops.rotary_embedding(q, cos, sin, positions)
    k = onnx_ops.rotary_embedding(k, cos, sin, positions)
    return q, torch.ops.higgs.cache_write(k_cache, k, write_pos), torch.ops.higgs.cache_write(v_cache, v, write_pos)


@rope_kv_write.register_fake
def _(q, k, v, cos, sin, write_pos, k_cache, v_cache):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)


@torch.library.custom_op("higgs::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     write_pos: torch.Tensor) -> torch.Tensor:
    """q [B,Hq,S,D] (scaled) at positions write_pos[b] + s over the caches' keys 0..position → [B,Hq,S,D]."""
    positions = write_pos[:, None] + torch.arange(q.shape[2], device=q.device)[None, :]
    keys = torch.arange(k_cache.shape[2], device=q.device)
    mask = keys[None, None, None, :] <= positions[:, None, :, None]
    return onnx_ops.attention(q, k_cache, v_cache, mask, scale=1.0)[0]


@decode_attention.register_fake
def _(q, k_cache, v_cache, write_pos):
    return torch.empty_like(q)


@torch.library.custom_op("higgs::delayed_codebook_step", mutates_args=())
def delayed_codebook_step(logits: torch.Tensor, row_index: torch.Tensor, end_frame: torch.Tensor,
                          table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes = NativeOps.codebook_step(logits, row_index, end_frame)
    offsets = torch.arange(logits.shape[1], device=logits.device) * logits.shape[2]
    embedding = F.embedding(codes + offsets, table).float().sum(dim=1).to(table.dtype)
    return codes, embedding


@delayed_codebook_step.register_fake
def _(logits, row_index, end_frame, table):
    b = logits.shape[0]
    return logits.new_empty((b, logits.shape[1]), dtype=torch.int32), table.new_empty((b, table.shape[1]))


def _rope_kv_write_onnx(q, k, v, cos, sin, write_pos, k_cache, v_cache):
    return schemas.opset().rope_kv_write(q, k, v, cos, sin, write_pos, k_cache, v_cache, **schemas.PLUGIN_ATTRIBUTES)


def _decode_attention_onnx(q, k_cache, v_cache, write_pos):
    return schemas.opset().decode_attention(q, k_cache, v_cache, write_pos, **schemas.PLUGIN_ATTRIBUTES)


def _delayed_codebook_step_onnx(logits, row_index, end_frame, table):
    return schemas.opset().delayed_codebook_step(logits, row_index, end_frame, table, **schemas.PLUGIN_ATTRIBUTES)


class PluginOps:
    """The `--ops plugin` path: same interface as builder.ops.NativeOps."""

    name = "plugin"
    attention = "plugin"  # higgs::decode_attention: no choice of attention layers to make
    translations = {**NativeOps.translations,
                    torch.ops.higgs.rope_kv_write.default: _rope_kv_write_onnx,
                    torch.ops.higgs.decode_attention.default: _decode_attention_onnx,
                    torch.ops.higgs.delayed_codebook_step.default: _delayed_codebook_step_onnx}

    @staticmethod
    def rope_cache_attention(q, k, v, cos, sin, positions, write_pos, k_cache, v_cache, mask):
        # decode_attention reads each row's valid prefix only; the graph's Attention would read all S_max rows
        # (docs/tensorrt.md, "KV-cache bytes per step")
        q, k_cache, v_cache = torch.ops.higgs.rope_kv_write(q, k, v, cos, sin, write_pos, k_cache, v_cache)
        out = torch.ops.higgs.decode_attention(q * q.shape[-1] ** -0.5, k_cache, v_cache, write_pos)
        return out, k_cache, v_cache

    @staticmethod
    def codebook_step(logits, row_index, end_frame, table):
        # the plugin also returns the next row's input embedding; this graph embeds the codes at its input instead
        return torch.ops.higgs.delayed_codebook_step(logits, row_index, end_frame, table)[0]
