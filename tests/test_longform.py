"""Long-form speech and dialogue (runtime/longform.py) through the scheduler on the tiny ORT engine: segments spoken
one after another into one code stream whose audio has no seam, each segment's prompt carrying its voice and that
voice's latest segments; the reference prefix cache changes no number."""

import numpy as np
import pytest

from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.longform import Reference, Script, plan_text
from higgs_trt.runtime.prompt import REF_AUDIO, HiggsTokenizer, build_prompt
from higgs_trt.runtime.request import request_for
from higgs_trt.runtime.scheduler import Scheduler
from higgs_trt.runtime.streaming import StreamPlan

SENTENCES = " ".join(f"Sentence {i} is here." for i in range(32))
ROWS = 16  # rows per segment: enough for frames on both sides of every seam, few enough for CI


@pytest.fixture(scope="module")
def tok(tiny_engine):
    return HiggsTokenizer(tiny_engine / "tokenizer.json")


def speak(engine, tok, text, voice=Reference(), speakers=None, sampling=Sampling(1.0, seed=7), **options):
    prompt, script = plan_text(tok, text, voice, speakers, engine.max_prompt)
    scheduler = Scheduler(engine)
    request = scheduler.submit(request_for(engine, prompt, sampling, hard_cap=ROWS, script=script, **options))
    scheduler.run()
    assert request.error is None, request.error
    return request


def test_thirty_segments_make_one_stream_whose_audio_has_no_seam(engine, tok):
    """32 sentences: 32 segments in one request. The streamed audio is, sample for sample, what the exact windows make
    of the concatenated frames as one utterance, the chunks ramping up again at each segment's start (segment
    boundaries are invisible to the decoder). That those windows equal the one-shot decode of the whole stream, for
    any frames and segment starts, is tests/test_streaming.py's (float64 codec)."""
    request = speak(engine, tok, SENTENCES)
    stream = request.stream
    frames = stream.frames()
    assert stream.segments == 32 and len(frames) > 32 * 8 and len(stream.bounds) == 32
    plan = StreamPlan.exact(engine.codec_strides)
    windows = plan.windows(len(frames), tuple(stream.bounds))
    assert sum(w.emit_to == b + plan.first for w in windows for b in stream.bounds) >= 16  # ramps at the seams
    audio = [engine.codec(frames[w.start:w.stop].T[None], w.keep).result()[0, 0] for w in windows]
    assert np.array_equal(request.audio(), np.concatenate(audio))


def test_each_segment_carries_its_voice_and_its_latest_segments(tok):
    """A segment's prompt: the voice's reference first (the cacheable prefix), then the latest segments of that voice
    as reference blocks (at most `history`, as many as fit), then its own text."""
    voice = Reference(np.arange(24, dtype=np.int32).reshape(3, 8) % 1024, "A reference.")
    script = Script(tok, voice, None, max_prompt=400, history=2)
    script.feed(SENTENCES[:120])
    script.finish()
    prefixes, blocks = set(), []
    for i in range(4):
        prompt = script.next_prompt()
        prefixes.add((prompt.prefix, prompt.prefix_key))
        blocks.append(int((prompt.input_ids == tok.special(REF_AUDIO)).sum()))
        script.spoken(np.full((5, 8), i, np.int32))
    assert len(prefixes) == 1 and next(iter(prefixes))[0] == len(build_prompt(tok, "x", voice.codes, voice.text)) - 3
    assert blocks == [1, 2, 3, 3]  # the reference, then one more block per earlier segment, two at most


def test_history_that_does_not_fit_is_dropped_oldest_first(tok):
    script = Script(tok, Reference(), None, max_prompt=40, history=2)
    script.feed("One two three. Four five six. Seven eight nine.")
    script.finish()
    script.next_prompt()
    script.spoken(np.zeros((20, 8), np.int32))  # 27 rows of history: cannot sit beside the next text in 40 tokens
    prompt = script.next_prompt()
    assert len(prompt) <= 40 and int((prompt.input_ids == tok.special(REF_AUDIO)).sum()) == 0


