import numpy as np
import pytest

from higgs_trt.runtime.decoding import (BOC, EOC, HARD_CAP_ROWS, REPEAT_GUARD_ROWS, Utterance, apply_delay, delay_mask,
                                        revert_delay, row_cap, sanitize)
from higgs_trt.runtime.sampling import choose_row, uniform

rng = np.random.default_rng(0)


def random_frames(t):
    return rng.integers(0, 1024, size=(t, 8)).astype(np.int32)


def test_delay_round_trip_and_layout():
    frames = random_frames(5)
    rows = apply_delay(frames)
    assert rows.shape == (12, 8)
    assert np.array_equal(revert_delay(rows), frames)
    for k in range(8):
        assert (rows[:k, k] == BOC).all()  # upper-left BOC
        assert np.array_equal(rows[k:k + 5, k], frames[:, k])
        assert (rows[k + 5:, k] == EOC).all()  # lower-right EOC
    assert revert_delay(rows[:7]).shape == (0, 8)


def test_delay_mask_ramp_up_and_ramp_down():
    codes = np.full((3, 8), 7, np.int32)
    out = delay_mask(codes, row=np.array([0, 3, 20]), end_frame=np.array([100, 100, 15]))
    assert list(out[0]) == [7] + [BOC] * 7  # row 0: only codebook 0 is real
    assert list(out[1]) == [7] * 4 + [BOC] * 4  # codebook k real from row k
    # row 20 with end frame 15: codebook k carries frame 20-k, so k ≤ 5 are past the end → EOC
    assert list(out[2]) == [EOC] * 6 + [7] * 2


def push_all(u, rows):
    for r in rows:
        if u.done:
            break
        u.push(r)
    return u


def speech_row(j):
    return delay_mask(random_frames(1), np.array([j]), np.array([1 << 40]))[0]


def test_eoc_on_codebook_0_keeps_frames_before_it():
    u = Utterance(max_rows=500)
    for j in range(20):
        u.push(speech_row(j))
    eoc = speech_row(20)
    eoc[0] = EOC
    u.push(eoc)
    assert u.end_frame == 20 and not u.done  # frames 0..19 still need their later codebooks
    while not u.done:
        u.push(delay_mask(random_frames(1), np.array([len(u.rows)]), np.array([20]))[0])
    assert u.stop_reason == "eoc" and len(u.rows) == 27  # rows up to 20 + 6 complete frame 19
    frames = u.frames()
    assert frames.shape == (20, 8) and frames.max() < 1024


def test_eoc_on_codebook_0_during_ramp_up_counts():
    u = Utterance(max_rows=500)
    row = speech_row(0)
    row[0] = EOC
    u.push(row)
    assert u.done and u.stop_reason == "eoc" and u.frames().shape == (0, 8)


def test_eoc_on_a_later_codebook_only_after_ramp_up():
    u = Utterance(max_rows=500)
    for j in range(5):
        r = speech_row(j)
        if j == 4:
            r[3] = EOC  # during ramp-up: not an end
        u.push(r)
    assert u.end_frame is None
    for j in range(5, 12):
        u.push(speech_row(j))
    r = speech_row(12)
    r[3] = EOC  # after ramp-up: frame 12 - 3 = 9 ends the utterance
    u.push(r)
    assert u.end_frame == 9 and not u.done
    while not u.done:
        u.push(speech_row(len(u.rows)))
    assert u.stop_reason == "eoc" and len(u.rows) == 16  # frame 8 completes at row 8 + 7
    assert u.frames().shape == (9, 8)


def test_earliest_end_wins():
    u = Utterance(max_rows=500)
    for j in range(30):
        u.push(speech_row(j))
    r = speech_row(30)
    r[0], r[5] = EOC, EOC
    u.push(r)
    assert u.end_frame == 25


def test_repeat_guard():
    u = Utterance(max_rows=1000)
    for j in range(8):
        u.push(speech_row(j))
    same = speech_row(8)
    push_all(u, [same] * 100)
    assert u.stop_reason == "repeat" and len(u.rows) == 8 + REPEAT_GUARD_ROWS
    assert u.frames().shape == (len(u.rows) - 7, 8)


def test_cap():
    u = push_all(Utterance(max_rows=40), [speech_row(j) for j in range(100)])
    assert u.stop_reason == "cap" and len(u.rows) == 40 and u.frames().shape == (33, 8)


def test_row_cap_grows_with_text_and_is_bounded():
    assert row_cap(1) < row_cap(100) < row_cap(10_000) == HARD_CAP_ROWS
    assert row_cap(0) >= 8
    assert row_cap(10_000, hard_cap=300) == 300


def test_sanitize_zeroes_specials_never_clamps():
    frames = np.array([[0, 1023, 1024, 1025, -1, 5, 2000, 7]])
    assert list(sanitize(frames)[0]) == [0, 1023, 0, 0, 0, 5, 0, 7]


def test_greedy_ties_go_to_lowest_index():
    logits = np.zeros((8, 1026), np.float32)
    logits[:, 10] = logits[:, 3] = 5.0
    assert list(choose_row(logits, 0.0, 0, 1.0, seed=0, row=4)) == [3] * 8


def test_sampling_depends_only_on_seed_and_row():
    logits = rng.normal(size=(8, 1026)).astype(np.float32)

    def draw(seed):
        return [choose_row(logits, 1.0, 50, 0.9, seed, row) for row in range(20)]

    a, b, c = draw(1), draw(1), draw(2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert not all(np.array_equal(a[0], x) for x in a[1:])  # rows draw differently
    assert uniform(7, 3, 2) == uniform(7, 3, 2) and 0 <= uniform(2**63 - 1, 2047, 7) < 1  # 24 bits, any seed


def test_top_k_and_top_p_restrict_the_choice():
    logits = rng.normal(size=(8, 1026)).astype(np.float32)
    top5 = np.argsort(-logits, axis=-1)[:, :5]
    for row in range(50):
        codes = choose_row(logits, 2.0, 5, 1.0, seed=0, row=row)
        assert all(c in top5[k] for k, c in enumerate(codes))
    # a tiny nucleus leaves only the best code
    best = np.argmax(logits, axis=-1)
    assert np.array_equal(choose_row(logits, 1.0, 0, 1e-6, seed=0, row=0), best)
    # so does one below float32's range (0 in float32), as in the device kernel
    assert np.array_equal(choose_row(logits, 1.0, 0, 1e-300, seed=0, row=0), best)


@pytest.mark.parametrize("temperature", [0.3, 1.0])
def test_sampling_follows_the_distribution(temperature):
    logits = np.log(np.array([[0.5, 0.3, 0.2] + [1e-12] * 1023] * 8, np.float64))
    counts = np.zeros(3)
    for row in range(2000):
        counts += np.bincount(choose_row(logits, temperature, 0, 1.0, seed=0, row=row), minlength=1026)[:3]
    p = np.array([0.5, 0.3, 0.2]) ** (1 / temperature)
    assert np.allclose(counts / counts.sum(), p / p.sum(), atol=0.02)
