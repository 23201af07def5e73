"""The GPU engine's linear: out = x Wᵀ for a decode step's or a prefill's rows, bf16 or FP8, every row summed in
one fixed K order whatever else shares the launch (batch invariance; plugins/engine_kernels.linear), in the tile
shapes of its weight shape (runtime/gpu/tiles.py); and a decoder layer's weights as the engine holds them."""

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from higgs_trt.plugins import engine_kernels
from higgs_trt.plugins.fp8 import FP8_CODES, bf16_scale, quantize_weight
from higgs_trt.runtime.config import HiggsConfig

from .tiles import SHARED_MEMORY, TileConfig, default_tiles, stage_bytes, tuned_tiles

# FP8 products one wgmma instruction sums in the tensor core's reduced precision before fp32 (plugins/primitives.mma):
# 32, each instruction's K. 0 would keep every sum in fp32, but Triton then multiplies FP8 as f16 with mma.sync,
# which is slower (`bench linear`).
FP8_SPAN = 32


class Linear:
    """One weight [N, K] (bf16, or FP8 with a scale per row) with its tile shape; `up` makes it the gated pair."""

    def __init__(self, weight: torch.Tensor, up: torch.Tensor | None = None, act_amax: float | None = None):
        self.n, self.k = weight.shape
        self.fp8 = act_amax is not None
        self.x_scale = float(bf16_scale(act_amax)) if self.fp8 else 1.0
        self.weight, self.scale = self._store(weight)
        self.up, self.up_scale = self._store(up) if up is not None else (None, None)
        key = self.n, self.k, self.fp8
        self.tiles = tuned_tiles(weight.device).get(key) or default_tiles(*key, weight.device.type)
        self._descriptors: dict = {}  # (weight's name, block) → its TMA descriptor

    def _store(self, w: torch.Tensor):
        if not self.fp8:
            return w.to(torch.bfloat16).contiguous(), None
        w8, scale = quantize_weight(w)
        return w8.contiguous(), scale.to(w.device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, m: int, workspace,
                 residual: bool = False, tiles: TileConfig | None = None, out_scale: float = 1.0,
                 prefill: bool = False) -> None:
        """out[:m] = x[:m] Wᵀ (gated: silu(x Gᵀ)·(x Uᵀ); residual: out[:m] += ...), every row summed in the same K
        order whatever m is: the decode tiles' order, or with `prefill` the prefill tiles' (TileConfig). An FP8 x
        holds codes at this linear's activation scale; an FP8 out gets codes at out_scale. `workspace`: the step's
        scratch and launch settings (launches.Workspace)."""
        t = (tiles or self.tiles).for_rows(m, prefill)
        rows = min(t.rows, max(16, 1 << (m - 1).bit_length()))  # x rows per product: 16 to the tiles' rows (64; 256)
        in_program = t.split_k > 1 and (rows >= t.in_program_from or m > rows)
        persistent = bool(t.persistent) and not in_program and m <= rows  # its units hold every row of x
        if persistent:
            grid = (min(-(-self.n // t.block_n) * t.split_k, workspace.sms * t.persistent),)
        else:
            grid = (-(-m // rows), -(-self.n // t.block_n), 1 if in_program else t.split_k)
        # as many pipeline stages as shared memory takes
        stages = max(2, min(t.stages, SHARED_MEMORY // stage_bytes(t.block_n, t.block_k, rows, self.fp8,
                                                                    self.up is not None)))
        descriptors = {}
        if t.tma:
            descriptors = dict(x_desc=TensorDescriptor(x, [m, self.k], [self.k, 1], [rows, t.block_k]),
                               w_desc=self._descriptor("weight", t), TMA=True)
            if self.up is not None:
                descriptors["w_up_desc"] = self._descriptor("up", t)
        engine_kernels.linear[grid](
            x, self.weight, self.up if self.up is not None else self.weight,
            self.scale if self.fp8 else x, self.up_scale if self.up_scale is not None else x,
            out, out, workspace.partials, workspace.tickets, m, self.x_scale, out_scale,
            N=self.n, K=self.k, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, ROWS=rows,
            FP8=self.fp8, GATED=self.up is not None, RESIDUAL=residual, OUT_F32=out.dtype == torch.float32,
            SPLITS_IN_PROGRAM=in_program, PDL=workspace.pdl, FP8_SPAN=FP8_SPAN if self.fp8 else 0,
            X_FP8=x.dtype == FP8_CODES, OUT_FP8=out.dtype == FP8_CODES, PERSISTENT=persistent,
            LATE_LAUNCH=t.late_launch, launch_pdl=workspace.pdl, num_warps=t.warps, num_stages=stages, **descriptors)

    def _descriptor(self, name: str, t: TileConfig) -> TensorDescriptor:
        key = name, t.block_n, t.block_k
        if key not in self._descriptors:
            self._descriptors[key] = TensorDescriptor.from_tensor(getattr(self, name), [t.block_n, t.block_k])
        return self._descriptors[key]


class Layer:
    """One decoder layer: its norms, and q|k|v, o, gate|up and down as Linears (FP8 where `amax` names the site)."""

    def __init__(self, cfg: HiggsConfig, t: dict, prefix: str, amax: dict | None):
        def site(name):
            return amax[prefix + name] if amax else None

        a = prefix + "self_attn."
        self.input_norm = t[prefix + "input_layernorm.weight"]
        self.post_norm = t[prefix + "post_attention_layernorm.weight"]
        self.q_norm, self.k_norm = t[a + "q_norm.weight"], t[a + "k_norm.weight"]
        qkv = torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]])
        self.qkv = Linear(qkv, act_amax=site("self_attn.q_proj"))
        self.o = Linear(t[a + "o_proj.weight"], act_amax=site("self_attn.o_proj"))
        m = prefix + "mlp."
        self.gate_up = Linear(t[m + "gate_proj.weight"], t[m + "up_proj.weight"], act_amax=site("mlp.gate_proj"))
        self.down = Linear(t[m + "down_proj.weight"], act_amax=site("mlp.down_proj"))
