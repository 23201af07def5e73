"""Typed view of a Higgs Audio v3 `config.json` (model_type `higgs_multimodal_qwen3`).

Only what inference needs is kept. Anything this model cannot be (another architecture, no delay pattern,
an audio vocabulary that is not 1024 codes + BOC + EOC, rope scaling) is refused with one clear message.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from higgs_trt.runtime.decoding import AUDIO_VOCAB, NUM_CODEBOOKS
from higgs_trt.runtime.errors import HiggsError

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


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise HiggsError(f"config.json: {what}")


def _rope_theta(text: dict) -> float:
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    for source in (params, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        _require(kind == "default", f"rope type {kind!r} is not supported (Higgs v3 uses plain RoPE)")
    theta = params.get("rope_theta", text.get("rope_theta"))
    return DEFAULT_ROPE_THETA if theta is None else float(theta)


def parse_config(raw: dict) -> HiggsConfig:
    _require(raw.get("model_type") == "higgs_multimodal_qwen3",
             f"model_type is {raw.get('model_type')!r}, expected 'higgs_multimodal_qwen3'")
    text, audio = raw.get("text_config"), raw.get("audio_encoder_config")
    _require(isinstance(text, dict), "missing text_config")
    _require(isinstance(audio, dict), "missing audio_encoder_config")
    _require(text.get("model_type", "qwen3") == "qwen3", f"text_config.model_type is {text.get('model_type')!r}, expected 'qwen3'")
    _require(text.get("hidden_act", "silu") == "silu", f"hidden_act {text.get('hidden_act')!r} is not supported")

    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        cfg = HiggsConfig(
            hidden_size=hidden,
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate_size=int(text["intermediate_size"]),
            text_vocab_size=int(text["vocab_size"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(text),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        )
    except KeyError as e:
        raise HiggsError(f"config.json: text_config lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise HiggsError(f"config.json: bad value in text_config ({e})") from None

    _require(min(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) > 0,
             "text_config sizes must be positive")
    _require(cfg.num_heads % cfg.num_kv_heads == 0,
             f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    _require(cfg.head_dim % 2 == 0, f"head_dim {cfg.head_dim} must be even for RoPE")

    _require(audio.get("encoder_type", "discrete") == "discrete",
             f"audio_encoder_config.encoder_type {audio.get('encoder_type')!r} is not 'discrete'")
    _require(audio.get("use_delay_pattern") is True,
             "audio_encoder_config.use_delay_pattern must be true (the decode loop is built on the delay pattern)")
    _require(audio.get("num_codebooks") == NUM_CODEBOOKS,
             f"audio_encoder_config.num_codebooks is {audio.get('num_codebooks')}, expected {NUM_CODEBOOKS}")
    _require(audio.get("vocab_size") == AUDIO_VOCAB,
             f"audio_encoder_config.vocab_size is {audio.get('vocab_size')}, expected {AUDIO_VOCAB} "
             "(1024 codes + BOC + EOC per codebook)")
    _require(audio.get("tie_word_embeddings", True) is True,
             "audio_encoder_config.tie_word_embeddings must be true (the audio head is the audio embedding table)")
    _require(audio.get("out_dim", cfg.hidden_size) == cfg.hidden_size,
             f"audio_encoder_config.out_dim {audio.get('out_dim')} differs from hidden_size {cfg.hidden_size}")
    return cfg


def load_config(checkpoint_dir: Path) -> HiggsConfig:
    path = Path(checkpoint_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise HiggsError(f"{path}: not found (is {checkpoint_dir} a Higgs checkpoint directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HiggsError(f"{path}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise HiggsError(f"{path}: not a JSON object")
    return parse_config(raw)
