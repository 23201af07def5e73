"""In-flight batching on the ONNX Runtime engine (tiny, CPU): a request decodes the same alone or joining a batch
mid-flight, cancellation frees its slot within a step, the admission queue is bounded, audio streams in order."""

import numpy as np
import pytest

from higgs_trt.runtime.decoding import EOC, NUM_CODEBOOKS, Sampling
from higgs_trt.runtime.generate import generate
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from higgs_trt.runtime.request import QueueFull, request_for
from higgs_trt.runtime.scheduler import MULTI_ROWS, Scheduler
from higgs_trt.runtime.stepper import HostStepper

TEXTS = ["Hello there, how are you?", "She sells sea shells.", "Numbers: one, two, three.", "Wait, what? No way!"]


@pytest.fixture(scope="module")
def prompts(tiny_engine):
    tok = HiggsTokenizer(tiny_engine / "tokenizer.json")
    return [build_prompt(tok, t) for t in TEXTS]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=11)])
def test_a_request_decodes_the_same_alone_and_joining_mid_flight(engine, prompts, sampling):
    alone = Scheduler(engine)
    solo = alone.submit(request_for(engine, prompts[0], sampling, hard_cap=60))
    alone.run()

    busy = Scheduler(engine)
    others = [busy.submit(request_for(engine, p, Sampling(1.0, seed=i), hard_cap=60)) for i, p in enumerate(prompts[1:])]
    for _ in range(5):
        busy.step()
    joined = busy.submit(request_for(engine, prompts[0], sampling, hard_cap=60))
    busy.run()
    assert busy.slots.count(None) == engine.max_batch  # every slot free at the end
    assert np.array_equal(np.stack(solo.utterance.rows), np.stack(joined.utterance.rows))
    # the codes are identical; the codec may decode equal-length windows of several requests in one call, and ORT's
    # convolutions round ~1e-7 differently by batch size
    assert len(solo.audio()) > 0 and np.allclose(solo.audio(), joined.audio(), rtol=0, atol=1e-5)
    assert all(r.finished and not r.cancelled for r in others)


def test_cancellation_frees_the_slot_within_one_step(engine, prompts):
    scheduler = Scheduler(engine)
    victim = scheduler.submit(request_for(engine, prompts[1], Sampling(), hard_cap=200))
    scheduler.step()
    assert scheduler.busy == 1
    scheduler.cancel(victim)
    scheduler.step()
    assert scheduler.busy == 0 and victim.finished and victim.stop_reason == "cancelled"
    queued = Scheduler(engine)
    waiting = queued.submit(request_for(engine, prompts[2], Sampling()))
    queued.cancel(waiting)  # cancelled before it ever had a slot
    assert not queued.step() and waiting.finished


def _recording(engine, method: str, calls: list, note):
    """The engine, noting note(*args) of each call of `method` in `calls` before making it."""
    class Recording:
        def __getattr__(self, name):
            return getattr(engine, name)

    def call(*args):
        calls.append(note(*args))
        return getattr(engine, method)(*args)

    recording = Recording()
    setattr(recording, method, call)
    return recording


def _recording_prefills(engine, calls):
    return _recording(engine, "prefill", calls, lambda joins: [len(prompt) for _, prompt, _ in joins])


def test_joins_come_in_one_prefill_call_bounded_while_others_play(engine, prompts):
    calls = []
    budget = len(prompts[0]) + len(prompts[1])
    scheduler = Scheduler(_recording_prefills(engine, calls), prefill_rows=budget)
    first = [scheduler.submit(request_for(engine, p, Sampling(), hard_cap=60)) for p in prompts[:2]]
    scheduler.step()
    assert calls == [[len(p) for p in prompts[:2]]]  # nothing decoding: every join at once
    while not any(r.emitted for r in first):
        scheduler.step()
    later = [scheduler.submit(request_for(engine, p, Sampling(), hard_cap=40)) for p in prompts[1:3]]
    scheduler.run()
    assert all(sum(c) <= budget or len(c) == 1 for c in calls[1:]) and sum(map(len, calls)) == 4, calls
    assert len(calls) == 3  # the two later joins exceed the budget together, so they join on two steps
    assert all(r.finished for r in first + later)


