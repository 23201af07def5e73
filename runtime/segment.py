"""Text cut into segments that fit the prompt budget: one rule for long-form text (issue 53) and for text that
streams in (issue 54).

The rule, applied left to right to the text since the last cut (a segment's "head"):

1. Sentence end: a run of sentence marks (. ! ? … ‼ ⁇ ⁈ ⁉ and 。！？｡, so ?!, ... and 。」 too) with the closing
   quotes and brackets after it (Pe, Pf, " ' “ ‘; a closing Pe/Pf mark also after spaces, as French « Oui. »).
   The CJK marks end a sentence at once. The others only before whitespace or the end of the text, and not when the
   next non-space character is a lowercase letter or a digit ("3.14", "No. 5", "Wait... what?", '"Hi!" she said'),
   nor after an abbreviation: a bare "." after one of ABBREVIATIONS (Mr. Dr. St. vs. etc. …), after an initialism
   (U.S. e.g. i.e. a.m.) or after a single capital other than I (J. R. R. Tolkien). The price: "in the U.S. Then"
   and "Plan B. Then" stay one sentence.
2. Paragraph: whitespace holding a blank line (two line breaks, or U+2029) ends a segment.
3. Clause end: a run of clause marks (, ; : — 、，；：) with its closing marks; "," ";" ":" only before whitespace
   (so 1,000.5 and 10:30 are never clause ends). It ends a segment once the head measures at least clause_units.
   A run holding both kinds of marks is what its last mark says: "?!" a sentence end, "etc.," a clause end.
4. Budget: no segment measures more than max_units. When the head stops fitting, it is cut at the last word
   boundary where it fits; in its first word, at the last atom boundary where it fits. Word boundaries are the
   starts of whitespace runs and, in scripts written without spaces (Han, kana, Thai, Lao, Khmer, Myanmar), the
   gaps beside their characters but after an opening or before a closing mark. Atoms are characters with the
   combining marks, variation selectors, emoji modifiers and zero-width-joined characters that follow them, and
   whole inline tags (<|emotion:elation|>), so a tag is never cut. An atom that alone measures more is an error.
   For a measure that never shrinks as text grows (len; token counts almost always) this is the longest head that
   fits; for any measure, every segment fits and the cuts depend on the text alone.

Rules 1–3 cut only a head that has something to say (a letter or a digit outside tags): "..." at the start of a
paragraph joins the next sentence. Segments are substrings of the text in order: between them, before the first and
after the last lies only whitespace, and a piece of nothing but whitespace and format characters (Cf: zero-width
spaces, joiners, BOMs) is dropped whole.

Look-ahead. A cut may depend only on the text up to a bounded distance past it, so feeding any pieces and then
finish() gives split_text()'s segments. A sentence, paragraph or clause end is returned as soon as its look-ahead
has arrived:
- a run of marks: the run with its closing marks, the spaces after it and one character more; after . ! ? … (not
  the CJK marks) the whitespace after it up to the first non-space character;
- a line break: the whitespace run and the first non-space character after it;
- an inline tag: up to its "|>" (or the character that shows it is none);
- other text: up to BLOCK characters or the next mark, line break or "<", and one character more (a combining mark
  may follow).
A head is measured at each mark and line break, and between them once it has grown to the length where it would
fill the budget at its density so far, at most twice as long as when it last fit: a head that outgrows the budget is
cut by then (to within a BLOCK), not only at its next mark. flush() speaks what has arrived now, only an unfinished
inline tag held back: the one place where arrival changes the cuts.
"""

import re
import unicodedata
from collections.abc import Callable
from itertools import pairwise

from .errors import HiggsError, TextError

