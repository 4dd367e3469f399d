"""The worker's congestion window (``ncina.worker.window.CongestionWindow``) fed by hand: RTT
samples, losses and stalls in, the window's values out, exactly; and its C twin
(``worker/window.c``) giving the same doubles for the same events."""

from __future__ import annotations

import numpy as np
import pytest
from ncina.worker import cpath
from ncina.worker.window import CongestionWindow

TARGET = CongestionWindow.TARGET


def test_slow_start_adds_a_slot_per_result_until_the_queue_reaches_the_target() -> None:
    window = CongestionWindow(64)
    assert window.limit == 8 and window.slow_start
    for _ in range(20):
        window.sample(0.001)  # the idle path: no queueing delay
    assert window.cwnd == 28.0 and window.limit == 28 and window.base == 0.001
    window.sample(0.001 + TARGET)  # a queue of the target: slow start ends, no change
    assert not window.slow_start and window.cwnd == 28.0 and window.delay == TARGET


def test_slow_start_stops_at_the_pool() -> None:
    window = CongestionWindow(10)
    for _ in range(5):
        window.sample(0.002)
    assert window.cwnd == 10.0 and window.limit == 10 and window.slow_start


def test_the_delay_rule_moves_at_most_one_slot_per_window_of_results() -> None:
    window = CongestionWindow(64)
    window.sample(0.001)  # 9 slots
    window.sample(0.1)  # far above the target: off-target clamped to -1, slow start over
    assert window.cwnd == 9.0 - 1.0 / 9.0
    window.cwnd = 20.0
    for _ in range(20):  # a whole window of results at twice the target: down by about one
        window.sample(0.001 + 2 * TARGET)
    assert 18.9 < window.cwnd < 19.0
    window.cwnd = 20.0
    window.sample(0.001 + TARGET / 2)  # half the target: up by half a slot per window
    assert window.cwnd == 20.0 + 0.5 / 20.0
    window.sample(0.0005)  # a smaller RTT is the new base: no delay, full increase
    assert window.base == 0.0005 and window.delay == 0.0
    assert window.cwnd == pytest.approx(20.025 + 1 / 20.025)


def test_a_result_of_a_re_sent_chunk_grows_the_window_without_a_measurement() -> None:
    window = CongestionWindow(64)
    window.sample(0.001)
    window.sample(0.001 + 2 * TARGET)  # slow start over, a queue of twice the target
    assert window.stall() and window.cwnd == 1.0 and window.slow_start and window.delay == 0.0
    window.sample(-1.0)  # re-sent: no RTT, the stall is not undone; slow start from one
    assert window.cwnd == 2.0 and window.saved > 0 and window.delay == 0.0
    window.sample(-1.0)
    assert window.cwnd == 3.0 and window.base == 0.001


def test_the_window_never_falls_below_one_slot() -> None:
    window = CongestionWindow(64)
    window.sample(0.001)
    window.cwnd = 1.0
    window.sample(1.0)
    assert window.cwnd == 1.0 and window.limit == 1


def test_a_loss_halves_the_window_only_when_the_queue_is_full_once_per_window() -> None:
    window = CongestionWindow(64)
    for _ in range(32):
        window.sample(0.001)
    assert window.cwnd == 40.0
    window.loss()  # no queue: random loss or a straggler, left alone
    assert window.cwnd == 40.0 and window.cuts == 0
    for _ in range(40):
        window.sample(0.001 + 2 * TARGET)  # the queue is past the target
    before = window.cwnd
    window.loss()
    assert window.cwnd == before / 2 and window.cuts == 1 and window.since_cut == 0
    window.loss()  # the same window of results: no second halving
    assert window.cwnd == before / 2 and window.cuts == 1
    for _ in range(int(window.cwnd) + 1):
        window.sample(0.001 + 2 * TARGET)
    halved = window.cwnd
    window.loss()
    assert window.cwnd == halved / 2 and window.cuts == 2


def test_a_stall_drops_to_one_slot_and_a_first_copy_answered_puts_the_window_back() -> None:
    window = CongestionWindow(64)
    for _ in range(12):
        window.sample(0.001)
    assert window.cwnd == 20.0
    assert window.stall() and window.limit == 1 and window.saved == 20.0
    assert window.stall() and window.saved == 20.0 and window.stalls == 2  # kept, not 1
    window.sample(0.2)  # a first copy answered after the wait: nothing was lost
    assert window.saved == 0.0 and window.cwnd == 20.0 - 1.0 / 20.0 and not window.slow_start


def test_a_fixed_window_is_the_pool_whatever_happens() -> None:
    window = CongestionWindow(16, "fixed")
    assert window.limit == 16
    for rtt in (0.001, 0.5, 0.001):
        window.sample(rtt)
    window.loss()
    assert not window.stall()
    assert window.cwnd == 16.0 and window.limit == 16 and window.base == 0.0
    with pytest.raises(ValueError, match="window mode"):
        CongestionWindow(16, "vegas")
    with pytest.raises(ValueError, match="at least one slot"):
        CongestionWindow(0)


def test_c_window_gives_the_python_windows_doubles() -> None:
    """window.c mirrors CongestionWindow operation for operation: a seeded run of samples
    (an idle path, a queue, waits), losses and stalls gives the same state after every event."""
    module = cpath.load()
    ffi, lib = module.ffi, module.lib
    rng = np.random.default_rng(5)
    for mode in ("adaptive", "fixed"):
        reference = CongestionWindow(48, mode)
        c = ffi.new("struct ncw_cwnd *")
        for name in cpath.WINDOW_FIELDS:
            setattr(c, name, getattr(reference, name))
        for step in range(3000):
            event = rng.integers(20)
            if event == 0:
                reference.loss()
                lib.ncw_cwnd_loss(c)
            elif event == 1 and step % 7 == 0:
                assert lib.ncw_cwnd_stall(c) == reference.stall()
            else:
                rtt = float(rng.choice([rng.uniform(0.0005, 0.002), rng.uniform(0.002, 0.02),
                                        rng.uniform(0.05, 0.3), -1.0],
                                       p=[0.55, 0.3, 0.05, 0.1]))  # fmt: skip
                reference.sample(rtt)
                lib.ncw_cwnd_sample(c, rtt)
            for name in cpath.WINDOW_FIELDS:
                assert getattr(c, name) == getattr(reference, name), (step, name)
            assert lib.ncw_cwnd_limit(c) == reference.limit
        if mode == "adaptive":  # the run went through every rule
            assert reference.cuts > 0 and reference.stalls > 0 and reference.limit < 48
