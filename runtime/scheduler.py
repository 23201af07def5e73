"""In-flight batching: requests join and leave a fixed set of engine slots at any step, and stream audio as they go.

One loop, shared by every backend (the slot contract: runtime/slots.py):

  admit    queued requests take free slots: one prefill call for those who join (the engine may batch them; while
           others play audio, at most prefill_rows prompt rows a step), which also chooses each request's row 0
  step     one row for every busy slot (the engine's batch is the bucket above the highest busy slot); the engine
           may decode several rows in one launch (MULTI_ROWS) unless someone waits to join or so many would run past
           the row a request's first chunk needs; no launch once every busy request has all its rows launched,
           nor for a lone request from its first window's last row until that chunk is out
  collect  rows the engine has finished (one step late on the GPU engine) → each request's stop rules
  release  finished or cancelled requests free their slot; the engine no longer advances it. A long-form request
           (runtime/longform.py) whose segment ended queues again, first in line, with its next segment's prompt,
           or waits without a slot for that segment's text to arrive
  audio    codec windows that became decodable (runtime/streaming.py), windows of equal shape decoded in one call
           (the engine returns the emitted frames' audio alone);
           an engine may decode them while the next steps run (the GPU engine's codec stream): a step's audio goes
           out, in window order, once all of it is ready; a first chunk is waited for while the engine still
           runs a step (time to first audio without idling the GPU), a lone request's with no step beside it

A request's codes depend only on its prompt, sampling and seed (batch-invariant kernels, per-request uniforms), so
it decodes the same alone or joining a batch mid-flight. A request's audio is decoded from its code stream
(decoding.CodeStream): its segments' frames one after another, windows crossing the segments' boundaries.
`submit`, `cancel` and `feed_text` may be called from other threads.
"""

import atexit
import gc
import threading
import time
from collections import deque

import numpy as np

from .decoding import CodeStream, Utterance, sanitize
from .errors import HiggsError
from .prompt import Prompt
from .realtime import SWAP_MARGIN, StepTimes, deadline
from .request import QueueFull, Request, segment_rows
from .streaming import StreamPlan, Window

PREFILL_ROWS = 256  # prompt rows one iteration prefills while others decode (≈ 6 prompts of 41 tokens)
# Rows one engine step may decode while no request waits to join or for its first chunk: the host's work per launch
# is spread over them; a join or a cancel then waits for up to that many rows (the engine decides how many it does:
# runtime/gpu/launches.STEP_ROWS, one on host-driven engines).
MULTI_ROWS = 4
AUDIO_POLL_S = 0.0002  # how often a first chunk's codec call is polled while the engine runs a step
PHASES = ("prefill", "decode", "codec", "other")  # of the loop's time (Scheduler.seconds)


def freeze_heap() -> None:
    """Keep what is alive before a decode loop starts (torch's and Triton's modules, the engine, the tokenizer:
    hundreds of thousands of objects) out of the collector's full passes, which otherwise walk all of it and stall a
    busy loop for a noticeable share of a first chunk's time. Unfrozen at exit, so that the interpreter's last
    collection still finalizes it."""
    gc.collect()
    if not gc.get_freeze_count():
        atexit.register(gc.unfreeze)
    gc.freeze()