SENTENCE_MARKS = ".!?…‼⁇⁈⁉。！？｡"
CJK_SENTENCE_MARKS = "。！？｡"  # end a sentence without a following space
CLAUSE_MARKS = ",;:—、，；："
SPACED_CLAUSE_MARKS = ",;:"  # clause ends only before whitespace
CLOSING_QUOTES = "\"'“‘"  # closing after a mark, besides the categories Pe and Pf (German „So.“ closes with “)
LINE_BREAKS = "\n\r\u2028\u2029"
ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "cf", "approx", "fig"})
INITIALISM = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")  # U.S, e.g, i.e, a.m (the final "." is the mark itself)
BLOCK = 64  # plain text is read in runs of at most this many characters
FIRST_CHECK = BLOCK  # a head is first measured, if no mark came, once it is this long (characters)
ZWJ = "\u200d"
WORD_CHAR = re.compile(r"[^\W_]")
PLAIN = re.compile("[^" + re.escape(SENTENCE_MARKS + CLAUSE_MARKS + LINE_BREAKS + "<") + f"]{{1,{BLOCK}}}")
NO_SPACE_SCRIPT = re.compile("[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3005-\u3007\u3040-\u30ff\u31f0-\u31ff"
                             "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003ffff]")
UNFINISHED_TAG = re.compile(r"<(?:\|[^<>|\s]*\|?)?\Z")


class _NeedMore(Exception):
    """A decision needs text that has not arrived yet."""


def _is_glue(ch: str) -> bool:
    """Belongs to the character before it: combining marks, joiner, variation selectors, emoji modifiers, tag chars."""
    return (unicodedata.category(ch) in ("Mn", "Mc", "Me") or ch == ZWJ or "\ufe00" <= ch <= "\ufe0f"
            or "\U0001f3fb" <= ch <= "\U0001f3ff" or "\U000e0020" <= ch <= "\U000e007f"
            or "\U000e0100" <= ch <= "\U000e01ef")


def _closes(ch: str) -> bool:
    return unicodedata.category(ch) in ("Pe", "Pf") or ch in CLOSING_QUOTES


def _is_inline_space(ch: str) -> bool:
    return ch.isspace() and ch not in LINE_BREAKS


def _is_paragraph_break(space: str) -> bool:
    space = space.replace("\r\n", "\n")
    return "\u2029" in space or sum(space.count(b) for b in LINE_BREAKS) >= 2


def _is_abbreviation(word: str) -> bool:
    return (word.lower() in ABBREVIATIONS or INITIALISM.fullmatch(word) is not None
            or (len(word) == 1 and word.isupper() and word != "I"))


def _is_visible(text: str) -> bool:
    return any(not ch.isspace() and unicodedata.category(ch) != "Cf" for ch in text)


def _may_break_between(left: str, right: str) -> bool:
    """Between two atoms starting with these characters, inside a run without spaces."""
    if not (NO_SPACE_SCRIPT.match(left) or NO_SPACE_SCRIPT.match(right)):
        return False
    opening = unicodedata.category(left) in ("Ps", "Pi")
    trailing = unicodedata.category(right).startswith("P") and unicodedata.category(right) not in ("Ps", "Pi")
    return not opening and not trailing


