"""Typed view of a Higgs Audio v3 `config.json` (model_type `higgs_multimodal_qwen3`).

Only what inference needs is kept. Anything this model cannot be (another architecture, no delay pattern,
an audio vocabulary that is not 1024 codes + BOC + EOC, rope scaling) is refused with one clear message.
"""

from dataclasses import asdict, dataclass
from pathlib import Path

from .decoding import AUDIO_VOCAB, NUM_CODEBOOKS
from .errors import HiggsError
from .jsonfile import read_json
from .options import MIN_MAX_SEQ

DEFAULT_ROPE_THETA = 1e6  # some revisions ship `rope_theta: null`; every implementation uses 1e6


@dataclass(frozen=True)
class HiggsConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    text_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_codebooks: int = NUM_CODEBOOKS
    codebook_vocab: int = AUDIO_VOCAB

    @property
    def audio_table_rows(self) -> int:
        return self.num_codebooks * self.codebook_vocab

    def to_dict(self) -> dict:
        return asdict(self)


TEXT_EMBEDDING = "tied.embedding.text_embedding.weight"
AUDIO_TABLE = "tied.embedding.modality_embeddings.0.embedding.weight"  # the audio embedding, tied to the audio head


def lm_tensor_shapes(cfg: HiggsConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors the language model reads, by their names, with their shapes: what the torch reference
    (builder/model.py, whose parameters are exactly these) and the GPU engine load."""
    h, d, hq, hkv, inner = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    shapes = {}
    for i in range(cfg.num_layers):
        p = f"body.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (hq * d, h), p + "self_attn.k_proj.weight": (hkv * d, h),
                   p + "self_attn.v_proj.weight": (hkv * d, h), p + "self_attn.o_proj.weight": (h, hq * d),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "post_attention_layernorm.weight": (h,),
                   p + "mlp.gate_proj.weight": (inner, h), p + "mlp.up_proj.weight": (inner, h),
                   p + "mlp.down_proj.weight": (h, inner)}
    return shapes | {"body.norm.weight": (h,), TEXT_EMBEDDING: (cfg.text_vocab_size, h),
                     AUDIO_TABLE: (cfg.audio_table_rows, h)}


# Higgs Audio v3's decoder (Qwen3 backbone): the dimensions GPU benchmarks use with random weights.
HIGGS_V3 = HiggsConfig(2560, 36, 32, 8, 128, 9728, 151936, 1e-6, 1e6, 32768)


# Sane bounds for each size (far above any Qwen3 model): a config beyond them is a typo, not a model to allocate.
LIMITS = {"hidden_size": 1 << 16, "num_hidden_layers": 1024, "num_attention_heads": 1024,
          "num_key_value_heads": 1024, "head_dim": 1024, "intermediate_size": 1 << 20, "vocab_size": 1 << 22,
          "max_position_embeddings": 1 << 22}


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise HiggsError(f"config.json: {what}")


MINIMA = {"max_position_embeddings": MIN_MAX_SEQ}  # fewer positions than the shortest cache: no engine to build


def _int(section: dict, where: str, key: str, default=None) -> int:
    """A size: a JSON integer (not a string, float or bool) in MINIMA[key] (else 1)..LIMITS[key]."""
    value = section.get(key, default)
    low = MINIMA.get(key, 1)
    _require(value is not None, f"{where} lacks {key!r}")
    _require(type(value) is int, f"{where}.{key} must be an integer, got {value!r}")
    _require(low <= value <= LIMITS[key], f"{where}.{key} is {value}, outside {low}..{LIMITS[key]}")
    return value


def _number(section: dict, where: str, key: str, default: float, low: float, high: float) -> float:
    """A JSON number (not a string or bool), finite, low < value < high."""
    value = section.get(key, default)
    _require(type(value) in (int, float), f"{where}.{key} must be a number, got {value!r}")
    _require(low < value < high, f"{where}.{key} is {value}, outside ({low:g}, {high:g})")
    return float(value)


def _rope_theta(text: dict) -> float:
    params, scaling = text.get("rope_parameters") or {}, text.get("rope_scaling") or {}
    _require(isinstance(params, dict) and isinstance(scaling, dict),
             "text_config.rope_parameters and rope_scaling must be objects")
    for source in (params, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        _require(kind == "default", f"rope type {kind!r} is not supported (Higgs v3 uses plain RoPE)")
    section, where = (params, "text_config.rope_parameters") if "rope_theta" in params else (text, "text_config")
    if section.get("rope_theta") is None:
        return DEFAULT_ROPE_THETA
    return _number(section, where, "rope_theta", None, 0, 1e12)


def parse_config(raw: dict) -> HiggsConfig:
    _require(raw.get("model_type") == "higgs_multimodal_qwen3",
             f"model_type is {raw.get('model_type')!r}, expected 'higgs_multimodal_qwen3'")
    text, audio = raw.get("text_config"), raw.get("audio_encoder_config")
    _require(isinstance(text, dict), "missing text_config")
    _require(isinstance(audio, dict), "missing audio_encoder_config")
    _require(text.get("model_type", "qwen3") == "qwen3", f"text_config.model_type is {text.get('model_type')!r}, expected 'qwen3'")
    _require(text.get("hidden_act", "silu") == "silu", f"hidden_act {text.get('hidden_act')!r} is not supported")

    t = "text_config"
    hidden = _int(text, t, "hidden_size")
    heads = _int(text, t, "num_attention_heads")
    head_dim = _int(text, t, "head_dim") if text.get("head_dim") is not None else hidden // heads
    cfg = HiggsConfig(
        hidden_size=hidden,
        num_layers=_int(text, t, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_int(text, t, "num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=_int(text, t, "intermediate_size"),
        text_vocab_size=_int(text, t, "vocab_size"),
        rms_norm_eps=_number(text, t, "rms_norm_eps", 1e-6, 0, 1),
        rope_theta=_rope_theta(text),
        max_position_embeddings=_int(text, t, "max_position_embeddings", 32768),
    )
    _require(cfg.head_dim > 0, f"text_config: hidden_size {hidden} / num_attention_heads {heads} gives no head_dim")
    _require(cfg.num_heads % cfg.num_kv_heads == 0,
             f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    _require(cfg.head_dim % 2 == 0, f"head_dim {cfg.head_dim} must be even for RoPE")

    _require(audio.get("encoder_type", "discrete") == "discrete",
             f"audio_encoder_config.encoder_type {audio.get('encoder_type')!r} is not 'discrete'")
    _require(audio.get("use_delay_pattern") is True,
             "audio_encoder_config.use_delay_pattern must be true (the decode loop is built on the delay pattern)")
    _require(type(audio.get("num_codebooks")) is int and audio["num_codebooks"] == NUM_CODEBOOKS,
             f"audio_encoder_config.num_codebooks is {audio.get('num_codebooks')!r}, expected {NUM_CODEBOOKS}")
    _require(type(audio.get("vocab_size")) is int and audio["vocab_size"] == AUDIO_VOCAB,
             f"audio_encoder_config.vocab_size is {audio.get('vocab_size')!r}, expected {AUDIO_VOCAB} "
             "(1024 codes + BOC + EOC per codebook)")
    _require(audio.get("tie_word_embeddings", True) is True,
             "audio_encoder_config.tie_word_embeddings must be true (the audio head is the audio embedding table)")
    out_dim = audio.get("out_dim", cfg.hidden_size)
    _require(type(out_dim) is int and out_dim == cfg.hidden_size,
             f"audio_encoder_config.out_dim {out_dim!r} differs from hidden_size {cfg.hidden_size}")
    return cfg


def load_config(checkpoint_dir: Path) -> HiggsConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not path.exists():
        raise HiggsError(f"{path}: not found (is {checkpoint_dir} a Higgs checkpoint directory?)")
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise HiggsError(f"{path}: not a JSON object")
    return parse_config(raw)
