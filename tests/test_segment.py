"""The text segmenter (runtime/segment.py): its rule case by case, and its invariants over random texts cut into
random pieces (a fixed seed: hypothesis is not installed)."""

import random
import re
import time
import unicodedata
from itertools import pairwise

import pytest

from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.prompt import CONTROL_TAG
from higgs_trt.runtime.segment import Segmenter, split_text

BIG = 10_000  # a budget nothing here reaches


def split(text, max_units=BIG, clause_units=None, measure=len):
    return split_text(text, measure, max_units, clause_units or max_units)


def fed(pieces, max_units=BIG, clause_units=None, measure=len):
    segmenter = Segmenter(measure, max_units, clause_units or max_units)
    out = [s for piece in pieces for s in segmenter.feed(piece)]
    return out + segmenter.finish()


def utf8_bytes(text):
    return len(text.encode())


def uneven(text):
    """Shrinks when a letter follows a digit: no budget logic may assume a measure grows with its text."""
    return len(text) + (3 if text[-1:].isdigit() else 0)


def is_blank(ch):
    return ch.isspace() or unicodedata.category(ch) == "Cf"


def spans(text, segments):
    """Where each segment lies in `text`, checking that they are stripped, visible substrings in order with only
    whitespace and format characters around them."""
    found, at = [], 0
    for segment in segments:
        assert segment == segment.strip() and not all(is_blank(ch) for ch in segment), repr(segment)
        start = text.index(segment, at)
        assert all(is_blank(ch) for ch in text[at:start]), (text[at:start], segments)
        found.append((start, start + len(segment)))
        at = start + len(segment)
    assert all(is_blank(ch) for ch in text[at:])
    return found


def inside_one(span, segment_spans):
    return any(a <= span[0] and span[1] <= b for a, b in segment_spans)


# the rule, case by case

@pytest.mark.parametrize("text, segments", [
    ("Hello there. How are you? Fine!", ["Hello there.", "How are you?", "Fine!"]),
    ("Really?! Yes... Indeed… Done", ["Really?!", "Yes...", "Indeed…", "Done"]),
    ("Wait... what? Go on.", ["Wait... what?", "Go on."]),  # a lowercase letter goes on the sentence
    ("Mr. Smith met Dr. Jones and Mrs. Brown at St. Mary's. They left.",
     ["Mr. Smith met Dr. Jones and Mrs. Brown at St. Mary's.", "They left."]),
    ("Use e.g. salt, i.e. NaCl, vs. Sugar etc. Then stop.", ["Use e.g. salt, i.e. NaCl, vs. Sugar etc. Then stop."]),
    ("We met in the U.S. Army. J. R. R. Tolkien wrote. So did I. Fine.",
     ["We met in the U.S. Army.", "J. R. R. Tolkien wrote.", "So did I.", "Fine."]),
    ("Ph.D. students came. Then we ate.", ["Ph.D. students came.", "Then we ate."]),
    ("It cost approx. 5 dollars. See No. 7 on p. 12 today.", ["It cost approx. 5 dollars.", "See No. 7 on p. 12 today."]),
])
def test_sentences_and_abbreviations(text, segments):
    assert split(text) == segments


@pytest.mark.parametrize("text, segments", [
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("“Curly.” «Guillemets.» 'Single.' (Brackets.) End", ["“Curly.”", "«Guillemets.»", "'Single.'", "(Brackets.)", "End"]),
    ("Il dit « Oui. » Ensuite « Non ! » Fin", ["Il dit « Oui. »", "Ensuite « Non ! »", "Fin"]),
    ("„So.“ Dann", ["„So.“", "Dann"]),
    ('"Help!" she cried. "Why?" Bob asked.', ['"Help!" she cried.', '"Why?"', "Bob asked."]),
    ('"Yes!", he said. Done.', ['"Yes!", he said.', "Done."]),
])
def test_quotes_stay_with_their_sentence(text, segments):
    assert split(text) == segments