class Segmenter:
    """Cuts text that arrives in pieces into segments (see the module's rule); `measure(text)` gives a text's size
    (the tokenizer's token count; tests pass len), `max_units` the most a segment may measure, and past
    `clause_units` a completed clause ends a segment."""

    def __init__(self, measure: Callable[[str], int], max_units: int, clause_units: int):
        if not 0 < clause_units <= max_units:
            raise HiggsError(f"segments need 0 < clause units ≤ max units, got {clause_units} and {max_units}")
        self._measure_text, self._max, self._clause = measure, max_units, clause_units
        self._text = ""
        self._final = False
        self._restart(0)

    def feed(self, text: str) -> list[str]:
        """The segments that `text`, appended to what came before, completes."""
        self._text += text
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """Everything that has arrived as segments now, but an unfinished inline tag, which waits for its end."""
        held = UNFINISHED_TAG.search(self._text)
        keep = held.start() if held else len(self._text)
        rest = self._text[keep:]
        self._text = self._text[:keep]
        out = self.finish()
        self._text = rest
        return out

    def finish(self) -> list[str]:
        """The end of the text: the segments of everything not yet returned; the segmenter starts afresh."""
        out = self._drain(final=True)
        self._text = ""
        self._restart(0)
        return out

    # scanning: self._text[self._start:self._pos] is the head read so far

    def _restart(self, start: int) -> None:
        self._start = self._pos = start
        self._speech = False  # the head has a letter or digit outside tags
        self._check_len = FIRST_CHECK

    def _drain(self, final: bool) -> list[str]:
        self._final = final
        out: list[str] = []
        try:
            while self._pos < len(self._text) or (final and self._start < len(self._text)):
                cut = self._step() if self._pos < len(self._text) else self._end_cut()
                if cut is not None:
                    head = self._head(cut)
                    if _is_visible(head):
                        out.append(head)
                    self._restart(cut)
        except _NeedMore:
            pass
        self._text = self._text[self._start:]  # what was returned is no longer needed
        self._pos -= self._start
        self._start = 0
        return out

    def _peek(self, i: int) -> str:
        """The character at i; "" past the end of the text; _NeedMore past the end of what has arrived."""
        if i < len(self._text):
            return self._text[i]
        if self._final:
            return ""
        raise _NeedMore

    def _step(self) -> int | None:
        """Reads one unit (all its look-ahead first, so _NeedMore leaves no trace); returns a cut position or None."""
        i = self._pos
        ch = self._text[i]
        if ch.isspace() and (i == self._start or ch in LINE_BREAKS):
            end = self._space_end(i)
            if i == self._start:  # a head starts at a non-space character
                self._start = self._pos = end
                return None
            self._pos = end
            return self._candidate(i) if _is_paragraph_break(self._text[i:end]) else None
        if ch in SENTENCE_MARKS or ch in CLAUSE_MARKS:
            end = self._marks_end(i)
            last = next(m for m in reversed(self._text[i:end]) if m in SENTENCE_MARKS or m in CLAUSE_MARKS)
            clause = last in CLAUSE_MARKS  # the last mark says what ends: "etc.," is a clause, "?!" a sentence
            ends = self._ends_clause(last, end) if clause else self._ends_sentence(i, end, last)
            self._pos = end
            if ends:
                return self._candidate(end, clause=clause)
        else:
            end = self._atoms_end(i)
            self._speech = self._speech or (ch != "<" and WORD_CHAR.search(self._text, i, end) is not None)
            self._pos = end
        return self._check(end) if end - self._start >= self._check_len else None

    def _end_cut(self) -> int:
        end = len(self._text)
        return self._overflow(end) if self._units(end) > self._max else end

    # units and their look-ahead

    def _space_end(self, i: int) -> int:
        while (ch := self._peek(i)) and ch.isspace():
            i += 1
        return i

    def _marks_end(self, i: int) -> int:
        """End of the run of marks at i with the closing marks after it (a Pe/Pf one also after inline spaces)."""
        i += 1
        while True:
            ch = self._peek(i)
            if ch and (ch in SENTENCE_MARKS or ch in CLAUSE_MARKS or _closes(ch)):
                i += 1
                continue
            j = i
            while (ch := self._peek(j)) and _is_inline_space(ch):
                j += 1
            if j == i or not ch or unicodedata.category(ch) not in ("Pe", "Pf"):
                return i
            i = j + 1

    def _atoms_end(self, i: int) -> int:
        """End of a tag, or of plain text (up to BLOCK characters), with the glue after it."""
        if self._text[i] == "<":
            end = self._tag_end(i) or i + 1
        else:
            end = PLAIN.match(self._text, i).end()
        return self._glue_end(end)

    def _tag_end(self, i: int) -> int | None:
        """End of the inline tag <|…|> at i, None if there is none."""
        if self._peek(i + 1) != "|":
            return None
        j = i + 2
        while (ch := self._peek(j)) and ch not in "<>|" and not ch.isspace():
            j += 1
        return j + 2 if ch == "|" and j > i + 2 and self._peek(j + 1) == ">" else None

    def _glue_end(self, i: int) -> int:
        while (ch := self._peek(i)) and (_is_glue(ch) or self._text[i - 1] == ZWJ):
            i += 1
        return i

    def _ends_sentence(self, i: int, end: int, last: str) -> bool:
        if last in CJK_SENTENCE_MARKS:
            return True
        if not (after := self._peek(end)):
            return True
        if not after.isspace():
            return False
        following = self._peek(self._space_end(end))
        if following.islower() or following.isdigit():
            return False
        return not (self._text[i:end] == "." and _is_abbreviation(self._word_before(i)))

    def _ends_clause(self, last: str, end: int) -> bool:
        if last not in SPACED_CLAUSE_MARKS:
            return True
        after = self._peek(end)
        return not after or after.isspace()

    def _word_before(self, i: int) -> str:
        j = i
        while j > self._start and (self._text[j - 1].isalpha() or self._text[j - 1] == "."):
            j -= 1
        return self._text[j:i]

    # measuring and cutting

    def _head(self, end: int) -> str:
        return self._text[self._start:end].rstrip()

    def _units(self, end: int) -> int:
        return self._measure_text(self._head(end))

    def _fits(self, end: int) -> bool:
        return self._units(end) <= self._max

    def _candidate(self, end: int, clause: bool = False) -> int | None:
        """A sentence, paragraph or clause ends at `end`: the cut, if the rule takes it."""
        units = self._units(end)
        if units > self._max:
            return self._overflow(end)
        self._schedule(end, units)
        if not self._speech or (clause and units < self._clause):
            return None
        return end

    def _check(self, end: int) -> int | None:
        units = self._units(end)
        if units > self._max:
            return self._overflow(end)
        self._schedule(end, units)
        return None

    def _schedule(self, end: int, units: int) -> None:
        """The head fits at `end`: measure it next where it would fill the budget at this density, at most twice
        as long (characters), so a run-on head is caught soon after it stops fitting and measured O(log) times."""
        length = end - self._start
        self._check_len = max(length + 1, min(2 * length, length * self._max // max(units, 1)))

    def _overflow(self, end: int) -> int:
        """The head up to `end` does not fit: the last word boundary before it where it does, in the first word
        the last atom boundary."""
        starts = self._atom_starts(end)
        words = [k for a, k in pairwise(starts) if self._is_word_gap(a, k)]
        if words and self._fits(words[0]):
            return _last(words, self._fits)
        first_word_end = words[0] if words else end
        inside = [k for k in starts[1:] if k < first_word_end]
        if inside and self._fits(inside[0]):
            return _last(inside, self._fits)
        first = self._head(inside[0] if inside else first_word_end)
        raise TextError(f"the text has {first!r}, which alone measures {self._measure_text(first)}, more than a "
                         f"segment may ({self._max})")

    def _atom_starts(self, end: int) -> list[int]:
        starts, i = [], self._start
        while i < end:
            starts.append(i)
            i = self._glue_end((self._tag_end(i) if self._text[i] == "<" else None) or i + 1)
        return starts

    def _is_word_gap(self, left: int, i: int) -> bool:
        """Whether the gap at i, after the atom starting at `left`, is a word boundary."""
        a, b = self._text[left], self._text[i]
        if a.isspace():
            return False
        return b.isspace() or _may_break_between(a, b)


def _last(candidates: list[int], fits: Callable[[int], bool]) -> int:
    """The last candidate that fits, by bisection, given that the first does (the end past the last does not)."""
    lo, hi = 0, len(candidates)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid)
    return candidates[lo]


def split_text(text: str, measure: Callable[[str], int], max_units: int, clause_units: int) -> list[str]:
    """A whole text's segments: what a Segmenter fed it at once and then finished returns."""
    segmenter = Segmenter(measure, max_units, clause_units)
    return segmenter.feed(text) + segmenter.finish()
