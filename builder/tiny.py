"""Deterministic random checkpoints in the real Higgs v3 layout: `tiny` for CI, `mid` and `real` for benchmarks.

Real file names (`config.json`, sharded `model.safetensors.index.json`, `tokenizer.json`), real config keys,
real tensor names (including some the decoder must ignore: a stored text head, the codec's whole encoder side —
DAC acoustic encoder, HuBERT semantic model with its weight-normed positional conv, semantic encoder, `fc`,
quantizer `project_in` — and `fc1`, `embed_avg`, `masked_spec_embed`), and a byte-level BPE tokenizer that carries
the Higgs special tokens at ids unlike the real ones, so nothing can rely on hard-coded ids.
"""

import json
import os
import re
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.gpu.codec import PREFIX as CODEC

TEXT_CONFIG = {
    "model_type": "qwen3", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": None,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
}
# Codec: acoustic/semantic latent widths, codebook dim, decoder channels; encoder side: DAC encoder width (doubled
# by each block), HuBERT conv channels, layers, FFN width, positional-conv kernel (16 groups, as in HuBERT-base).
REAL_CODEC = {"acoustic": 256, "semantic": 768, "codebook_dim": 64, "channels": (1024, 512, 256, 128, 64, 32),
              "encoder_width": 64, "conv_dim": 512, "layers": 12, "intermediate": 3072, "pos_kernel": 128}
