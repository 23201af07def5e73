"""Real-time scheduling (runtime/realtime.py) on the tiny ONNX Runtime engine under a simulated clock: with more
streams than decoded slots, the streams closest to a stall are decoded first and none starves; a request's codes do
not depend on when its rows were decoded; a request that would push the others under real time is refused."""

import re

import numpy as np
import pytest

from higgs_trt.runtime.decoding import Sampling
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.prompt import HiggsTokenizer, build_prompt
from higgs_trt.runtime.realtime import HEADROOM, SWAP_MARGIN, StepTimes, deadline
from higgs_trt.runtime.request import QueueFull, request_for
from higgs_trt.runtime.scheduler import Scheduler

TEXTS = ["Hello there, how are you?", "She sells sea shells.", "Numbers: one, two, three.", "Wait, what? No way!"]
ROWS = 100


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedSteps:
    """The engine, with each step taking `per_slot` simulated seconds per slot it decodes; it checks the deadline
    order at every step launched."""

    def __init__(self, inner, clock: Clock, per_slot: float):
        self.inner, self.clock, self.per_slot = inner, clock, per_slot
        self.scheduler = None
        self.launches: list[list[int]] = []  # per step: ids of the requests it decoded

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, n, rows=1):
        s = self.scheduler
        decoded = [s.slots[i] for i in range(n) if s.slots[i] is not None]
        waiting = [r for r in s.slots[s.lanes:] if r is not None]
        if waiting and len(decoded) == s.lanes:
            latest = max(deadline(r) for r in decoded)
            assert all(deadline(r) >= latest - SWAP_MARGIN for r in waiting), "a stream nearer a stall waited"
        self.launches.append([id(r) for r in decoded])
        launched = self.inner.step(n, rows)
        self.clock.now += self.per_slot * n * launched
        return launched


@pytest.fixture(scope="module")
def prompts(tiny_engine):
    tok = HiggsTokenizer(tiny_engine / "tokenizer.json")
    return [build_prompt(tok, t) for t in TEXTS]


def timed(engine, per_slot, **options):
    clock = Clock()
    steps = TimedSteps(engine, clock, per_slot)
    scheduler = Scheduler(steps, clock=clock, **options)
    steps.scheduler = scheduler
    return scheduler, steps


def speak(scheduler, engine, prompt, seed):
    request = request_for(engine, prompt, Sampling(1.0, seed=seed), hard_cap=ROWS)
    request.fixed_rows = True
    return scheduler.submit(request)


def test_more_streams_than_decoded_slots_take_turns_by_deadline_with_the_same_codes(engine, prompts):
    """Four streams, two decoded at a time, a step of two slots taking 20 ms: streams take turns (each is decoded in
    many separate stretches, none waits to the end), every step decodes the two nearest a stall, and each request's
    codes equal its solo run's."""
    solo = []
    for i, prompt in enumerate(prompts):
        alone = Scheduler(engine)
        solo.append(speak(alone, engine, prompt, i))
        alone.run()
    scheduler, steps = timed(engine, 0.010, lanes=2)
    together = [speak(scheduler, engine, p, i) for i, p in enumerate(prompts)]
    scheduler.run()
    for a, b in zip(solo, together):
        assert np.array_equal(np.stack(a.utterance.rows), np.stack(b.utterance.rows))
    for request in together:
        decoded = [id(request) in launch for launch in steps.launches]
        stretches = sum(1 for i, on in enumerate(decoded) if on and (i == 0 or not decoded[i - 1]))
        assert stretches > 2, "a stream was not taken in turns"
    assert max(len(launch) for launch in steps.launches) == 2


def test_swapping_needs_an_engine_that_can_move_requests(engine):
    class Fixed:
        swappable = False

        def __getattr__(self, name):
            return getattr(engine, name)

    with pytest.raises(HiggsError, match="cannot move a request between slots"):
        Scheduler(Fixed(), lanes=2)


