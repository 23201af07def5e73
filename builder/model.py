"""Higgs Audio v3 language model in torch: Qwen3 backbone + fused audio embedding + tied 8-codebook head.

One forward serves prefill and decode: S new positions (S = prompt length, or 1 for a step) are embedded,
written into static KV caches [B, Hkv, S_max, D] at write_pos.., attended causally over the cache, and the
last valid position's hidden state gives logits [B, 8, 1026] and the next row of codes. This is the torch
reference and, exported with dynamo, the `lm` graph of the engine directory.

Module names mirror the checkpoint (`body.layers.0.self_attn.q_proj.weight`, `tied.embedding...`), so the
state dict *is* the checkpoint's tensors, loaded memory-mapped with `assign=True`, and ONNX initializers keep
the checkpoint's names. Weights stay bf16; `dtype` is the compute dtype (bf16 for TensorRT, fp32 for the
ONNX Runtime reference twin: fp32 math on bf16-rounded weights).
"""

import torch
import torch.nn.functional as F
from torch import nn

from higgs_trt.plugins.rope_table import rope_table
from higgs_trt.runtime.config import HiggsConfig, lm_tensor_shapes

from .checkpoint import Checkpoint
from .ops import NativeOps


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x):
        # As a 2-D product the export is Gemm(x, W, transB=1) on the checkpoint's own tensor (no transposed copy).
        y = F.linear(x.reshape(-1, x.shape[-1]), self.weight.to(x.dtype))
        return y.reshape(*x.shape[:-1], -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=torch.bfloat16), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: HiggsConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, ops, rope, positions, write_pos, k_cache, v_cache, mask):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out, k_cache, v_cache = ops.rope_cache_attention(q, k, v, *rope, positions, write_pos, k_cache, v_cache, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), k_cache, v_cache


class MLP(nn.Module):
    def __init__(self, cfg: HiggsConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HiggsConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, ops, rope, positions, write_pos, k_cache, v_cache, mask):
        a, k_cache, v_cache = self.self_attn(self.input_layernorm(h), ops, rope, positions, write_pos, k_cache, v_cache, mask)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), k_cache, v_cache


class HiggsLM(nn.Module):
    def __init__(self, cfg: HiggsConfig, max_seq: int, dtype: torch.dtype = torch.float32, ops=NativeOps):
        super().__init__()
        self.cfg, self.max_seq, self.dtype, self.ops = cfg, max_seq, dtype, ops
        self.body = nn.Module()
        self.body.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.body.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        audio = nn.ModuleDict({"embedding": Embedding(cfg.audio_table_rows, cfg.hidden_size)})
        self.tied = nn.ModuleDict({"embedding": nn.ModuleDict({
            "text_embedding": Embedding(cfg.text_vocab_size, cfg.hidden_size),
            "modality_embeddings": nn.ModuleList([audio]),
        })})
        cos, sin = rope_table(cfg, max_seq, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("codebook_offsets", torch.arange(cfg.num_codebooks) * cfg.codebook_vocab, persistent=False)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, max_seq: int, dtype: torch.dtype = torch.float32, ops=NativeOps):
        weights = ckpt.take(lm_tensor_shapes(ckpt.config), "language model")
        with torch.device("meta"):
            model = cls(ckpt.config, max_seq, dtype, ops)
        model.load_state_dict({n: t.to(torch.bfloat16) for n, t in weights.items()}, strict=False, assign=True)
        cos, sin = rope_table(ckpt.config, max_seq, dtype)  # buffers made on meta above; real ones here
        model.rope_cos, model.rope_sin = cos, sin
        model.codebook_offsets = torch.arange(ckpt.config.num_codebooks) * ckpt.config.codebook_vocab
        return model.eval()

    @property
    def audio_table(self) -> torch.Tensor:
        return self.tied["embedding"]["modality_embeddings"][0]["embedding"].weight

    @property
    def text_table(self) -> torch.Tensor:
        return self.tied["embedding"]["text_embedding"].weight

    def kv_cache_shape(self, batch: int) -> tuple[int, int, int, int]:
        return batch, self.cfg.num_kv_heads, self.max_seq, self.cfg.head_dim

    def new_caches(self, batch: int, device=None) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(self.kv_cache_shape(batch), dtype=self.dtype, device=device)
                     for _ in range(2 * self.cfg.num_layers))

    def embed(self, input_ids, audio_codes, is_audio):
        """Text rows from the text table; audio rows as Σ_k table[k·1026 + code_k], fp32 sum, one rounding."""
        text = F.embedding(input_ids, self.text_table).to(self.dtype)
        audio = F.embedding(audio_codes + self.codebook_offsets, self.audio_table).float().sum(dim=-2).to(self.dtype)
        return torch.where(is_audio[..., None], audio, text)

    def backbone(self, x, write_pos, caches):
        """Embeddings [B,S,H] at positions write_pos.. → final-norm hidden states [B,S,H] and updated caches."""
        positions = write_pos[:, None] + torch.arange(x.shape[1], device=x.device)[None, :]
        keys = torch.arange(self.max_seq, device=x.device)
        mask = keys[None, None, None, :] <= positions[:, None, :, None]
        rope = (self.rope_cos, self.rope_sin)
        new_caches = []
        for i, layer in enumerate(self.body.layers):
            x, k_cache, v_cache = layer(x, self.ops, rope, positions, write_pos, caches[2 * i], caches[2 * i + 1], mask)
            new_caches += [k_cache, v_cache]
        return self.body.norm(x), tuple(new_caches)

    def forward(self, input_ids, audio_codes, is_audio, write_pos, new_len, row_index, end_frame, caches):
        """Inputs (B rows, S new positions each, right-padded):
        input_ids [B,S] int32, audio_codes [B,S,8] int32, is_audio [B,S] bool, write_pos [B] int64 (cache row of
        the first new position), new_len [B] int64 (valid new positions), row_index [B] int64 (the row being
        predicted), end_frame [B] int64 (first frame past the utterance's end, huge while unknown),
        caches: 2·L tensors [B,Hkv,S_max,D].
        Returns logits [B,8,1026] fp32, next codes [B,8] int32, and the updated caches.
        """
        h, caches = self.backbone(self.embed(input_ids, audio_codes, is_audio), write_pos, caches)
        last = h[torch.arange(h.shape[0], device=h.device), new_len - 1]
        logits = F.linear(last, self.audio_table.to(self.dtype)).float()
        logits = logits.view(-1, self.cfg.num_codebooks, self.cfg.codebook_vocab)
        return logits, self.ops.codebook_step(logits, row_index, end_frame, self.audio_table), *caches