def test_numbers_are_never_cut():
    text = "Pi is 3.14, e is 2.718; at 10:30, 1,000.5 units of version 2.0 shipped. Next 4.5 ok."
    segments = split(text, clause_units=1)  # every clause end that the rule sees is taken
    assert segments == ["Pi is 3.14,", "e is 2.718;", "at 10:30,", "1,000.5 units of version 2.0 shipped.",
                        "Next 4.5 ok."]


@pytest.mark.parametrize("text, segments", [
    ("你好。我很好！你呢？", ["你好。", "我很好！", "你呢？"]),
    ("「好的。」然后走了。", ["「好的。」", "然后走了。"]),
    ("こんにちは。元気ですか？はい", ["こんにちは。", "元気ですか？", "はい"]),
    ("Hi。你好", ["Hi。", "你好"]),
])
def test_cjk_sentence_marks_need_no_space(text, segments):
    assert split(text) == segments


@pytest.mark.parametrize("text, clause_units, segments", [
    ("one, two, three, four, five, six.", 8, ["one, two,", "three, four,", "five, six."]),
    ("one, two, three, four, five, six.", 100, ["one, two, three, four, five, six."]),
    ("He paused—then spoke—slowly at last.", 5, ["He paused—", "then spoke—", "slowly at last."]),
    ("第一，第二、第三；第四：第五。", 2, ["第一，", "第二、", "第三；", "第四：", "第五。"]),
    ("a,b;c:d,e but f, g", 1, ["a,b;c:d,e but f,", "g"]),  # , ; : end a clause only before whitespace
    ("Note: it works; really, it does.", 4, ["Note:", "it works;", "really,", "it does."]),
    ("Apples, pears, etc., and figs.", 1, ["Apples,", "pears,", "etc.,", "and figs."]),  # the last mark decides
])
def test_clauses_end_a_segment_past_clause_units(text, clause_units, segments):
    assert split(text, 100, clause_units) == segments


@pytest.mark.parametrize("text, segments", [
    ("Title\n\nBody one. Body two", ["Title", "Body one.", "Body two"]),
    ("line one\nline two\r\n\r\nnext", ["line one\nline two", "next"]),
    ("para one \n \t \n para two", ["para one", "para two"]),
    ("one\u2029two", ["one", "two"]),
    ("...\n\nHello.", ["...\n\nHello."]),  # nothing to say yet: the head goes on
    ("<|emotion:elation|>\n\nGreat news.", ["<|emotion:elation|>\n\nGreat news."]),  # a tag is not speech
    ("Hello.\n\n\u200b\u2060 \n", ["Hello."]),  # a piece of format characters only is dropped
])
def test_paragraphs(text, segments):
    assert split(text) == segments


@pytest.mark.parametrize("text", ["", " \n\n\t ", "\u200b \ufeff"])
def test_nothing_to_say_gives_no_segments(text):
    assert split(text) == [] and fed(list(text)) == []


def test_inline_tags_are_atoms():
    text = "Hi <|emotion:elation|> there. Wow<|prosody:pause|>ok. 你<|sfx:laugh|>好。"
    assert split(text) == ["Hi <|emotion:elation|> there.", "Wow<|prosody:pause|>ok.", "你<|sfx:laugh|>好。"]
    tags = "".join(f"<|style:s{i}|>x" for i in range(30))
    segments = split(tags, 14)
    segment_spans = spans(tags, segments)
    assert all(inside_one(m.span(), segment_spans) for m in CONTROL_TAG.finditer(tags))
    assert max(map(len, segments)) <= 14
    # a "." inside a tag ends nothing; a broken tag is plain text
    assert split("<|style:v1.2|> Go. <|bad tag|> On. <|x|") == ["<|style:v1.2|> Go.", "<|bad tag|> On.", "<|x|"]


def test_a_word_longer_than_the_budget_is_cut_between_characters():
    word = "supercalifragilisticexpialidocious" * 30
    segments = split(f"Say {word} now.", 7)
    assert segments[0] == "Say" and segments[-1] == "now."
    assert "".join(segments[1:-1]) == word
    assert all(len(s) == 7 for s in segments[1:-2])  # the longest piece that fits, each time


