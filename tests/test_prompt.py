import json

import numpy as np
import pytest

from higgs_trt.runtime.decoding import BOC, EOC
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt, load_reference_codes


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return HiggsTokenizer(tiny_ckpt / "tokenizer.json")


def test_special_ids_come_from_the_tokenizer(tok, tiny_ckpt):
    added = {t["content"]: t["id"] for t in json.loads((tiny_ckpt / "tokenizer.json").read_text())["added_tokens"]}
    for name in ("<|tts|>", "<|text|>", "<|audio|>", "<|ref_text|>", "<|ref_audio|>"):
        assert tok.special(name) == added[name]
    assert tok.special("<|tts|>") != 151667  # the tiny tokenizer's ids differ from the real model's


def test_zero_shot_layout(tok):
    p = build_prompt(tok, "Hello there.")
    body = tok.encode("Hello there.")
    assert list(p.input_ids) == [tok.special("<|tts|>"), tok.special("<|text|>"), *body, tok.special("<|audio|>")]
    assert not p.is_audio.any() and p.text_chars == len("Hello there.")


def test_clone_layout_with_transcript(tok):
    ref = np.arange(24, dtype=np.int32).reshape(3, 8)
    p = build_prompt(tok, "Say this.", ref, ref_text="I said that.")
    ids = list(p.input_ids)
    ref_text = tok.encode("I said that.")
    start = 2 + len(ref_text) + 1  # <|tts|> <|ref_text|> ref_text <|ref_audio|>
    assert ids[:start] == [tok.special("<|tts|>"), tok.special("<|ref_text|>"), *ref_text, tok.special("<|ref_audio|>")]
    assert p.is_audio.sum() == 3 + 7 and p.is_audio[start:start + 10].all()  # T + 7 delayed rows
    rows = p.audio_rows[start:start + 10]
    assert rows[0, 0] == 0 and rows[0, 1] == BOC and rows[-1, 0] == EOC and rows[-1, 7] == 23
    assert all(i == 0 for i in ids[start:start + 10])
    assert ids[start + 10:] == [tok.special("<|text|>"), *tok.encode("Say this."), tok.special("<|audio|>")]


def test_inline_control_tags_are_single_tokens(tok):
    ids = tok.encode("Wow <|emotion:elation|> great")
    assert tok.special("<|emotion:elation|>") in ids


@pytest.mark.parametrize("text, message", [
    ("", "empty"), ("   ", "empty"), ("hi <|emotion:rage|>", "unknown control tag"),
    ("say <|audio|> now", r"may not contain the prompt token\(s\) <\|audio\|>"),
    ("<|eoc|><|endoftext|>", r"<\|endoftext\|>, <\|eoc\|>"), ("bad \udcff byte", "not valid UTF-8"),
    ("bell \x07", "control character U\\+0007"), (b"bytes", "must be a string"),
])
def test_bad_text(tok, text, message):
    with pytest.raises(HiggsError, match=message):
        build_prompt(tok, text)


def test_reference_text_is_checked_too(tok):
    with pytest.raises(HiggsError, match="reference text may not contain"):
        build_prompt(tok, "fine", np.zeros((2, 8), np.int32), ref_text="<|ref_audio|>")


def test_inline_style_tags_are_the_only_added_tokens_text_may_hold(tiny_ckpt):
    from higgs_trt.runtime.prompt import HiggsTokenizer, is_inline_tag

    tok = HiggsTokenizer(tiny_ckpt / "tokenizer.json", 448)
    assert set(tok.structural.values()) == {"<|endoftext|>", "<|tts|>", "<|audio|>", "<|audio_end|>", "<|text|>",
                                            "<|text_end|>", "<|eoc|>", "<|ref_audio|>", "<|ref_text|>"}
    assert all(is_inline_tag(t) for t in ("<|emotion:elation|>", "<|prosody:pause|>", "<|style:calm|>", "<|sfx:laugh|>"))
    assert not any(is_inline_tag(t) for t in ("<|audio|>", "<|emotion|>", "<|emotion:|>", "<|mood:x|>", "<|emotion:a b|>"))


def test_token_ids_outside_the_model_vocabulary_are_refused(tiny_ckpt):
    with pytest.raises(HiggsError, match=r"outside the model's text vocabulary of 300: <\|tts\|> \(384\)"):
        HiggsTokenizer(tiny_ckpt / "tokenizer.json", 300)


def test_missing_special_token(tiny_copy):
    path = tiny_copy / "tokenizer.json"
    raw = json.loads(path.read_text())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] != "<|audio|>"]
    path.write_text(json.dumps(raw))
    with pytest.raises(HiggsError, match=r"lacks the Higgs special token\(s\) <\|audio\|>"):
        HiggsTokenizer(path)


def test_unreadable_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(HiggsError, match="cannot load tokenizer"):
        HiggsTokenizer(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("codes, message", [
    (np.zeros((4, 7), np.int32), "shape"), (np.zeros((0, 8), np.int32), "shape"),
    (np.full((4, 8), 1024), "0..1023"), (np.zeros((4, 8), np.float32), "integers"),
])
def test_reference_codes_are_checked(tmp_path, codes, message):
    np.save(tmp_path / "ref.npy", codes)
    with pytest.raises(HiggsError, match=message):
        load_reference_codes(tmp_path / "ref.npy")