def test_the_measured_step_time_decides_how_many_streams_keep_up():
    times = StepTimes()
    assert times.keeps_up(1000, 64)  # nothing measured yet: admit
    times.record(4, 0.020, 1)  # 20 ms a row for 4 slots
    assert times.estimate(2) == 0.020 and times.estimate(8) == pytest.approx(0.040)
    limit = HEADROOM * 0.04
    assert times.keeps_up(4, 4) == (0.020 <= limit)
    assert not times.keeps_up(8, 4)  # 8 streams in 4 lanes: each gets a frame every 40 ms
    times.record(4, 0.040, 1)
    assert times.estimate(4) == pytest.approx(0.024)  # a running mean


def test_a_request_that_would_push_the_others_under_real_time_is_refused(engine, prompts):
    """A step costs 11 ms per slot decoded (under HEADROOM × 40 ms for up to three streams, not four): the fourth
    request is refused while three play, and taken once they are done."""
    per_slot = 0.011
    assert 3 * per_slot <= HEADROOM * 0.04 < 4 * per_slot
    scheduler, _ = timed(engine, per_slot, realtime=True)
    playing = [speak(scheduler, engine, p, i) for i, p in enumerate(prompts[:3])]
    for _ in range(20):
        scheduler.step()
    with pytest.raises(QueueFull, match="real-time capacity"):
        speak(scheduler, engine, prompts[3], 3)
    scheduler.run()
    assert all(r.finished and r.error is None for r in playing)
    late = speak(scheduler, engine, prompts[3], 3)
    scheduler.run()
    assert late.finished and late.error is None


@pytest.mark.parametrize("chunks, stalled, ends", [
    ([(0.0, 2400), (0.05, 2400), (0.15, 2400)], 0.0, 0.3),  # each tenth of a second arrives before it is needed
    ([(0.0, 2400), (0.05, 2400), (0.5, 2400)], 0.3, 0.6),  # ran dry at 0.2 s, the buffer full again at 0.5 s
    ([(0.0, 1200), (0.3, 1200), (0.35, 2400)], 0.0, 0.5),  # plays from 0.3 s (the 100 ms buffer): waiting is no stall
    ([(0.0, 2400), (0.4, 1200)], 0.3, 0.45),  # dry at 0.1 s; the last 50 ms end the utterance: played at once
])
def test_a_listener_stalls_when_playback_runs_past_what_has_arrived(chunks, stalled, ends):
    from higgs_trt.runtime.bench.loop import playback

    assert playback(chunks, buffer=0.1) == pytest.approx((stalled, ends))


def test_bench_stream_realtime_reports_each_rate_and_the_largest_without_a_stall(tiny_engine):
    from click.testing import CliRunner

    from higgs_trt.runtime.cli import main

    result = CliRunner().invoke(main, ["bench", "stream", "--engine", str(tiny_engine), "--rows", "32", "--realtime",
                                       "1,3", "--duration", "2", "--slots", "2", "--lanes", "1"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split(" arrivals/s")[0] for line in lines[:2]] == ["1", "3"]
    assert "stall share" in lines[0] and "first audio p50" in lines[1]
    assert all(float(re.search(r"mean listeners ([\d.]+)", line)[1]) > 0 for line in lines[:2]), result.output
    assert lines[2].startswith(("largest rate with no stall", "every rate stalled"))


def test_a_server_with_fewer_lanes_than_slots_serves_each_request_as_alone(tiny_engine, tmp_path):
    """serve --lanes 1 --realtime: two requests at once take turns in the one decoded slot, and each gets the audio it
    gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from serving import Server, body

    server = Server(tiny_engine, tmp_path / "server.log", "--max-batch", 2, "--lanes", 1, "--realtime")
    try:
        def speak_served(seed):
            r = httpx.post(server.url + "/v1/audio/speech", json=body(input=TEXTS[seed], seed=seed,
                                                                       max_new_tokens=40), timeout=120)
            assert r.status_code == 200, r.text
            return r.content

        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(speak_served, (0, 1)))
        assert [speak_served(0), speak_served(1)] == together
    finally:
        assert server.stop() == 0