@pytest.mark.parametrize("unit, max_units", [
    ("e\u0301", 5),  # e with a combining acute: cut as a pair
    ("\U0001f44d\U0001f3fd", 3),  # thumbs up with a skin tone
    ("\U0001f468\u200d\U0001f469\u200d\U0001f467", 6),  # a family joined by ZWJ
    ("\U0001f1fa\ufe0f", 3),  # a variation selector
    ("<|sfx:a|>", 20),
])
def test_cuts_between_characters_keep_them_whole(unit, max_units):
    segments = split(unit * 40, max_units)
    assert "".join(segments) == unit * 40
    assert all(len(s) <= max_units and len(s) % len(unit) == 0 for s in segments)


def test_no_space_scripts_are_cut_between_characters():
    text = "我是中国人我是中国人我是中国人"
    assert split(text, 4) == ["我是中国", "人我是中", "国人我是", "中国人"]
    # never after an opening mark or before a closing one, even at the cost of a shorter segment
    assert split("「我是中国人」你好", 7) == ["「我是中国人」", "你好"]
    assert split("「我是中国人」你好", 6) == ["「我是中国", "人」你好"]
    thai = "สวัสดีครับ" * 6  # Thai: no spaces, vowel marks that belong to the consonant before them
    segments = split(thai, 5)
    assert "".join(segments) == thai and all(len(s) <= 5 for s in segments)
    assert not any(unicodedata.category(s[0]).startswith("M") for s in segments)


def test_run_on_text_is_cut_at_the_last_word_boundary_that_fits():
    words = [random.Random(0).choice(["a", "bb", "ccc", "dddd"]) for _ in range(200)]
    text = " ".join(words)
    segments = split(text, 20)
    assert " ".join(segments) == text
    for segment, after in pairwise(segments):
        assert len(segment) <= 20 < len(segment) + 1 + len(after.split()[0])


def test_an_atom_over_the_budget_is_an_error():
    with pytest.raises(HiggsError, match=r"'<\|emotion:elation\|>', which alone measures 19, more than a segment "
                                         r"may \(10\)"):
        split("Hi <|emotion:elation|> there", 10)
    with pytest.raises(HiggsError, match="'你', which alone measures 3"):
        split("ab 你好", 2, measure=utf8_bytes)


@pytest.mark.parametrize("max_units, clause_units", [(10, 0), (10, 11), (0, 0)])
def test_bad_budgets(max_units, clause_units):
    with pytest.raises(HiggsError, match="0 < clause units ≤ max units"):
        Segmenter(len, max_units, clause_units)


# streaming: look-ahead, flush

def test_a_segment_comes_as_soon_as_its_look_ahead_arrives():
    s = Segmenter(len, BIG, BIG)
    assert s.feed("Hello there.") == [] and s.feed("  ") == []  # "." waits for the next non-space character
    assert s.feed("How") == ["Hello there."]
    assert s.feed(" about Mr.") == [] and s.feed(" Smith") == []  # an abbreviation: no cut
    assert s.feed("? 你好。") == ["How about Mr. Smith?"]
    assert s.feed("我") == ["你好。"]  # a CJK mark waits for one character: a closing mark may follow
    assert s.feed("很好\n") == [] and s.feed("\n") == [] and s.feed("x") == ["我很好"]
    assert s.finish() == ["x"]
    assert s.finish() == []


def test_flush_speaks_what_is_there_but_an_unfinished_tag():
    s = Segmenter(len, BIG, BIG)
    assert s.feed("Hello there") == [] and s.flush() == ["Hello there"]
    assert s.feed(" and Mr. Smith <|emotion:ela") == [] and s.flush() == ["and Mr. Smith"]
    assert s.feed("tion|> yes. Bye") == ["<|emotion:elation|> yes."]
    assert s.flush() == ["Bye"] and s.flush() == []
    assert s.feed("x <") == [] and s.flush() == ["x"] and s.finish() == ["<"]


def test_flush_keeps_the_budget():
    s = Segmenter(len, 5, 5)
    assert s.feed("abcdefghijkl") == []  # the word may go on
    assert s.flush() == ["abcde", "fghij", "kl"]


