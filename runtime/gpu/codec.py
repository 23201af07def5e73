"""The bundled codec's decoder (higgs-audio-v2-tokenizer), fp32 (the GPU engine's: fp16 convolutions,
CodecDecoder.fp16): codes [B,8,T] → waveform [B,1,960·T].

RVQ: Σ_i project_out_i(codebook_i[codes_i]) → fc2 → DAC decoder (conv1, 5 upsampling blocks of Snake +
ConvTranspose(k=2s, stride s, padding ceil(s/2), output_padding s%2) + 3 dilated residual units, Snake, conv2;
no tanh). The checkpoint carries no codec config, so every dimension is read off the tensors' shapes under
`tied.embedding.modality_embeddings.0.model.`; encoder-side tensors are never read. A streaming window (forward
with `keep`) is decoded cropped, in channels-last rows [B, T, C] (AcousticDecoder.cropped); the whole decode, which
ONNX export traces, keeps the modules' [B, C, T].
"""

import math
import re
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.streaming import conv_reads, transposed_reads

from .weights import WeightSource

PREFIX = "tied.embedding.modality_embeddings.0.model."
DILATIONS = (1, 3, 9)
SNAKE_BLOCK = 1024


@dataclass(frozen=True)
class CodecDims:
    num_quantizers: int
    codebook_size: int
    codebook_dim: int
    latent_dim: int  # RVQ output (acoustic + semantic hidden)
    acoustic_dim: int  # fc2 output, the DAC decoder's input
    channels: tuple[int, ...]  # decoder channels: conv1 output, then after each block
    strides: tuple[int, ...]

    @property
    def hop(self) -> int:
        return math.prod(self.strides)

    @classmethod
    def from_checkpoint(cls, ckpt: WeightSource) -> "CodecDims":
        shape, count = partial(codec_shape, ckpt), partial(codec_count, ckpt)
        n_q = count(r"quantizer\.quantizers\.(\d+)\.codebook\.embed")
        n_blocks = count(r"acoustic_decoder\.block\.(\d+)\.conv_t1\.weight")
        if n_q == 0 or n_blocks == 0:
            raise HiggsError(f"{ckpt.dir}: no codec decoder under {PREFIX} (quantizers: {n_q}, decoder blocks: {n_blocks})")
        size, dim = shape("quantizer.quantizers.0.codebook.embed")
        latent = shape("quantizer.quantizers.0.project_out.weight")[0]
        acoustic = shape("fc2.weight")[0]
        channels, strides = [shape("acoustic_decoder.conv1.weight")[0]], []
        for b in range(n_blocks):
            c_in, c_out, kernel = shape(f"acoustic_decoder.block.{b}.conv_t1.weight")
            if kernel % 2:
                raise HiggsError(f"{ckpt.dir}: codec block {b} has an odd transposed-conv kernel {kernel} (expected 2×stride)")
            channels.append(c_out)
            strides.append(kernel // 2)
        return cls(n_q, size, dim, latent, acoustic, tuple(channels), tuple(strides))


def codec_shape(ckpt: WeightSource, suffix: str, part: str = "codec") -> tuple[int, ...]:
    """The shape of the codec's tensor PREFIX + suffix; missing, an error that names `part`."""
    if PREFIX + suffix not in ckpt:
        raise HiggsError(f"{ckpt.dir}: {part} tensor {PREFIX + suffix} not found")
    return ckpt.shape(PREFIX + suffix)


def codec_count(ckpt: WeightSource, pattern: str) -> int:
    """How many blocks the codec's tensor names number: 1 + the largest index that `pattern`'s group matches after
    PREFIX (0 if none does)."""
    found = {int(m.group(1)) for n in ckpt.names() if (m := re.fullmatch(re.escape(PREFIX) + pattern, n))}
    return max(found) + 1 if found else 0


class Snake(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(1, channels, 1), requires_grad=False)

    def forward(self, x):
        if x.is_cuda and not torch.onnx.is_in_onnx_export():
            return _snake_on_gpu(x, self.alpha)
        return snake_formula(x, self.alpha)


def snake_formula(x, alpha):
    """x + sin(αx)² / (α + 1e-9) in torch ops (ONNX export, the CPU), α shaped to broadcast over x's channels; in
    α's precision (fp32), returned in x's."""
    y = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _snake_on_gpu(x, alpha):
    """The same formula in one Triton pass: the codec's activations are the largest tensors of a decode (64 windows
    of 45 frames: 0.35 GB at the last block), and eager torch reads and writes them five times per Snake."""
    from higgs_trt.plugins.engine_kernels import snake

    x = x.contiguous()
    out = torch.empty_like(x)
    b, c, t = x.shape
    snake[(b, -(-c * t // SNAKE_BLOCK))](x, alpha, alpha, out, c * t, c * t, c, t, HAS_BIAS=False, BLOCK=SNAKE_BLOCK)
    return out


def snake_rows(x, alpha, bias=None):
    """Snake of x + bias over channels-last rows x [B, T, C] (bias: the previous convolution's, not added yet), into
    a new packed [B, T, C]."""
    b, t, c = x.shape
    if not x.is_cuda:
        return snake_formula(x if bias is None else x + bias, alpha.reshape(-1))
    from higgs_trt.plugins.engine_kernels import snake

    if x.stride(2) != 1 or x.stride(1) != c:
        x = x.contiguous()
    out = torch.empty(b, t, c, device=x.device, dtype=x.dtype)
    snake[(b, -(-t * c // SNAKE_BLOCK))](x, alpha, alpha if bias is None else bias, out, x.stride(0), t * c, c, 1,
                                         HAS_BIAS=bias is not None, BLOCK=SNAKE_BLOCK)
    return out


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=1)

    def forward(self, x):
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.snake1 = Snake(c_in)
        self.conv_t1 = nn.ConvTranspose1d(c_in, c_out, kernel_size=2 * stride, stride=stride,
                                          padding=math.ceil(stride / 2), output_padding=stride % 2)
        self.res_unit1, self.res_unit2, self.res_unit3 = (ResidualUnit(c_out, d) for d in DILATIONS)

    def forward(self, x):
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("embed", torch.empty(size, dim))


class Quantizer(nn.Module):
    def __init__(self, dims: CodecDims):
        super().__init__()
        self.codebook = Codebook(dims.codebook_size, dims.codebook_dim)
        self.project_out = nn.Linear(dims.codebook_dim, dims.latent_dim)


class BlockStack(nn.Module):
    """DAC's outer shape, shared by the decoder and the encoder (builder/codec_encoder.py), under the checkpoint's
    names: conv1 → block[0..] → snake1 → conv2."""

    def forward(self, x):
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class AcousticDecoder(BlockStack):
    def __init__(self, dims: CodecDims):
        super().__init__()
        self.conv1 = nn.Conv1d(dims.acoustic_dim, dims.channels[0], kernel_size=7, padding=3)
        self.block = nn.ModuleList(DecoderBlock(dims.channels[i], dims.channels[i + 1], s) for i, s in enumerate(dims.strides))
        self.snake1 = Snake(dims.channels[-1])
        self.conv2 = nn.Conv1d(dims.channels[-1], 1, kernel_size=7, padding=3)

    def cropped(self, z, keep: tuple[int, int]):
        """The samples of frames [keep[0], keep[1]) of forward(z), given z as channels-last rows [B, T, C], each
        layer computing only the samples the layers after it read for them: the interval is walked back from the
        output through every kernel, dilation and stride (as runtime/streaming.receptive_field walks one frame's),
        and each convolution runs without padding over exactly its interval, padded with zeros only where the
        interval passes the window's edges — where forward pads too — so the kept samples are forward's. The
        context frames of a streaming window matter to the first, low-rate layers only, so a window costs about half
        to two thirds of forward's arithmetic."""
        return _cropped_steps(z, self.crop_plan(z.shape[1], keep))

    def crop_plan(self, frames: int, keep: tuple[int, int]) -> list["CropStep"]:
        """cropped()'s steps, first to last, each with the samples it outputs and those it reads."""
        layers = [("conv", self.conv1, None, None)]
        for block in self.block:
            layers.append(("transposed", block.conv_t1, block.snake1, None))
            layers += [("residual", u.conv1, u.snake1, u) for u in (block.res_unit1, block.res_unit2, block.res_unit3)]
        layers.append(("conv", self.conv2, self.snake1, None))
        hop = math.prod(block.conv_t1.stride[0] for block in self.block)
        lo, hi, length = keep[0] * hop, keep[1] * hop, frames * hop
        steps = []
        for kind, conv, snake, unit in reversed(layers):
            lo, hi = max(lo, 0), min(hi, length)
            out = lo, hi  # half-open; runtime/streaming's rules take and give inclusive ends
            if kind == "transposed":
                lo, last = transposed_reads(lo, hi - 1, conv.stride[0])
                length //= conv.stride[0]
            else:
                lo, last = conv_reads(lo, hi - 1, conv.kernel_size[0], conv.dilation[0])
            hi = last + 1
            steps.append(CropStep(kind, conv, snake, unit, out, (lo, hi), length))
        return steps[::-1]


@dataclass(frozen=True)
class CropStep:
    kind: str  # conv, transposed or residual
    conv: nn.Module  # the step's (first) convolution
    snake: Snake | None  # the activation the step applies to its input first
    unit: ResidualUnit | None  # a residual step's unit
    out: tuple[int, int]  # the samples it outputs
    reads: tuple[int, int]  # the samples of its input it reads, past the window's edges too (zeros there)
    length: int  # its input's length over the whole window

    @property
    def first(self) -> int:
        """The first input sample it is given (its reads within the window)."""
        return max(self.reads[0], 0)

    @property
    def edges(self) -> tuple[int, int]:
        """The zeros it reads past the window's edges, on each side of the samples it is given."""
        return self.first - self.reads[0], max(self.reads[1] - self.length, 0)


def _conv_rows(conv, x, edges=(0, 0)):
    """conv (no bias) over channels-last rows x [B, T, C] → [B, T', C'], zeros past the window's edges: as an NHWC
    image of height 1, the layout cuDNN's tensor-core convolutions read and write (NCW input costs a transpose each
    way around every convolution). A dilated one runs undilated over its input's d phases (_dilated_rows)."""
    if any(edges):
        x = F.pad(x, (0, 0, *edges))
    if isinstance(conv, nn.Conv1d) and conv.dilation[0] > 1:
        return _dilated_rows(conv, x)
    image, weight = x.transpose(1, 2).unsqueeze(2), conv.weight.unsqueeze(2)
    if isinstance(conv, nn.ConvTranspose1d):
        y = F.conv_transpose2d(image, weight, stride=(1, conv.stride[0]))
    else:
        y = F.conv2d(image, weight)
    return y.squeeze(2).transpose(1, 2)


def _dilated_rows(conv, x):
    """A convolution of dilation d over rows x [B, T, C]: output t = Σ_j w_j·x[t + j·d] only reads inputs of t's
    phase t mod d, so x viewed as an NHWC image [B, T/d, d, C] (T padded up to a multiple of d) and convolved along
    its height by the undilated kernel [k, 1] gives every phase at once, in the same layout. cuDNN has no fast fp16
    kernel for some dilated shapes of the codec (a direct grouped kernel, hundreds of times slower than TF32);
    undilated they take its implicit-GEMM kernels."""
    d, k = conv.dilation[0], conv.kernel_size[0]
    b, t, c = x.shape
    pad = -t % d
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    image = x.view(b, (t + pad) // d, d, c).permute(0, 3, 1, 2)
    y = F.conv2d(image, conv.weight.unsqueeze(3))
    return y.permute(0, 2, 3, 1).reshape(b, -1, y.shape[1])[:, :t - (k - 1) * d]


def _cropped_steps(z, steps: list[CropStep]):
    """The steps over channels-last rows z [B, T, C] → [B, 1, samples]. A convolution's bias is not added by a pass
    of its own: it is carried (`bias`) into the Snake that reads the sum next, and a residual unit's 1×1 bias into
    the sum's carried bias; the output adds what is left."""
    x, bias = z[:, steps[0].first:min(steps[0].reads[1], steps[0].length)], None
    for step in steps:
        if step.kind == "transposed":
            y = _conv_rows(step.conv, snake_rows(x, step.snake.alpha, bias))
            origin = step.first * step.conv.stride[0] - step.conv.padding[0]  # the sample y[:, 0] is
            x, bias = y[:, step.out[0] - origin:step.out[1] - origin], step.conv.bias
        elif step.kind == "residual":
            unit = step.unit
            inner = _conv_rows(unit.conv1, snake_rows(x, unit.snake1.alpha, bias), step.edges)
            branch = _conv_rows(unit.conv2, snake_rows(inner, unit.snake2.alpha, unit.conv1.bias))
            branch += x[:, step.out[0] - step.first:step.out[1] - step.first]
            x, bias = branch, unit.conv2.bias if bias is None else bias + unit.conv2.bias
        else:  # conv1, the first step (no activation, nothing carried), or conv2 after the last Snake
            if step.snake is not None:
                x = snake_rows(x, step.snake.alpha, bias)
            x, bias = _conv_rows(step.conv, x, step.edges), step.conv.bias
    return (x + bias).transpose(1, 2)


class CodecDecoder(nn.Module):
    def __init__(self, dims: CodecDims):
        super().__init__()
        self.dims = dims
        self.quantizer = nn.Module()
        self.quantizer.quantizers = nn.ModuleList(Quantizer(dims) for _ in range(dims.num_quantizers))
        self.fc2 = nn.Linear(dims.latent_dim, dims.acoustic_dim)
        self.acoustic_decoder = AcousticDecoder(dims)

    @classmethod
    def from_checkpoint(cls, ckpt: WeightSource) -> "CodecDecoder":
        dims = CodecDims.from_checkpoint(ckpt)
        with torch.device("meta"):
            model = cls(dims)
        expected = {PREFIX + n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
        weights = ckpt.take(expected, "codec decoder")
        model.load_state_dict({n[len(PREFIX):]: t.float() for n, t in weights.items()}, assign=True)
        return model.eval()

    def channels_last(self) -> "CodecDecoder":
        """The decoder's convolution weights laid out channels last ([out, k, in] in memory; [in, k, out] for the
        transposed ones), as the cropped decode's convolutions read them (else cuDNN copies every weight each call).
        Values and shapes stay."""
        for conv in self.acoustic_decoder.modules():
            if isinstance(conv, (nn.Conv1d, nn.ConvTranspose1d)):
                weight = conv.weight.detach().transpose(1, 2).contiguous().transpose(1, 2)
                conv.weight = nn.Parameter(weight, requires_grad=False)
        return self

    def fp16(self) -> "CodecDecoder":
        """The acoustic decoder's convolutions in fp16 (cuDNN sums in fp32) and its activations stored in fp16
        between passes; Snake computes in fp32; the codebooks and projections, and the waveform out, stay fp32. The
        GPU engine's codec (load_gpu_engine): half the bytes of every pass and fp16 tensor cores instead of TF32,
        where codec calls share the GPU with decode steps, a few dB further from exact fp32 than TF32
        (`bench codec` reports both)."""
        for conv in self.acoustic_decoder.modules():
            if isinstance(conv, (nn.Conv1d, nn.ConvTranspose1d)):
                conv.to(torch.float16)  # the weights' channels-last strides are kept
        return self

    def forward(self, codes, keep: tuple[int, int] | None = None):
        """codes [B, Q, T] int (0..1023) → waveform [B, 1, hop·T] fp32; with keep = (a, b) the samples of frames
        [a, b) only, [B, 1, hop·(b − a)], computed without the rest (AcousticDecoder.cropped; the whole decode of
        an fp16 codec goes that way too, keeping every frame: its dilated convolutions run over their phases there,
        where the modules' would take cuDNN's slow fp16 kernels)."""
        latent = 0
        for i, q in enumerate(self.quantizer.quantizers):
            latent = latent + _linear(F.embedding(codes[:, i], q.codebook.embed), q.project_out)
        rows = _linear(latent, self.fc2)  # [B, T, C]: channels last
        dtype = self.acoustic_decoder.conv1.weight.dtype  # the convolutions' (fp16())
        if keep is None and dtype != torch.float16:
            return self.acoustic_decoder(rows.transpose(1, 2))
        return self.acoustic_decoder.cropped(rows.to(dtype), keep or (0, rows.shape[1])).to(rows.dtype)


def _linear(x, layer: nn.Linear):
    """As a 2-D product it exports as Gemm on the checkpoint's own tensor, which keeps its name in the engine
    directory (so the GPU engine can load the codec from there)."""
    return F.linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.bias).reshape(*x.shape[:-1], -1)
