"""The bundled codec's encoder (higgs-audio-v2-tokenizer), fp32: reference audio → codes [B,8,T] at 25 frames/s.

Follows transformers' `HiggsAudioV2TokenizerModel.encode`:
  semantic  16 kHz audio, 160 zeros each side → HuBERT (conv feature encoder, projection, positional conv,
            post-norm transformer) → mean of all hidden states (layer 0's input and every layer's output)
            → every 2nd frame (50 → 25 Hz) → semantic encoder (convs, ELU residual units)
  acoustic  24 kHz audio → DAC encoder (conv1; 5 blocks of 3 dilated residual units, Snake, strided conv; Snake, conv2)
  [acoustic; semantic] → fc → RVQ: per quantizer project_in, nearest codebook entry (Euclidean), and
            project_out(entry) subtracted from the residual.
`forward` is the exported graph. Resampling and the 480-sample padding of the 24 kHz signal (applied when the two
branches' frame counts would differ) happen before it, in runtime/audio.py, so the graph has a single path;
`encode` = that padding + `forward`, the whole of transformers' encode for given 24 kHz and 16 kHz signals.

Dimensions are read off the tensors' shapes under the codec prefix, as for the decoder (runtime/gpu/codec.py). What
shapes cannot tell is fixed by the Higgs geometry and checked where it can be: HuBERT-base's conv strides (the
kernels 10,3,3,3,3,2,2 are checked), its 64-wide attention heads and post-norm layers, the semantic encoder's
residual dilations (1, 1).
"""

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from higgs_trt.runtime.audio import SAMPLE_RATE, SEMANTIC_PAD, SEMANTIC_RATE, acoustic_padding
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.gpu.codec import DILATIONS, PREFIX, BlockStack, Codebook, ResidualUnit, Snake, codec_count, codec_shape

from .checkpoint import Checkpoint

HUBERT_CONV = ((10, 5), (3, 2), (3, 2), (3, 2), (3, 2), (2, 2), (2, 2))  # (kernel, stride) of HuBERT's feature encoder
HEAD_DIM = 64  # HuBERT base and large
SEMANTIC_DILATIONS = (1, 1)  # block_dilations of the Higgs tokenizer config: not visible in shapes
LAYER_NORM_EPS = 1e-5
POS_CONV = "semantic_model.encoder.pos_conv_embed.conv."
# the positional conv's weight norm (dim 2) under torch's parametrization names, or the older weight_g/weight_v
WEIGHT_NORM_NAMES = (("parametrizations.weight.original0", "parametrizations.weight.original1"), ("weight_g", "weight_v"))