class Scheduler:
    def __init__(self, engine, plan: StreamPlan | None = None, max_queue: int = 1024,
                 prefill_rows: int = PREFILL_ROWS, lanes: int | None = None, realtime: bool = False,
                 clock=time.perf_counter):
        """`lanes`: slots one step decodes (default all); the requests in the others wait, earliest deadline first
        (runtime/realtime.py; the engine must be able to move a request between slots). `realtime`: refuse a
        request that would push the streams under real time. `clock`: the time (tests simulate it)."""
        freeze_heap()
        self.engine = engine
        self.lanes = min(lanes or engine.max_batch, engine.max_batch)
        if self.lanes < engine.max_batch and not getattr(engine, "swappable", False):
            raise HiggsError(f"the {engine.name} engine cannot move a request between slots: decoding fewer slots "
                             f"({self.lanes}) than it has ({engine.max_batch}) needs one that can (ONNX Runtime)")
        self.realtime, self.clock = realtime, clock
        self.step_times = StepTimes()
        self.plan = plan or StreamPlan.exact(engine.codec_strides)
        engine.prepare_codec(self.plan)  # e.g. the GPU engine captures the plan's codec windows, before any request
        self.first_rows = Utterance.rows_needed(self.plan.due(0))  # a request's rows that make its first window due
        self.max_queue = max_queue
        self.prefill_rows = prefill_rows
        self.slots: list[Request | None] = [None] * engine.max_batch
        self.occupied: list[int] = []  # the slots holding a request, ascending (kept, not scanned: host time per row)
        self.queue: deque[Request] = deque()
        self.between: set[Request] = set()  # long-form requests between two segments: queued again, or awaiting text
        self.decoding: deque[tuple[list, list]] = deque()  # a step's (windows, codec calls) whose audio is not out
        self.urgent = True  # a request has not had its first chunk yet: steps stop at the row it needs
        self.unread: deque[int] = deque()  # rows of each launch (prefills: 1) the loop has not read yet
        self.launched = 0  # rows launched by steps so far (every busy slot takes each)
        self.seconds = dict.fromkeys(PHASES, 0.0)  # the loop's time by phase
        self.prefill_calls = 0
        self.polled = 0.0  # seconds the loop slept on a first chunk's codec call while the engine ran a step
        self.codec_calls = 0
        self.codec_windows = 0
        self.lock = threading.Lock()
        self.wakeup = threading.Event()

    # ---- from any thread -------------------------------------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        with self.lock:
            free = len(self.slots) - len(self.occupied)  # queued requests that will take a slot at the next step
            if len(self.queue) - free >= self.max_queue:
                raise QueueFull(f"the admission queue is full ({self.max_queue} requests waiting for a slot)")
            if self.realtime:
                self._check_capacity()
            request.submitted_at = self.clock()
            request.stream = CodeStream()
            request.stream.finished = request.script is None
            if request.prompt is None:  # text that streams in: its first segment is not complete yet
                self.between.add(request)
            else:
                self._start_segment(request, request.prompt, request.max_rows)
                self.queue.append(request)
        self.wakeup.set()
        return request

    def _check_capacity(self) -> None:
        streams = len(self.occupied) + len(self.between.union(self.queue)) + 1
        if streams > 1 and not self.step_times.keeps_up(streams, self.lanes):  # one stream alone always runs
            raise QueueFull(f"the engine is at its real-time capacity: {streams} streams would not all be decoded as "
                            "fast as they play")

    def feed_text(self, request: Request, text: str = "", flush: bool = False, finish: bool = False) -> None:
        """More text for a long-form request whose text streams in (its script's feed, flush, finish); a segment it
        completes starts at the loop's next step. The script's errors (an unknown speaker tag) are raised here."""
        with self.lock:
            if text:
                request.script.feed(text)
            if flush:
                request.script.flush()
            if finish:
                request.script.finish()
        self.wakeup.set()

    def cancel(self, request: Request) -> None:
        request.cancelled = True  # the loop frees its slot at its next step
        self.wakeup.set()

    @property
    def busy(self) -> int:
        return len(self.occupied)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    # ---- the loop ----------------------------------------------------------------------------------------------------

    def fail(self, error: str) -> None:
        """Finish every queued and running request with `error` and free all slots, calling the engine no more (after
        an engine failure, or when a server stops)."""
        with self.lock:
            requests = [*self.queue, *self.between, *(r for r in self.slots if r is not None)]
            self.queue.clear()
            self.between.clear()
        self.slots = [None] * len(self.slots)
        self.occupied = []
        self.decoding.clear()
        for request in requests:
            if not request.cancelled:
                request.error = request.error or error
            self._finish(request)

    def run(self) -> None:
        """Until every submitted request is finished (sleeping while the only ones left await their text)."""
        while self.step() or self.between:
            if not self.queue and not self.occupied and not self.decoding:
                self.wakeup.wait()
                self.wakeup.clear()

    def step(self) -> bool:
        """One iteration; False when there is nothing left to do."""
        t0 = self.clock()
        if self.queue:
            self._admit()
        t1 = self.clock()
        if self.occupied and self.occupied[-1] >= self.lanes and not self.unread:
            self._choose_lanes()
        busy = self.occupied
        stepped = busy if self.lanes == len(self.slots) else [s for s in busy if s < self.lanes]
        held = self._first_chunk_alone()
        rows = self._rows_per_step(stepped) if stepped and not held else 0
        if rows:
            rows = self.engine.step(stepped[-1] + 1, rows)
            self.launched += rows
            self.unread.append(rows)
        keep = self.engine.lag if rows else 0
        for slot, codes in self.engine.rows(keep=keep):
            request = self.slots[slot]
            if request is not None and not request.utterance.done:
                request.utterance.push(codes)
        while len(self.unread) > keep:  # rows(keep) left at most `keep` launches unread
            self.unread.popleft()
        t2 = self.clock()
        windows, freed = [], False
        for slot in busy:
            request = self.slots[slot]
            if request.cancelled or request.utterance.done:
                self.engine.release(slot)
                self.slots[slot] = None
                freed = True
            if request.cancelled:
                self._finish(request)
                continue
            if request.utterance.done and not request.stream.finished:
                self._end_segment(request)
            windows += self._due(request)
        for request in list(self.between):
            if request.cancelled:
                self.between.discard(request)
                self._finish(request)
                continue
            if request.stream.current is None:
                self._close_part(request)
                self._next_segment(request)
            windows += self._due(request)
        if freed:
            self.occupied = [s for s in busy if self.slots[s] is not None]
        t3 = self.clock()
        if windows:
            self._decode(windows)
        self._collect(wait=held or (not self.occupied and not self.queue))
        t4 = self.clock()
        if self.urgent:  # set by each join; still, after this step's chunks?
            self.urgent = any(not self.slots[s].emitted for s in self.occupied)
        t5 = self.clock()
        for phase, seconds in zip(self.seconds, (t1 - t0, t2 - t1, t4 - t3, t3 - t2 + t5 - t4)):
            self.seconds[phase] += seconds
        if rows:
            self.step_times.record(stepped[-1] + 1, t5 - t0, rows)
        with self.lock:
            return bool(self.queue) or bool(self.occupied) or bool(self.decoding)

    def _admit(self) -> None:
        """Queued requests take free slots, in one prefill call (a failed call fails them all: lengths were checked
        at submission, so it means the engine failed). While a request's audio plays, one call takes at most
        prefill_rows prompt rows (and at least one prompt): a burst of joins then pauses the streams already
        playing for one bounded prefill per step, not for all of them at once. Before any plays (a wave of joins
        arriving over a few steps) there is nothing to underrun: whoever waits joins at once, in fewer calls."""
        joins = []
        with self.lock:
            free = [s for s, r in enumerate(self.slots) if r is None]
            playing = any(self.slots[s].emitted for s in self.occupied)
            budget = self.prefill_rows if playing else None
            rows = 0
            while self.queue and len(joins) < len(free):
                request = self.queue[0]
                if request.cancelled:
                    self._finish(self.queue.popleft())
                    self.between.discard(request)
                    continue
                if joins and budget is not None and rows + len(request.prompt) > budget:
                    break
                if not self.engine.reserve(free[len(joins)], len(request.prompt) + request.max_rows):
                    break  # no cache room for it until a request ends: it waits, first in line
                joins.append((free[len(joins)], self.queue.popleft()))
                self.between.discard(request)
                rows += len(request.prompt)
        if not joins:
            return
        self.prefill_calls += 1
        now = self.clock()
        for _, request in joins:
            request.admitted_at = request.admitted_at or now  # a long-form request's first segment's
        try:
            self.engine.prefill([(slot, r.prompt, r.sampling) for slot, r in joins])
        except HiggsError as e:
            for slot, request in joins:
                self.engine.release(slot)
                request.error = str(e)
                self._finish(request)
            return
        for slot, request in joins:
            self.slots[slot] = request
            request.last_launch = self.launched + request.max_rows - 1  # row 0 came from the prefill
        self.occupied = sorted(self.occupied + [slot for slot, _ in joins])
        self.urgent = True
        self.unread.append(1)  # each join's row 0

    def _choose_lanes(self) -> None:
        """Earliest deadline first: a request waiting outside the decoded slots takes a free one, or the place of
        the decoded request whose listener has the most audio ahead, if its own deadline is SWAP_MARGIN sooner."""
        free = [s for s in range(self.lanes) if self.slots[s] is None]
        waiting = sorted((s for s in self.occupied if s >= self.lanes), key=lambda s: deadline(self.slots[s]))
        decoded = sorted((s for s in self.occupied if s < self.lanes), key=lambda s: -deadline(self.slots[s]))
        for slot in waiting:
            if free:
                lane = free.pop(0)
            elif decoded and deadline(self.slots[slot]) < deadline(self.slots[decoded[0]]) - SWAP_MARGIN:
                lane = decoded.pop(0)
            else:
                break
            self.engine.swap(slot, lane)
            self.slots[slot], self.slots[lane] = self.slots[lane], self.slots[slot]
            moved = self.slots[lane]
            moved.last_launch = self.launched + moved.max_rows - len(moved.utterance.rows)
        self.occupied = [s for s, r in enumerate(self.slots) if r is not None]

    def _rows_per_step(self, stepped: list[int]) -> int:
        """MULTI_ROWS, unless someone waits to join, or a launch of that many rows could run past the row whose
        codes make a request's first window due: its first audio would then wait for the rows after it. Never more
        than the busy requests can still use (their row caps; 0: no launch): read one launch late, rows past every
        cap would be decoded for nobody and hold up the next join's prefill behind them."""
        left = max(self.slots[s].last_launch for s in stepped) - self.launched
        if left <= 0:
            return 0
        if self.queue:
            return 1
        if self.urgent:
            needed = self.first_rows - sum(self.unread)
            for slot in stepped:
                request = self.slots[slot]
                if not request.planned and needed - len(request.utterance.rows) < MULTI_ROWS:
                    return 1
        return min(MULTI_ROWS, left)

    def _first_chunk_alone(self) -> bool:
        """A lone request has every row of its first window launched, and its first chunk is not out: no step then
        until it is (the loop waits for the chunk instead), since a step launched now would run beside the first
        chunk's codec call and slow it; the GPU idles about a millisecond a request for it. With others busy their
        rows come first. On host-driven engines the chunk is out in the step that reads its rows. Held only while
        rows are unread or the chunk is being decoded: rows that turned out not to make the window due need more."""
        if len(self.occupied) != 1:
            return False
        request = self.slots[self.occupied[0]]
        rows = len(request.utterance.rows) + sum(self.unread)
        return not request.emitted and rows >= self.first_rows and bool(self.unread or request.planned)

    def _start_segment(self, request: Request, prompt: Prompt, max_rows: int) -> None:
        request.prompt, request.max_rows = prompt, max_rows
        request.utterance = Utterance(max_rows, stop_rules=not request.fixed_rows)
        request.stream.start(request.utterance)

    def _end_segment(self, request: Request) -> None:
        """A long-form request's segment ended: its frames join the stream and its speaker's history."""
        frames = request.stream.end_segment()
        request.due = 0  # the next segment's start moves its windows (StreamPlan); _due plans them afresh
        with self.lock:
            request.script.spoken(frames)
        self._close_part(request)
        self._next_segment(request)

    def _close_part(self, request: Request) -> None:
        """A flush whose segments have all ended: the audio so far is finished off (_due)."""
        s = request.stream
        with self.lock:
            flushed = request.script.flushed_at
            if flushed is not None and len(s.bounds) >= flushed:
                s.part_end, request.script.flushed_at = s.ready(), None

    def _next_segment(self, request: Request) -> None:
        """Queue the request again, first in line, with its next segment; else it awaits that segment's text (or
        its stream is complete)."""
        left = None if request.max_frames is None else request.max_frames - request.stream.ready()
        with self.lock:
            prompt = request.script.next_prompt() if left is None or left > 0 else None
            if prompt is None:
                request.stream.finished = request.script.exhausted or (left is not None and left <= 0)
                if request.stream.finished:
                    self.between.discard(request)
                else:
                    self.between.add(request)
                return
            try:
                rows = segment_rows(self.engine, prompt, request.segment_cap, left)
            except HiggsError as e:  # a segment of streamed text that cannot fit (the segmenter's budget is wrong)
                request.error = str(e)
                request.stream.finished = True
                self.between.discard(request)
                return
            self._start_segment(request, prompt, rows)
            self.queue.appendleft(request)
            self.between.add(request)
        self.wakeup.set()

    def _due(self, request: Request) -> list:
        """Windows of `request` that can be decoded now; a finished request's last ones, then its completion. A
        flushed part of the stream (CodeStream.part_end) is decoded to its end as an utterance is; the next part's
        windows start from its first frame."""
        s = request.stream
        base, end = s.part_start, s.part_end
        ready, done = (end, True) if end is not None else (s.ready(), s.done)
        if not done and ready < request.due:  # most calls: every busy request looks at every step
            return []
        out, starts = [], tuple(b - base for b in s.bounds if b > base)
        while window := self.plan.next_window(request.planned - base, ready - base, done, starts):
            window = Window(window.start + base, window.stop + base, window.emit_from + base, window.emit_to + base)
            out.append((request, window))
            request.planned = window.emit_to
        request.due = base + self.plan.due(request.planned - base, starts)
        if end is not None and request.planned == end:
            s.part_start, s.part_end, request.due = end, None, 0
        if s.done and not out and request.emitted == request.planned:  # else its last audio finishes it
            self._finish(request)
        return out

    def _decode(self, windows: list) -> None:
        """Start decoding the windows: one codec call per window length and emitted frames within it."""
        by_shape: dict[tuple, list] = {}
        for i, (request, window) in enumerate(windows):
            by_shape.setdefault((window.stop - window.start, window.keep), []).append(i)
        calls = []
        for (_, keep), group in by_shape.items():
            codes = np.stack([windows[i][0].stream.codes(windows[i][1].start, windows[i][1].stop).T
                              for i in group])
            calls.append((group, self.engine.codec(sanitize(codes), keep)))
        self.codec_calls += len(calls)
        self.codec_windows += len(windows)
        self.decoding.append((windows, calls))

    def _collect(self, wait: bool) -> None:
        """Hand out the audio of the steps whose codec calls are done, oldest first, in window order. Up to the last
        step holding a first chunk, wait for it while the engine still runs the step launched (the wait costs no
        step then: blocking until a call of 64 windows was done left the GPU idle for ~5 steps); with `wait`
        (nothing left to decode), wait for all."""
        firsts = [i for i, (windows, _) in enumerate(self.decoding) if any(w.emit_from == 0 for _, w in windows)]
        urgent = firsts[-1] + 1 if firsts else 0
        while self.decoding:
            windows, calls = self.decoding[0]
            if not wait and not self._ready(calls, while_busy=urgent > 0):
                return
            urgent -= 1
            self.decoding.popleft()
            audio = [None] * len(windows)
            for group, call in calls:
                for i, samples in zip(group, call.result()[:, 0]):
                    audio[i] = samples
            for (request, window), samples in zip(windows, audio):
                if request.finished:  # cancelled (or failed) while its audio was decoding
                    continue
                self._deliver(request, samples)
                request.emitted = window.emit_to
                if request.stream.done and request.emitted >= request.stream.ready():
                    self._finish(request)

    def _ready(self, calls: list, while_busy: bool) -> bool:
        """Whether the codec calls are done; `while_busy`: polled until they are or the engine has no step left to
        run."""
        while not all(call.ready() for _, call in calls):
            if not (while_busy and self.engine.busy()):
                return False
            t0 = time.perf_counter()
            time.sleep(AUDIO_POLL_S)
            self.polled += time.perf_counter() - t0
        return True

    def _deliver(self, request: Request, chunk: np.ndarray) -> None:
        if request.first_audio_at is None:
            request.first_audio_at = self.clock()
        if request.on_chunk is not None:
            request.on_chunk(chunk)
        else:
            request.chunks.append(chunk)

    def _finish(self, request: Request) -> None:
        if request.finished:
            return
        request.finished = True
        request.finished_at = self.clock()
        if request.on_done is not None:
            request.on_done(request)