def test_dialogue_speaks_each_turn_in_its_voice_with_its_own_history(engine, tok):
    alice = Reference(np.full((4, 8), 100, np.int32), "Alice speaking.")
    bob = Reference(np.full((6, 8), 200, np.int32), None)
    text = "[S1] Hello Bob. How are you? [S2] Fine, thanks. [S1] Good to hear."
    prompt, script = plan_text(tok, text, Reference(), {"S1": alice, "S2": bob}, engine.max_prompt)
    keys = [prompt.prefix_key]
    turns = []
    while True:
        turns.append(script.speaking[1])
        script.spoken(np.full((3, 8), len(keys), np.int32))
        prompt = script.next_prompt()
        if prompt is None:
            break
        keys.append(prompt.prefix_key)
    alice_key = build_prompt(tok, "x", alice.codes, alice.text).prefix_key
    bob_key = build_prompt(tok, "x", bob.codes).prefix_key
    assert turns == ["Hello Bob.", "How are you?", "Fine, thanks.", "Good to hear."]
    assert keys == [alice_key, alice_key, bob_key, alice_key]
    request = speak(engine, tok, text, speakers={"S1": alice, "S2": bob})
    assert request.stream.segments == 4


@pytest.mark.parametrize("text, speakers, error", [
    ("[S1] Hi there.", None, "needs a `speakers` mapping"),
    ("[S1] Hi. [S3] Who?", {"S1": Reference()}, r"\[S3\] is not mapped to a voice"),
    ("Hello first. [S1] Hi.", {"S1": Reference()}, "text before the first speaker tag"),
])
def test_speaker_tags_without_a_voice_are_refused_naming_them(tok, text, speakers, error):
    with pytest.raises(HiggsError, match=error):
        plan_text(tok, text, Reference(), speakers, 96)


def test_a_text_that_fits_one_prompt_is_one_plain_request(tok):
    prompt, script = plan_text(tok, "  Just one sentence, as given.  ", Reference(), None, 96)
    assert script is None and np.array_equal(prompt.input_ids, build_prompt(tok, "  Just one sentence, as given.  ").input_ids)


def test_the_prefix_cache_changes_no_number_and_is_used(engine, tok):
    """A cloned voice's request with the cache on (a cold call, then hits) and off: the same codes and samples."""
    voice = Reference(np.random.default_rng(1).integers(0, 1024, (12, 8)).astype(np.int32), "Some words.")
    text = "The cache should not matter. Not at all."
    engine.prefixes.entries, engine.prefixes.kept = 0, type(engine.prefixes.kept)()
    off = speak(engine, tok, text, voice)
    engine.prefixes.entries = 4
    cold, warm = speak(engine, tok, text, voice), speak(engine, tok, text, voice)
    assert engine.prefixes.hits >= 2 and len(engine.prefixes.kept) == 1
    for request in (cold, warm):
        assert np.array_equal(request.stream.frames(), off.stream.frames())
        assert np.array_equal(request.audio(), off.audio())


def test_a_cancelled_long_request_frees_its_slot_at_the_next_step(engine, tok):
    prompt, script = plan_text(tok, SENTENCES, Reference(), None, engine.max_prompt)
    scheduler = Scheduler(engine)
    request = scheduler.submit(request_for(engine, prompt, Sampling(1.0), hard_cap=ROWS, script=script))
    while request.stream.segments < 3:  # well inside its 32 segments
        scheduler.step()
    scheduler.cancel(request)
    scheduler.step()
    assert request.finished and not scheduler.occupied and not scheduler.between and not scheduler.queue


def test_the_duration_cap_ends_the_stream(engine, tok):
    request = speak(engine, tok, SENTENCES, max_seconds=1.0)
    assert 25 <= len(request.stream.frames()) < 25 + ROWS and request.stream.segments < 32


def test_text_fed_in_pieces_speaks_the_same_as_the_whole(engine, tok):
    """Streamed text: the request starts before its first segment is complete; pieces of any size give the same
    segments, codes and samples as the whole text at once."""
    whole = speak(engine, tok, SENTENCES[:200])
    scheduler = Scheduler(engine)
    script = Script(tok, Reference(), None, engine.max_prompt)
    request = scheduler.submit(request_for(engine, None, Sampling(1.0, seed=7), hard_cap=ROWS, script=script))
    rng = np.random.default_rng(0)
    text, at = SENTENCES[:200], 0
    while at < len(text):
        step = int(rng.integers(1, 9))
        scheduler.feed_text(request, text[at:at + step])
        at += step
        for _ in range(3):
            scheduler.step()
    scheduler.feed_text(request, finish=True)
    scheduler.run()
    assert request.error is None and request.stream.segments == whole.stream.segments
    assert np.array_equal(request.stream.frames(), whole.stream.frames())
    assert np.array_equal(request.audio(), whole.audio())