@dataclass(frozen=True)
class EncoderDims:
    acoustic_channels: tuple[int, ...]  # DAC encoder: conv1 output, then after each block
    acoustic_strides: tuple[int, ...]
    acoustic_dim: int  # conv2 output
    conv_dim: tuple[int, ...]  # HuBERT feature-encoder channels per layer
    conv_bias: bool
    semantic_dim: int  # HuBERT width = semantic encoder width
    num_layers: int
    intermediate: int
    pos_kernel: int
    pos_groups: int
    semantic_kernel: int  # the semantic encoder's first conv
    semantic_blocks: tuple[tuple[int, int, int], ...]  # (out channels, kernel, stride) per block
    unit_kernel: int
    num_quantizers: int
    codebook_size: int
    codebook_dim: int

    @property
    def latent_dim(self) -> int:
        return self.acoustic_dim + self.semantic_blocks[-1][0]

    @property
    def num_heads(self) -> int:
        return self.semantic_dim // HEAD_DIM

    @property
    def hop(self) -> int:
        return math.prod(self.acoustic_strides)

    @property
    def semantic_downsample(self) -> int:
        """HuBERT frames per codec frame (transformers' `semantic_downsample_factor`): 2 for Higgs."""
        return int(self.hop / (SAMPLE_RATE / SEMANTIC_RATE) / math.prod(s for _, s in HUBERT_CONV))

    def geometry(self) -> dict:
        """The length arithmetic of both branches (convs as [kernel, stride, padding]; length-preserving residual
        convs left out), for runtime/audio.py's padding rule; recorded in the manifest."""
        acoustic = [[7, 1, 3], *([2 * s, s, math.ceil(s / 2)] for s in self.acoustic_strides), [3, 1, 1]]
        semantic_encoder = [[self.semantic_kernel, 1, self.semantic_kernel // 2],
                            *([k, s, (k - 1) // 2] for _, k, s in self.semantic_blocks)]
        return {"acoustic": acoustic, "acoustic_pad": self.hop // 2, "semantic_pad": SEMANTIC_PAD,
                "semantic": [[k, s, 0] for k, s in HUBERT_CONV], "semantic_downsample": self.semantic_downsample,
                "semantic_encoder": semantic_encoder, "hop": self.hop}

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "EncoderDims":
        shape, count = partial(codec_shape, ckpt, part="codec encoder"), partial(codec_count, ckpt)

        def broken(what: str) -> HiggsError:
            return HiggsError(f"{ckpt.dir}: codec encoder: {what}")

        n_blocks = count(r"acoustic_encoder\.block\.(\d+)\.conv1\.weight")
        channels, strides = [shape("acoustic_encoder.conv1.weight")[0]], []
        for b in range(n_blocks):
            c_out, c_in, kernel = shape(f"acoustic_encoder.block.{b}.conv1.weight")
            if kernel % 2:
                raise broken(f"block {b} has an odd strided-conv kernel {kernel} (expected 2×stride)")
            channels.append(c_out)
            strides.append(kernel // 2)

        m = "semantic_model."
        kernels = tuple(shape(f"{m}feature_extractor.conv_layers.{i}.conv.weight")[2]
                        for i in range(count(r"semantic_model\.feature_extractor\.conv_layers\.(\d+)\.conv\.weight")))
        if kernels != tuple(k for k, _ in HUBERT_CONV):
            raise broken(f"HuBERT feature-encoder kernels {list(kernels)}, expected {[k for k, _ in HUBERT_CONV]}")
        if PREFIX + f"{m}feature_extractor.conv_layers.1.layer_norm.weight" in ckpt:
            raise broken("a layer-norm HuBERT feature encoder (the large, pre-norm layout) is not supported")
        conv_dim = tuple(shape(f"{m}feature_extractor.conv_layers.{i}.conv.weight")[0] for i in range(len(kernels)))
        hidden = shape(f"{m}feature_projection.projection.weight")[0]
        if hidden % HEAD_DIM:
            raise broken(f"HuBERT width {hidden} is not a multiple of the {HEAD_DIM}-wide heads")
        pos = _weight_norm_names(ckpt)
        _, per_group, pos_kernel = shape(pos[1])

        s = "encoder_semantic."
        blocks = []
        for b in range(count(r"encoder_semantic\.conv_blocks\.(\d+)\.conv\.weight")):
            c_out, _, kernel = shape(f"{s}conv_blocks.{b}.conv.weight")
            blocks.append((c_out, kernel, 1 if kernel == 3 else kernel // 2))  # stride 1 uses kernel 3, else 2×stride
            units = count(rf"encoder_semantic\.conv_blocks\.{b}\.res_units\.(\d+)\.conv1\.weight")
            if units != len(SEMANTIC_DILATIONS):
                raise broken(f"semantic block {b} has {units} residual units, expected {len(SEMANTIC_DILATIONS)}")
        if not blocks:
            raise broken("no semantic encoder blocks")

        n_q = count(r"quantizer\.quantizers\.(\d+)\.project_in\.weight")
        codebook_dim, latent = shape("quantizer.quantizers.0.project_in.weight")
        dims = cls(tuple(channels), tuple(strides), shape("acoustic_encoder.conv2.weight")[0], conv_dim,
                   PREFIX + f"{m}feature_extractor.conv_layers.0.conv.bias" in ckpt, hidden,
                   count(r"semantic_model\.encoder\.layers\.(\d+)\.attention\.q_proj\.weight"),
                   shape(f"{m}encoder.layers.0.feed_forward.intermediate_dense.weight")[0], pos_kernel,
                   hidden // per_group, shape(f"{s}conv.weight")[2], tuple(blocks),
                   shape(f"{s}conv_blocks.0.res_units.0.conv1.weight")[2], n_q,
                   *shape("quantizer.quantizers.0.codebook.embed"))
        if dims.latent_dim != latent or shape("fc.weight") != (latent, latent):
            raise broken(f"acoustic {dims.acoustic_dim} + semantic {blocks[-1][0]} channels do not match fc / "
                         f"project_in width {latent}")
        hubert_hop = math.prod(s for _, s in HUBERT_CONV)
        if dims.semantic_downsample < 1 or dims.hop * SEMANTIC_RATE != dims.semantic_downsample * hubert_hop * SAMPLE_RATE:
            raise broken(f"hop {dims.hop} is not a whole number of 16 kHz HuBERT frames")
        return dims


def _weight_norm_names(ckpt: Checkpoint) -> tuple[str, str]:
    for g, v in WEIGHT_NORM_NAMES:
        if PREFIX + POS_CONV + g in ckpt:
            return POS_CONV + g, POS_CONV + v
    raise HiggsError(f"{ckpt.dir}: codec encoder tensor {PREFIX + POS_CONV}{WEIGHT_NORM_NAMES[0][0]} not found")


def has_encoder(ckpt: Checkpoint) -> bool:
    return PREFIX + "acoustic_encoder.conv1.weight" in ckpt


# ---- acoustic branch: DAC encoder ------------------------------------------------------------------------------

class EncoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(c_in, d) for d in DILATIONS)
        self.snake1 = Snake(c_in)
        self.conv1 = nn.Conv1d(c_in, c_out, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2))

    def forward(self, x):
        return self.conv1(self.snake1(self.res_unit3(self.res_unit2(self.res_unit1(x)))))


class AcousticEncoder(BlockStack):
    def __init__(self, dims: EncoderDims):
        super().__init__()
        c = dims.acoustic_channels
        self.conv1 = nn.Conv1d(1, c[0], kernel_size=7, padding=3)
        self.block = nn.ModuleList(EncoderBlock(c[i], c[i + 1], s) for i, s in enumerate(dims.acoustic_strides))
        self.snake1 = Snake(c[-1])
        self.conv2 = nn.Conv1d(c[-1], dims.acoustic_dim, kernel_size=3, padding=1)


# ---- semantic branch: HuBERT + semantic encoder ----------------------------------------------------------------

class FeatureConv(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, bias: bool, norm: bool):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, bias=bias)
        self.layer_norm = nn.GroupNorm(c_out, c_out) if norm else None  # one group per channel

    def forward(self, x):
        x = self.conv(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return F.gelu(x)


class Attention(nn.Module):
    """Written out (transformers' eager formula), not SDPA: the exporter would emit the ONNX Attention op, for which
    TensorRT has no fp32 kernel (the build stops); MatMul + Softmax build everywhere."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (self.heads, -1)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        weights = (torch.matmul(q, k.transpose(2, 3)) * self.scale).softmax(dim=-1)
        return self.out_proj(torch.matmul(weights, v).transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self, dim: int, intermediate: int):
        super().__init__()
        self.intermediate_dense = nn.Linear(dim, intermediate)
        self.output_dense = nn.Linear(intermediate, dim)

    def forward(self, x):
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class EncoderLayer(nn.Module):
    """Post-norm: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, dims: EncoderDims):
        super().__init__()
        d = dims.semantic_dim
        self.attention = Attention(d, dims.num_heads)
        self.layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.feed_forward = FeedForward(d, dims.intermediate)
        self.final_layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def forward(self, x):
        x = self.layer_norm(x + self.attention(x))
        return self.final_layer_norm(x + self.feed_forward(x))


class PositionalConv(nn.Module):
    def __init__(self, dims: EncoderDims):
        super().__init__()
        k = dims.pos_kernel
        self.conv = nn.Conv1d(dims.semantic_dim, dims.semantic_dim, k, padding=k // 2, groups=dims.pos_groups)
        self.trim = 1 - k % 2  # an even kernel makes one frame too many

    def forward(self, x):  # [B, T, C]
        y = self.conv(x.transpose(1, 2))
        if self.trim:
            y = y[:, :, :-self.trim]
        return F.gelu(y).transpose(1, 2)


class HubertEncoder(nn.Module):
    def __init__(self, dims: EncoderDims):
        super().__init__()
        self.pos_conv_embed = PositionalConv(dims)
        self.layer_norm = nn.LayerNorm(dims.semantic_dim, eps=LAYER_NORM_EPS)
        self.layers = nn.ModuleList(EncoderLayer(dims) for _ in range(dims.num_layers))


class Hubert(nn.Module):
    def __init__(self, dims: EncoderDims):
        super().__init__()
        c = (1, *dims.conv_dim)
        self.feature_extractor = nn.Module()
        self.feature_extractor.conv_layers = nn.ModuleList(
            FeatureConv(c[i], c[i + 1], k, s, dims.conv_bias, norm=i == 0) for i, (k, s) in enumerate(HUBERT_CONV))
        self.feature_projection = nn.Module()
        self.feature_projection.layer_norm = nn.LayerNorm(c[-1], eps=LAYER_NORM_EPS)
        self.feature_projection.projection = nn.Linear(c[-1], dims.semantic_dim)
        self.encoder = HubertEncoder(dims)

    def forward(self, audio):
        """audio [B, M] → the mean of all hidden states [B, frames, C]."""
        x = audio[:, None]
        for conv in self.feature_extractor.conv_layers:
            x = conv(x)
        p = self.feature_projection
        x = p.projection(p.layer_norm(x.transpose(1, 2)))
        e = self.encoder
        x = e.layer_norm(x + e.pos_conv_embed(x))
        states = [x]
        for layer in e.layers:
            x = layer(x)
            states.append(x)
        return torch.stack(states, dim=1).mean(dim=1)


class SemanticUnit(nn.Module):
    def __init__(self, channels: int, kernel: int, dilation: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2 * dilation, dilation=dilation, bias=False)
        self.conv2 = nn.Conv1d(channels, channels, 1, bias=False)

    def forward(self, x):
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class SemanticBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, unit_kernel: int):
        super().__init__()
        self.res_units = nn.ModuleList(SemanticUnit(c_in, unit_kernel, d) for d in SEMANTIC_DILATIONS)
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x):
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    def __init__(self, dims: EncoderDims):
        super().__init__()
        d, k = dims.semantic_dim, dims.semantic_kernel
        self.conv = nn.Conv1d(d, d, k, padding=k // 2, bias=False)
        channels = (d, *(c for c, _, _ in dims.semantic_blocks))
        self.conv_blocks = nn.ModuleList(SemanticBlock(channels[i], c, k_b, s, dims.unit_kernel)
                                         for i, (c, k_b, s) in enumerate(dims.semantic_blocks))

    def forward(self, x):
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


# ---- the encoder -----------------------------------------------------------------------------------------------

class Quantizer(nn.Module):
    def __init__(self, dims: EncoderDims):
        super().__init__()
        self.codebook = Codebook(dims.codebook_size, dims.codebook_dim)
        self.project_in = nn.Linear(dims.latent_dim, dims.codebook_dim)
        self.project_out = nn.Linear(dims.codebook_dim, dims.latent_dim)

    def nearest(self, residual):
        """residual [B, T, latent] → index of the nearest codebook entry [B, T] (transformers' arithmetic)."""
        x = self.project_in(residual)
        flat = x.flatten(0, 1)
        embed = self.codebook.embed.t()
        distance = -(flat.pow(2).sum(1, keepdim=True) - 2 * flat @ embed + embed.pow(2).sum(0, keepdim=True))
        return distance.max(dim=-1).indices.view_as(x[..., 0])


class CodecEncoder(nn.Module):
    def __init__(self, dims: EncoderDims):
        super().__init__()
        self.dims = dims
        self.acoustic_encoder = AcousticEncoder(dims)
        self.semantic_model = Hubert(dims)
        self.encoder_semantic = SemanticEncoder(dims)
        self.fc = nn.Linear(dims.latent_dim, dims.latent_dim)
        self.quantizer = nn.Module()
        self.quantizer.quantizers = nn.ModuleList(Quantizer(dims) for _ in range(dims.num_quantizers))

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "CodecEncoder":
        dims = EncoderDims.from_checkpoint(ckpt)
        with torch.device("meta"):
            model = cls(dims)
        expected = {PREFIX + n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
        g, v = _weight_norm_names(ckpt)
        weight = expected.pop(PREFIX + POS_CONV + "weight")
        expected |= {PREFIX + g: (1, 1, weight[2]), PREFIX + v: weight}
        state = {n[len(PREFIX):]: t.float() for n, t in ckpt.take(expected, "codec encoder").items()}
        # fold the weight norm once (as the parametrization computes it on every call): w = g · v / ‖v‖ per tap
        state[POS_CONV + "weight"] = torch._weight_norm(state.pop(v), state.pop(g), 2)
        model.load_state_dict(state, assign=True)
        return model.eval()

    def forward(self, audio_24k, audio_16k):
        """audio_24k [B,1,N] (already padded by `encode`'s rule), audio_16k [B,1,M] → codes [B,Q,T] int32."""
        semantic = self.semantic_model(F.pad(audio_16k[:, 0], (SEMANTIC_PAD, SEMANTIC_PAD)))
        semantic = self.encoder_semantic(semantic[:, :: self.dims.semantic_downsample].transpose(1, 2))
        acoustic = self.acoustic_encoder(audio_24k)
        torch._check(acoustic.shape[2] == semantic.shape[2])  # the caller's padding rule guarantees it
        residual = self.fc(torch.cat([acoustic, semantic], dim=1).transpose(1, 2))  # [B, T, latent]
        codes = []
        for q in self.quantizer.quantizers:
            index = q.nearest(residual)
            residual = residual - q.project_out(F.embedding(index, q.codebook.embed))
            codes.append(index)
        return torch.stack(codes, dim=1).to(torch.int32)

    @torch.inference_mode()
    def encode(self, audio_24k: torch.Tensor, audio_16k: torch.Tensor) -> torch.Tensor:
        """transformers' encode on the given signals: pad the 24 kHz one when the branches' frame counts differ."""
        pad = acoustic_padding(audio_24k.shape[-1], audio_16k.shape[-1], self.dims.geometry())
        return self(F.pad(audio_24k, (pad, pad)), audio_16k)


class TorchEncoder:
    """The torch encoder behind runtime/audio.py's Encoder interface (`--checkpoint`), fp32 on CPU or CUDA.
    The CUDA path (the lead's GPU torch backend) is not exercised here: no GPU."""

    name = "torch"

    def __init__(self, ckpt: Checkpoint, device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = CodecEncoder.from_checkpoint(ckpt).to(self.device)
        self.geometry = self.model.dims.geometry()
        self.identity = f"torch:{ckpt.fingerprint()}"

    @torch.inference_mode()
    def encode(self, audio_24k, audio_16k):
        inputs = (torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(self.device) for a in (audio_24k, audio_16k))
        return self.model(*inputs).cpu().numpy()