SIZES = {  # text_config dimensions (vocab None: the tokenizer's size) and codec dimensions
    "tiny": ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, "vocab_size": None},
             {"acoustic": 16, "semantic": 128, "codebook_dim": 8, "channels": (64, 32, 16, 8, 4, 2),
              "encoder_width": 4, "conv_dim": 32, "layers": 2, "intermediate": 256, "pos_kernel": 16}),
    "mid": ({"hidden_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
             "head_dim": 128, "intermediate_size": 5376, "vocab_size": 16384}, REAL_CODEC),
    "real": ({"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936}, REAL_CODEC),
}
CODEC_STRIDES = (8, 5, 4, 2, 3)
HUBERT_KERNELS = (10, 3, 3, 3, 3, 2, 2)  # strides 5,2,2,2,2,2,2: 320 samples per frame at 16 kHz
SEMANTIC_BLOCKS, SEMANTIC_UNITS = 2, 2  # the Higgs semantic encoder: 2 blocks (stride 1) of 2 residual units
HIGGS_SPECIALS = ["<|tts|>", "<|audio|>", "<|audio_end|>", "<|text|>", "<|text_end|>", "<|eoc|>",
                  "<|ref_audio|>", "<|ref_text|>", "<|emotion:elation|>", "<|prosody:pause|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
    "Four score and seven years ago our fathers brought forth on this continent a new nation.",
    "It was 3:45 pm on March 14, 2026, and the temperature was 21.5 degrees.",
    "Can you call me back at 555-0123? Thanks!", "She sells sea shells by the sea shore.",
    "Numbers: one, two, three, 4, 5, 6, 1000, 2,500.75; percentages 12% and 99.9%.",
    "Wait... what? No way! That's incredible.", "Text to speech turns written words into spoken audio.",
    "A journey of a thousand miles begins with a single step.",
]


def build_tokenizer(path: Path) -> int:
    """Write tokenizer.json; returns the vocabulary size including special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(HIGGS_SPECIALS)
    tok.save(str(path))
    return tok.get_vocab_size(with_added_tokens=True)


def _config(text: dict, tokenizer_vocab: int) -> dict:
    vocab = text["vocab_size"] or -(-tokenizer_vocab // 64) * 64
    audio = {"encoder_type": "discrete", "num_codebooks": 8, "vocab_size": 1026, "out_dim": text["hidden_size"],
             "tie_word_embeddings": True, "use_delay_pattern": True}
    return {
        "model_type": "higgs_multimodal_qwen3",
        "architectures": ["HiggsMultimodalQwen3ForConditionalGeneration"],
        "audio_token_id": -100,
        "mel_per_sample": 8,
        "text_config": {**TEXT_CONFIG, **text, "vocab_size": vocab, "eos_token_id": 0},
        "audio_encoder_config": audio,
        "torch_dtype": "bfloat16",
    }


def _lm_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    t = cfg["text_config"]
    h, inter, d = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    q, kv = t["num_attention_heads"] * d, t["num_key_value_heads"] * d
    shapes = {"body.norm.weight": (h,), "tied.embedding.text_embedding.weight": (t["vocab_size"], h),
              "tied.embedding.modality_embeddings.0.embedding.weight": (8 * 1026, h),
              "tied.head.text_head.weight": (t["vocab_size"], h)}  # stored but unused: TTS needs no text head
    for i in range(t["num_hidden_layers"]):
        p = f"body.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    return shapes


def _codec_shapes(codec: dict) -> dict[str, tuple[int, ...]]:
    acoustic, semantic, dim, c = codec["acoustic"], codec["semantic"], codec["codebook_dim"], codec["channels"]
    latent = acoustic + semantic
    shapes = {"fc2.weight": (acoustic, latent), "fc2.bias": (acoustic,), "fc.weight": (latent, latent),
              "fc.bias": (latent,), "fc1.weight": (semantic, latent), "fc1.bias": (semantic,)}  # fc1: semantic decoder side
    for i in range(8):
        p = f"quantizer.quantizers.{i}."
        shapes |= {p + "codebook.embed": (1024, dim), p + "codebook.embed_avg": (1024, dim),
                   p + "codebook.cluster_size": (1024,), p + "codebook.inited": (1,),
                   p + "project_out.weight": (latent, dim), p + "project_out.bias": (latent,),
                   p + "project_in.weight": (dim, latent), p + "project_in.bias": (dim,)}
    d = "acoustic_decoder."
    shapes |= {d + "conv1.weight": (c[0], acoustic, 7), d + "conv1.bias": (c[0],),
               d + "snake1.alpha": (1, c[-1], 1), d + "conv2.weight": (1, c[-1], 7), d + "conv2.bias": (1,)}
    for b, s in enumerate(CODEC_STRIDES):
        p = f"{d}block.{b}."
        shapes |= {p + "snake1.alpha": (1, c[b], 1), p + "conv_t1.weight": (c[b], c[b + 1], 2 * s),
                   p + "conv_t1.bias": (c[b + 1],)}
        for r in (1, 2, 3):
            shapes |= _residual_unit(f"{p}res_unit{r}.", c[b + 1])
    return {CODEC + n: s for n, s in (shapes | _encoder_shapes(codec)).items()}


def _residual_unit(p: str, ch: int) -> dict[str, tuple[int, ...]]:
    """A DAC residual unit: Snake, conv k7 (dilated), Snake, conv k1."""
    return {p + "snake1.alpha": (1, ch, 1), p + "conv1.weight": (ch, ch, 7), p + "conv1.bias": (ch,),
            p + "snake2.alpha": (1, ch, 1), p + "conv2.weight": (ch, ch, 1), p + "conv2.bias": (ch,)}


def _encoder_shapes(codec: dict) -> dict[str, tuple[int, ...]]:
    """The codec's encoder side under its real names: DAC encoder, HuBERT (transformers' HubertModel, base
    layout: group-norm feature encoder without conv biases, post-norm layers), semantic encoder."""
    shapes = {}
    a, w = "acoustic_encoder.", codec["encoder_width"]
    shapes |= {a + "conv1.weight": (w, 1, 7), a + "conv1.bias": (w,)}
    for b, s in enumerate(CODEC_STRIDES):
        p, ch = f"{a}block.{b}.", w << b
        for r in (1, 2, 3):
            shapes |= _residual_unit(f"{p}res_unit{r}.", ch)
        shapes |= {p + "snake1.alpha": (1, ch, 1), p + "conv1.weight": (2 * ch, ch, 2 * s), p + "conv1.bias": (2 * ch,)}
    top = w << len(CODEC_STRIDES)
    shapes |= {a + "snake1.alpha": (1, top, 1), a + "conv2.weight": (codec["acoustic"], top, 3),
               a + "conv2.bias": (codec["acoustic"],)}

    h, cd, ff, k = codec["semantic"], codec["conv_dim"], codec["intermediate"], codec["pos_kernel"]
    m = "semantic_model."
    shapes |= {m + "masked_spec_embed": (h,)}  # training-only, stored in HuBERT checkpoints
    for i, kernel in enumerate(HUBERT_KERNELS):
        shapes[f"{m}feature_extractor.conv_layers.{i}.conv.weight"] = (cd, 1 if i == 0 else cd, kernel)
    shapes |= {m + "feature_extractor.conv_layers.0.layer_norm.weight": (cd,),
               m + "feature_extractor.conv_layers.0.layer_norm.bias": (cd,),
               m + "feature_projection.layer_norm.weight": (cd,), m + "feature_projection.layer_norm.bias": (cd,),
               m + "feature_projection.projection.weight": (h, cd), m + "feature_projection.projection.bias": (h,)}
    e = m + "encoder."
    shapes |= {e + "pos_conv_embed.conv.bias": (h,),
               e + "pos_conv_embed.conv.parametrizations.weight.original0": (1, 1, k),  # weight norm g (dim=2)
               e + "pos_conv_embed.conv.parametrizations.weight.original1": (h, h // 16, k),  # weight norm v
               e + "layer_norm.weight": (h,), e + "layer_norm.bias": (h,)}
    for i in range(codec["layers"]):
        p = f"{e}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{p}attention.{proj}.weight": (h, h), f"{p}attention.{proj}.bias": (h,)}
        shapes |= {p + "layer_norm.weight": (h,), p + "layer_norm.bias": (h,),
                   p + "feed_forward.intermediate_dense.weight": (ff, h), p + "feed_forward.intermediate_dense.bias": (ff,),
                   p + "feed_forward.output_dense.weight": (h, ff), p + "feed_forward.output_dense.bias": (h,),
                   p + "final_layer_norm.weight": (h,), p + "final_layer_norm.bias": (h,)}

    s = "encoder_semantic."
    shapes[s + "conv.weight"] = (h, h, 3)
    for b in range(SEMANTIC_BLOCKS):
        p = f"{s}conv_blocks.{b}."
        for u in range(SEMANTIC_UNITS):
            shapes |= {f"{p}res_units.{u}.conv1.weight": (h, h, 3), f"{p}res_units.{u}.conv2.weight": (h, h, 1)}
        shapes |= {p + "conv.weight": (h, h, 3), p + "conv.bias": (h,)}
    return shapes


def _random(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Scales that keep activations O(1) and give the logits wide margins (few near-ties for greedy parity).
    Each tensor has its own generator, so values do not depend on how tensors are spread over shards."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64)  # any seed ≥ 0
    return _scaled(name, shape, gen).to(torch.bfloat16)


def _scaled(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".alpha"):
        return 0.5 + torch.rand(shape, generator=gen)
    if name.endswith("weight.original0"):  # a weight-norm magnitude per kernel tap
        return 1.0 + torch.rand(shape, generator=gen)
    if name.endswith("modality_embeddings.0.embedding.weight"):
        return 0.5 * torch.randn(shape, generator=gen)  # also the head: logits of std ≈ 4
    if name.endswith(("embedding.weight", "codebook.embed", "text_head.weight")):
        return torch.randn(shape, generator=gen)
    if name.endswith(".bias") or len(shape) < 2:
        return 0.1 * torch.randn(shape, generator=gen)
    fan_in = shape[1] * (shape[2] if len(shape) == 3 else 1)
    if ".conv_t1." in name:
        fan_in = shape[0] * shape[2] // 2  # a transposed conv's input fan is Cin·k/stride
    gain = 1.0
    if "res_unit" in name and name.endswith("conv2.weight"):
        gain = 0.25  # residual branches small, so the signal does not grow block after block
    elif name.endswith("acoustic_decoder.conv2.weight"):
        gain = 0.05  # a waveform of moderate loudness
    return gain * torch.randn(shape, generator=gen) / fan_in ** 0.5


MARKER = "higgs-trt-random.json"  # says what this directory is, so that tiny-checkpoint may replace it later
MADE = re.compile(r"config\.json|tokenizer\.json|model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors")


def write_random_checkpoint(out: Path, seed: int = 0, shards: int = 2, size: str = "tiny") -> Path:
    """Write the checkpoint into a staging directory beside `out`, then swap it in: `out` may be new, empty or a
    random checkpoint written here before (runtime/outputs.py); anything else is refused."""
    from higgs_trt.runtime.outputs import output_dir, staged_dir

    out = Path(out)
    target = output_dir(out, "a random checkpoint", _not_a_random_checkpoint)
    try:
        with staged_dir(target) as staging:
            _write(staging, seed, shards, size)
    except SafetensorError as e:  # the safetensors writer's I/O errors (a full disk) come as this, not as OSError
        raise HiggsError(f"{out}: cannot be written ({e})") from None
    return out


def _not_a_random_checkpoint(directory: Path) -> str | None:
    from higgs_trt.runtime.outputs import unexpected_entries

    if not (directory / MARKER).is_file():
        return f"holds no {MARKER} (not a random checkpoint written by tiny-checkpoint)"
    others = unexpected_entries(directory, lambda name: name == MARKER or MADE.fullmatch(name) is not None)
    return f"holds files a random checkpoint does not ({', '.join(sorted(others)[:5])})" if others else None


def _write(out: Path, seed: int, shards: int, size: str) -> None:
    text, codec = SIZES[size]
    (out / MARKER).write_text(json.dumps({"made_by": "higgs-trt tiny-checkpoint", "size": size, "seed": seed,
                                          "shards": shards, "weights": "random: for tests and benchmarks only"},
                                         indent=1) + "\n")
    cfg = _config(text, build_tokenizer(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    shapes = _lm_shapes(cfg) | _codec_shapes(codec)
    names = sorted(shapes)
    if shards == 1:
        _save({n: _random(n, shapes[n], seed) for n in names}, out / "model.safetensors")
        return
    weight_map = {}
    for i in range(shards):  # one shard in memory at a time
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        _save({n: _random(n, shapes[n], seed) for n in part}, out / file)
        weight_map |= {n: file for n in part}
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _save(tensors: dict, path: Path) -> None:
    from higgs_trt.runtime.outputs import umask

    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~umask())  # safetensors makes its file private (0600), unlike every other file here
