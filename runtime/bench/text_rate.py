"""`bench stream --text-rate`: one request's text fed in at an LLM's pace, as `/v1/audio/speech/stream` and
`run --text -` receive it. Per segment: the time from its end to its first audio, beside a one-shot request of the
prompt that segment had (its history included; same engine, same run), and the underruns within segments.

Text arrives word by word (an LLM's token is about a word with the space before it). A segment ends when the
segmenter cuts it, which for a sentence is when the next word arrives: a sentence ends only once the word after it
shows that it does ("Dr. Smith", "3.14" and "Hi!" she said do not). That look-ahead (one word's time at the text's
pace) is shown apart: last character → cut, then cut → first audio, the figure set against the one-shot's. A segment
whose text was complete before the engine had finished the segment ahead of it waited for the engine, not for its
text: it is counted apart ("queued"), not in the medians.
"""

import re
import time
from dataclasses import dataclass

import numpy as np

from higgs_trt.runtime.decoding import SAMPLES_PER_FRAME, Sampling
from higgs_trt.runtime.longform import Reference, Script
from higgs_trt.runtime.prompt import HiggsTokenizer

from .loop import underruns

PIECE = re.compile(r"\s*\S+")


@dataclass
class TextRateFigures:
    chars_per_s: float
    segments: int
    look_ahead_ms: list  # segments that waited for their text: last character → the cut
    after_cut_ms: list  # the same segments: the cut → first audio
    queued: int  # segments whose text was complete before the engine could start them
    one_shot_ms: list  # each segment's prompt as a request of its own: submission → first audio
    underruns: int  # late chunks within segments (a segment waiting for its text is silence by the text's doing)

    def line(self) -> str:
        look, after, alone = (np.median(x) for x in (self.look_ahead_ms, self.after_cut_ms, self.one_shot_ms))
        return (f"text at {self.chars_per_s:g} chars/s, {self.segments} segments ({self.queued} queued behind the one "
                f"before): segment cut → first audio p50 {after:6.1f} ms, the segment's prompt one-shot {alone:6.1f} "
                f"ms: {after / alone:.2f}×; last character → cut (the look-ahead) p50 {look:.1f} ms, so last "
                f"character → first audio {look + after:.1f} ms; underruns within segments {self.underruns}")


def feed_times(text: str, chars_per_s: float) -> list[tuple[float, str, int]]:
    """(seconds after the start, piece, offset in `text` one past the piece) for every piece of `text`."""
    return [(m.end() / chars_per_s, m.group(), m.end()) for m in PIECE.finditer(text)]


def speak_streamed(scheduler, engine, tokenizer, text, voice, chars_per_s, rows, sampling, history):
    """Feed `text` at `chars_per_s` into one request and step the loop until it is spoken. Returns the request, its
    chunks (arrival time, samples), the time each piece went in (by text offset), when each segment was cut and when
    each ended."""
    from higgs_trt.runtime.request import request_for

    script = Script(tokenizer, voice, None, engine.max_prompt, history)
    arrivals, fed, cut, ended = [], {}, [], []
    request = request_for(engine, None, sampling, hard_cap=rows, script=script)
    request.fixed_rows = True
    request.on_chunk = lambda chunk: arrivals.append((time.perf_counter(), len(chunk)))
    pieces = feed_times(text, chars_per_s)
    scheduler.submit(request)
    t0, i = time.perf_counter(), 0
    while not request.finished:
        now = time.perf_counter() - t0
        while i < len(pieces) and pieces[i][0] <= now:
            scheduler.feed_text(request, pieces[i][1], finish=i == len(pieces) - 1)
            fed[pieces[i][2]] = time.perf_counter()
            cut += [fed[pieces[i][2]]] * (len(script.said) + len(script.pending) - len(cut))
            i += 1
        busy = scheduler.step()
        ended += [time.perf_counter()] * (len(request.stream.bounds) - len(ended))
        if not busy and not scheduler.busy and i < len(pieces):
            time.sleep(max(0.0, pieces[i][0] - (time.perf_counter() - t0)))
    if request.error:
        raise RuntimeError(request.error)
    return request, arrivals, fed, cut, ended


def first_audio(arrivals: list, frame: int) -> int:
    """The index of the first chunk holding audio of `frame` or later."""
    played = 0
    for k, (_, n) in enumerate(arrivals):
        if played + n > frame * SAMPLES_PER_FRAME:
            return k
        played += n
    raise ValueError(f"no audio at frame {frame}")


def bench_text_rate(engine, tokenizer: HiggsTokenizer, text: str, voice: Reference, chars_per_s: float, rows: int,
                    sampling: Sampling, plan=None, history: int = 2) -> TextRateFigures:
    from higgs_trt.runtime.request import request_for
    from higgs_trt.runtime.scheduler import Scheduler

    scheduler = Scheduler(engine, plan)
    request, arrivals, fed, cut, ended = speak_streamed(scheduler, engine, tokenizer, text, voice, chars_per_s, rows,
                                                        sampling, history)
    segments, bounds = request.script.said, [0, *request.stream.bounds]
    look_ahead, after, queued, late, position = [], [], 0, 0, 0
    firsts = [first_audio(arrivals, bounds[k]) for k in range(len(segments))]
    for k, segment in enumerate(segments):
        position = text.index(segment, position) + len(segment)
        last_char = fed[min(o for o in fed if o >= position)]  # the piece holding the segment's last character
        if k and last_char < ended[k - 1]:
            queued += 1
        else:
            look_ahead.append(1e3 * (cut[k] - last_char))
            after.append(1e3 * (arrivals[firsts[k]][0] - cut[k]))
        late += underruns(arrivals[firsts[k]:firsts[k + 1] if k + 1 < len(firsts) else None])
    one_shot = []
    for prompt in segment_prompts(request, tokenizer, text, voice, engine.max_prompt, history):
        alone = request_for(engine, prompt, sampling, hard_cap=rows)
        alone.fixed_rows = True
        scheduler.submit(alone)
        scheduler.run()
        one_shot.append(1e3 * (alone.first_audio_at - alone.submitted_at))
    nothing = [float("nan")]
    return TextRateFigures(chars_per_s, len(segments), look_ahead or nothing, after or nothing, queued, one_shot, late)


def segment_prompts(request, tokenizer, text, voice, max_prompt, history) -> list:
    """The prompt each segment of the spoken `request` had: its script replayed over the frames it spoke."""
    script = Script(tokenizer, voice, None, max_prompt, history)
    script.feed(text)
    script.finish()
    bounds, prompts = [0, *request.stream.bounds], []
    for k in range(len(bounds) - 1):
        prompts.append(script.next_prompt())
        script.spoken(request.stream.codes(bounds[k], bounds[k + 1]))
    return prompts