def test_joins_before_any_audio_plays_are_not_bounded(engine, prompts):
    calls = []
    scheduler = Scheduler(_recording_prefills(engine, calls), prefill_rows=1)
    first = scheduler.submit(request_for(engine, prompts[0], Sampling(), hard_cap=40))
    scheduler.step()
    assert first.emitted == 0  # decoding, nothing played yet
    later = [scheduler.submit(request_for(engine, p, Sampling(), hard_cap=40)) for p in prompts[1:3]]
    scheduler.step()
    assert calls == [[len(prompts[0])], [len(p) for p in prompts[1:3]]]  # both at once, over the 1-row budget
    scheduler.run()
    assert all(r.finished for r in [first] + later)


def test_a_scheduler_prepares_the_engines_codec_for_its_plan_before_any_request(engine):
    from higgs_trt.runtime.streaming import StreamPlan

    plans = []
    plan = StreamPlan.exact(engine.codec_strides, first=2)
    scheduler = Scheduler(_recording(engine, "prepare_codec", plans, lambda plan: plan), plan)
    assert plans == [plan] and not scheduler.queue
    Scheduler(_recording(engine, "prepare_codec", plans, lambda plan: plan))
    assert plans[1] == StreamPlan.exact(engine.codec_strides)


def test_the_admission_queue_is_bounded(engine, prompts):
    """Requests beyond the free slots wait, at most max_queue of them; those a free slot will take never count."""
    scheduler = Scheduler(engine, max_queue=2)
    for _ in range(engine.max_batch + 2):
        scheduler.submit(request_for(engine, prompts[0], Sampling()))
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.submit(request_for(engine, prompts[0], Sampling()))
    scheduler.step()  # max_batch of them take the slots: 2 wait
    assert scheduler.busy == engine.max_batch and scheduler.waiting == 2
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.submit(request_for(engine, prompts[0], Sampling()))


def test_streamed_chunks_arrive_in_order_and_make_the_whole(engine, prompts):
    chunks = []
    scheduler = Scheduler(engine)
    request = scheduler.submit(request_for(engine, prompts[3], Sampling(), hard_cap=90, on_chunk=chunks.append))
    scheduler.run()
    whole = generate(engine, [prompts[3]], Sampling(), hard_cap=90)[0]
    assert len(chunks) > 1 and np.array_equal(np.concatenate(chunks), whole.audio)
    assert len(chunks[0]) == 8 * 960  # the first chunk is 8 frames
    assert request.first_audio_at is not None and request.finished_at >= request.first_audio_at
    assert request.submitted_at <= request.admitted_at <= request.first_audio_at


class SeveralRows:
    """The ORT engine decoding as many rows per step as the scheduler allows, as the GPU engine's replays of several
    rows do, and handing them out `lag` launches late, as the GPU engine does; it notes what each step was allowed."""

    def __init__(self, inner, lag=0):
        self.inner, self.lag, self.allowed, self.launches = inner, lag, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, joins):
        self.inner.prefill(joins)
        self.launches.append(self.inner.rows())

    def step(self, n, rows=1):
        self.allowed.append(rows)
        for _ in range(rows):
            self.inner.step(n)
        self.launches.append(self.inner.rows())
        return rows

    def rows(self, keep=0):
        out = []
        while len(self.launches) > keep:
            out += self.launches.pop(0)
        return out


def rows_launched_at_first_audio(scheduler, request, engine):
    steps = len(engine.allowed)
    while request.first_audio_at is None:
        scheduler.step()
    return 1 + sum(engine.allowed[steps:])  # row 0 comes from the prefill


