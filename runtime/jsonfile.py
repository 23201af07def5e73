"""A user's JSON file, read strictly: UTF-8 only, no duplicate keys, no NaN/Infinity; one-line errors naming it."""

import json
from pathlib import Path

from .errors import HiggsError
from .inputs import JSON_BYTES, input_file


def read_json(path: Path) -> object:
    try:
        raw = input_file(path, JSON_BYTES).read_bytes()
    except OSError as e:
        raise HiggsError(f"{path}: unreadable ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise HiggsError(f"{path}: unreadable: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    return parse_json(text, path)


def parse_json(text: str, source) -> object:
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except ValueError as e:
        raise HiggsError(f"{source}: unreadable: not valid JSON ({e})") from None
    except RecursionError:
        raise HiggsError(f"{source}: unreadable: JSON nested too deeply") from None


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice")
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
