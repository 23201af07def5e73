"""Range checks of a request's options, shared by the CLI and the server: one line naming the option, or the value."""

import math

from .decoding import Sampling
from .errors import HiggsError

MAX_SEED = 2**63 - 1
# Below this the softmax of logits / T can overflow to inf (then NaN) in float64; 0 is the greedy setting.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest: the samplers divide logits by T in float32


def _real(option: str, value) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past float's range (JSON allows any)
        raise HiggsError(f"{option} must be a finite number, got an integer too large for a float") from None


def sampling(temperature: float, top_k: int, top_p: float, seed: int) -> Sampling:
    temperature, top_p = _real("--temperature", temperature), _real("--top-p", top_p)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise HiggsError(f"--temperature must be a finite number ≥ 0 (0 is greedy), got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise HiggsError(f"--temperature {temperature} is too small to sample with; use 0 (greedy) or ≥ {MIN_TEMPERATURE}")
    if temperature > MAX_TEMPERATURE:
        raise HiggsError(f"--temperature must be at most {MAX_TEMPERATURE:.4g} (float32's range), got {temperature}")
    if top_k < 0:
        raise HiggsError(f"--top-k must be ≥ 0 (0 keeps every code), got {top_k}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise HiggsError(f"--top-p must lie in (0, 1] (1 is off), got {top_p}")
    if not 0 <= seed <= MAX_SEED:
        raise HiggsError(f"--seed must lie in 0..{MAX_SEED} (2**63 - 1), got {seed}")
    return Sampling(temperature, top_k, top_p, seed)


def within(option: str, value: int, low: int, high: int, why: str = "") -> int:
    """An integer option in low..high, refused otherwise (`why` says where `high` comes from)."""
    if not low <= value <= high:
        raise HiggsError(f"{option} must lie in {low}..{high}{' (' + why + ')' if why else ''}, got {value}")
    return value


DEFAULT_MAX_SEQ = 2048
MIN_MAX_SEQ = 16  # the shortest cache an engine is exported with


def cache_length(max_seq: int | None, max_position_embeddings: int) -> int:
    """--max-seq as given (16 up to the model's positions), else 2048 or the model's positions if fewer."""
    if max_seq is None:
        return min(DEFAULT_MAX_SEQ, max_position_embeddings)
    return within("--max-seq", max_seq, MIN_MAX_SEQ, max_position_embeddings, "the model's max_position_embeddings")


def prompt_length(max_seq: int) -> int:
    """The longest prompt (prefill) by default: 512 tokens, or half of the cache if that is less."""
    return min(512, max_seq // 2)


def seconds_within(option: str, value: float, low: float, high: float) -> float:
    """A number of seconds in low..high, refused otherwise (NaN and the infinities included)."""
    if not (math.isfinite(value) and low <= value <= high):
        raise HiggsError(f"{option} must lie in {low:g}..{high:g} seconds, got {value}")
    return value


def server_url(option: str, url: str) -> str:
    """An http(s)://host[:port] address, refused otherwise."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # raises past 65535
    except ValueError as e:
        raise HiggsError(f"{option} {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or parts.path not in ("", "/"):
        raise HiggsError(f"{option} must be a server's address, http(s)://HOST[:PORT] and no path, got {url!r}")
    return url.rstrip("/")


def sizes(option: str, text: str, high: int) -> list[int]:
    """Comma-separated integers in 1..high (batch sizes, concurrency levels)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise HiggsError(f"{option} takes comma-separated integers, got {text!r}") from None
    return [within(option, v, 1, high) for v in values]