@pytest.mark.parametrize("lag", [0, 1])
def test_steps_of_several_rows_stop_at_the_row_a_first_chunk_needs(engine, prompts, lag):
    """Before a request's first chunk, steps of several rows go up to the row that makes its first window due and
    no further, so the chunk waits for no row after it; a lone request then gets no step until its chunk is out
    (an engine that reports rows `lag` launches late would run that many beside the chunk's codec call), a request
    that joins others gets them."""
    alone = Scheduler(engine)
    one_row = alone.submit(request_for(engine, prompts[0], Sampling(), hard_cap=120))
    alone.run()
    several = SeveralRows(engine, lag)
    scheduler = Scheduler(several)
    due = scheduler.plan.due(0) + NUM_CODEBOOKS - 1  # rows whose codes fix the first window's frames
    request = scheduler.submit(request_for(engine, prompts[0], Sampling(), hard_cap=120))
    assert rows_launched_at_first_audio(scheduler, request, several) == due
    assert len(several.allowed) < due // 2  # several rows a step before it, not one
    scheduler.run()
    assert request.utterance.rows == one_row.utterance.rows and np.array_equal(request.audio(), one_row.audio())
    assert MULTI_ROWS in several.allowed[len(several.allowed) // 2:]

    # a join mid-flight: the same for its first chunk; a cancel frees its slot on the next step
    first = scheduler.submit(request_for(engine, prompts[1], Sampling(), hard_cap=200))
    rows_launched_at_first_audio(scheduler, first, several)
    scheduler.step()
    joined = scheduler.submit(request_for(engine, prompts[2], Sampling(), hard_cap=200))
    assert rows_launched_at_first_audio(scheduler, joined, several) == due + lag
    scheduler.cancel(first)
    scheduler.cancel(joined)
    scheduler.step()
    assert scheduler.busy == 0 and first.stop_reason == joined.stop_reason == "cancelled"


@pytest.mark.parametrize("lag", [0, 1])
def test_no_row_is_launched_past_every_busy_requests_cap(engine, prompts, lag):
    """An engine that reports rows one launch late would otherwise run a launch (of up to MULTI_ROWS rows) that no
    request can use after the last one's final row, and the next join's prefill would wait behind it."""
    several = SeveralRows(engine, lag)
    scheduler = Scheduler(several)
    fixed = []
    for rows in (97, 60):  # the second ends first; the first's last launches are several rows, then single ones
        request = request_for(engine, prompts[len(fixed)], Sampling(), hard_cap=rows)
        request.fixed_rows = True
        fixed.append(scheduler.submit(request))
    scheduler.run()
    assert [len(r.utterance.rows) for r in fixed] == [97, 60]
    assert 1 + sum(several.allowed) == 97  # row 0 from the prefill, then exactly the rows the longer one needs
    assert MULTI_ROWS in several.allowed


class LateCodec:
    """The ORT engine with a codec that is ready only after a few polls, as the GPU engine's codec stream may be, and
    a step that runs on (`busy`) for as many polls or not at all."""

    class Call:
        def __init__(self, done, polls):
            self.done, self.polls = done, polls

        def ready(self):
            self.polls -= 1
            return self.polls < 0

        def result(self):
            return self.done.result()

    def __init__(self, inner, polls, busy_polls=0):
        self.inner, self.polls, self.calls, self.busy_polls, self.running, self.steps = inner, polls, [], busy_polls, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def codec(self, codes, keep=None):
        self.calls.append(self.Call(self.inner.codec(codes, keep), self.polls))
        return self.calls[-1]

    def step(self, n, rows=1):
        self.running = self.busy_polls
        self.steps += 1
        return self.inner.step(n, rows)

    def busy(self):
        self.running -= 1
        return self.running >= 0


def test_audio_decoded_beside_the_steps_arrives_whole_in_order_and_not_after_a_cancel(engine, prompts):
    def fixed(on_chunk, rows=120):
        request = request_for(engine, prompts[3], Sampling(), hard_cap=rows, on_chunk=on_chunk)
        request.fixed_rows = True  # random tiny weights may stop early: several chunks for sure
        return request

    chunks, late_chunks = [], []
    scheduler = Scheduler(engine)
    scheduler.submit(fixed(chunks.append))
    scheduler.run()
    late = LateCodec(engine, polls=3, busy_polls=5)
    scheduler = Scheduler(late)
    request = scheduler.submit(fixed(late_chunks.append))
    while not late.calls:
        scheduler.step()
    assert len(late_chunks) == 1  # a first chunk is waited for in the step that started it, while a step runs
    while scheduler.step():
        pass
    assert len(late_chunks) == len(chunks) > 3 and np.array_equal(np.concatenate(late_chunks), np.concatenate(chunks))
    # later chunks go out once ready (the last step's: waited for, nothing else left to do)
    assert request.finished and any(call.polls < 0 for call in late.calls[1:])

    idle = LateCodec(engine, polls=3, busy_polls=0)  # no step runs on: the lone request's first chunk is waited for
    scheduler = Scheduler(idle)
    early = []
    request = scheduler.submit(fixed(early.append))
    while not idle.calls:
        scheduler.step()
    assert not early
    steps = idle.steps
    scheduler.step()
    assert idle.steps == steps and np.array_equal(early[0], chunks[0])  # out in the next step, which launched none

    # a request cancelled while a chunk of it is decoding gets nothing more
    got = []
    victim = scheduler.submit(fixed(got.append, rows=200))
    for _ in range(400):
        scheduler.step()
        if got and scheduler.decoding:
            break
    assert got and scheduler.decoding  # its first chunk out, a later one decoding
    before = len(got)
    scheduler.cancel(victim)
    while scheduler.step():  # to the end of the other request
        pass
    assert victim.stop_reason == "cancelled" and len(got) == before and request.finished


def test_the_loop_starts_with_the_heap_kept_out_of_full_collections(engine):
    """What is alive when a scheduler starts (modules, the engine) is frozen: a full collection during the loop walks
    only what the loop made (one walk of the start-up heap stalled 64 streams for ~200 ms on the H200 host)."""
    import gc

    before = ["made before the loop"]  # lists are always tracked (a dict of strings is not)
    Scheduler(engine)
    after = ["made in the loop"]
    tracked = gc.get_objects()
    assert not any(o is before for o in tracked) and any(o is after for o in tracked)


def test_both_engine_kinds_implement_every_call_of_the_slot_contract():
    """HostStepper and GpuEngine declare runtime/slots.SlotEngine; a call the Protocol names that a class left out would
    be inherited as a silent no-op, so each must define every one itself."""
    from higgs_trt.runtime.gpu.engine import GpuEngine
    from higgs_trt.runtime.slots import SlotEngine

    calls = {name for name, value in vars(SlotEngine).items() if callable(value) and not name.startswith("_")}
    assert calls == {"prefill", "step", "rows", "reserve", "release", "busy", "prepare_codec", "codec"}
    for engine in (HostStepper, GpuEngine):
        assert SlotEngine in engine.__mro__ and calls <= set(vars(engine)), engine


class EndsAtRowOne:
    """The ORT engine whose every request emits EOC on codebook 0 at row 1: an utterance of one frame by the stop
    rules."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def rows(self, keep=0):
        out = self.inner.rows(keep)
        for slot, codes in out:
            if self.inner.row[slot] == 2:  # the row just chosen was row 1
                codes[0] = EOC
        return out


def test_a_fixed_length_request_gets_every_row_and_frame_whatever_its_codes(engine, prompts):
    """Benchmarks fix the length: EOC ends nothing and every row completes a frame, so a lone request's first window
    falls due and the loop never waits on a chunk that cannot come."""
    wrapped = EndsAtRowOne(engine)
    scheduler = Scheduler(wrapped)
    request = request_for(wrapped, prompts[0], Sampling(), hard_cap=40)
    request.fixed_rows = True
    scheduler.submit(request)
    for _ in range(200):
        if not scheduler.step():
            break
    assert request.finished and len(request.utterance.rows) == 40
    assert len(request.audio()) == (40 - NUM_CODEBOOKS + 1) * 960