# invariants over random texts and random pieces

FRAGMENTS = [
    "Hello", "world", "the", "quick", "brown", "fox", "I", "A", "Mr.", "Dr.", "U.S.", "e.g.", "etc.", "No", "5",
    "3.14", "1,000.5", "10:30", "2.0", ".", "!", "?", "?!", "...", "…", ",", ";", ":", "—", '"', "'", "“", "”",
    "«", "»", "(", ")", "。", "！", "？", "、", "，", "「", "」", "你好", "我是中国人", "こんにちは", "สวัสดีครับ",
    "e\u0301", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "<|emotion:a|>", "<|sfx:b|>",
    "<|", "|>", "<", "\u200b", "supercalifragilistic", "word" * 9,
]
SEPARATORS = [" "] * 6 + ["", "", "\n", "\n\n", "  ", "\t", " \n \n", "\u3000"]
MEASURES = [len, utf8_bytes, uneven]


def random_text(rng):
    return "".join(rng.choice(FRAGMENTS) + rng.choice(SEPARATORS) for _ in range(rng.randrange(60)))


def random_pieces(rng, text):
    cuts = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randrange(12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def outcome(run, *args):
    """What run(*args) returns, or the message of the HiggsError it raises."""
    try:
        return run(*args)
    except HiggsError as e:
        return str(e)


def test_any_pieces_give_the_segments_of_the_whole_text():
    rng = random.Random(53)
    checked = errors = 0
    for _ in range(400):
        text = random_text(rng)
        measure = rng.choice(MEASURES)
        max_units = rng.randrange(4, 80)
        clause_units = rng.randrange(1, max_units + 1)
        whole = outcome(split, text, max_units, clause_units, measure)
        chunkings = [random_pieces(rng, text) for _ in range(6)] + [list(text)]
        for pieces in chunkings:
            assert outcome(fed, pieces, max_units, clause_units, measure) == whole, (text, pieces)
        if isinstance(whole, str):
            errors += 1
            continue
        checked += 1
        segment_spans = spans(text, whole)
        assert all(measure(s) <= max_units for s in whole)
        assert all(inside_one(m.span(), segment_spans) for m in CONTROL_TAG.finditer(text))
        squeezed = re.sub(r"\s", "", text)
        if "\u200b" not in text:
            assert re.sub(r"\s", "", "".join(whole)) == squeezed
    assert checked > 300 and errors > 10  # both paths ran


def test_budget_holds_for_every_measure_on_long_texts():
    rng = random.Random(54)
    for measure in MEASURES:
        text = "".join(random_text(rng) for _ in range(20))
        for max_units in (25, 60, 200):
            segments = split(text, max_units, max_units // 2, measure)
            assert segments and all(measure(s) <= max_units for s in segments)
            spans(text, segments)


def test_streaming_measures_exactly_what_the_whole_text_does():
    """Work is not redone as text trickles in: one character at a time makes the same measure calls."""
    rng = random.Random(7)
    text = "".join(random_text(rng) for _ in range(10))
    calls = {"whole": [], "streamed": []}
    split(text, 40, 20, lambda t: calls["whole"].append(t) or len(t))
    fed(list(text), 40, 20, lambda t: calls["streamed"].append(t) or len(t))
    assert calls["streamed"] == calls["whole"]


def test_work_is_linear_in_the_text():
    paragraph = ("Mr. Smith said: one, two, three. " * 3 + " ".join(["run", "on", "words"] * 40) + " "
                 + "x" * 300 + " 我是中国人" * 30 + "。\n\n")
    measured = {4: [], 16: []}
    for copies, chars in measured.items():
        split(paragraph * copies, 50, 20, lambda t, chars=chars: chars.append(len(t)) or len(t))
    assert sum(measured[16]) <= 4.2 * sum(measured[4])
    text = paragraph * (100_000 // len(paragraph))
    start = time.perf_counter()
    split(text, 50, 20)
    assert time.perf_counter() - start < 10  # ~100k characters; a quadratic pass would take minutes
