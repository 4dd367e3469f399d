"""The worker's congestion window (``ncina.worker.window.CongestionWindow``) fed by hand: RTT
samples and stalls in, the window's values out, exactly; and its C twin
(``worker/window.c``) giving the same doubles for the same events."""

from __future__ import annotations

import numpy as np
import pytest
from ncina.worker import cpath
from ncina.worker.window import CongestionWindow

TARGET = CongestionWindow.TARGET


def test_slow_start_adds_a_slot_per_result_until_a_round_shows_the_target() -> None:
    window = CongestionWindow(64)
    assert window.limit == 8 and window.slow_start
    for _ in range(8):  # the first round: no queueing delay, 8 more slots
        window.sample(0.001)
    assert window.cwnd == 16.0 and window.base == 0.001 and window.delay == 0.0
    assert window.round_results == 0 and window.round_min == 0.0  # a new round began
    for _ in range(15):
        window.sample(0.001 + TARGET)  # a queue of the target: the round is not over yet
    assert window.slow_start and window.cwnd == 31.0
    window.sample(0.001 + 2 * TARGET)  # the 16th result ends the round: its least is TARGET
    assert not window.slow_start and window.delay == 0.001 + TARGET - 0.001
    # Swift's decrease: 1 - 0.8 (delay - TARGET) / delay, 0 here (the delay is the target)
    assert window.cwnd == 32.0 * (1.0 - 0.8 * (window.delay - TARGET) / window.delay)


def test_slow_start_stops_at_the_pool() -> None:
    window = CongestionWindow(10)
    for _ in range(5):
        window.sample(0.002)
    assert window.cwnd == 10.0 and window.limit == 10 and window.slow_start


def congestion_avoidance(cwnd: float) -> CongestionWindow:
    """A window past its slow start at ``cwnd`` slots, its base 1 ms, a new round beginning."""
    window = CongestionWindow(64)
    window.sample(0.001)
    window.slow_start = False
    window.cwnd = cwnd
    window.round_min = 0.0
    window.round_results = 0
    window.round_size = window.limit
    return window


def test_a_round_below_the_target_adds_one_slot() -> None:
    window = congestion_avoidance(20.0)
    for _ in range(19):
        window.sample(0.001 + TARGET / 2)
    assert window.cwnd == 20.0 and window.round_min == 0.001 + TARGET / 2
    window.sample(0.001 + 3 * TARGET)  # the 20th: the round's least is half the target
    assert window.cwnd == 21.0 and window.delay == 0.001 + TARGET / 2 - 0.001


def test_one_quick_result_in_a_round_shows_there_is_no_standing_queue() -> None:
    window = congestion_avoidance(10.0)
    for j in range(10):  # a descheduled process delays nine of ten results by 30 ms
        window.sample(0.031 if j else 0.0012)
    assert window.cwnd == 11.0 and window.delay == 0.0012 - 0.001


def test_a_standing_queue_takes_its_excess_off_the_window_at_most_half() -> None:
    window = congestion_avoidance(20.0)
    for _ in range(20):  # every result of the round waits 2 TARGET in the queue
        window.sample(0.001 + 2 * TARGET)
    delay = 0.001 + 2 * TARGET - 0.001
    assert window.delay == delay
    assert window.cwnd == 20.0 * (1.0 - 0.8 * (delay - TARGET) / delay)  # about 0.6
    assert window.limit == 12
    for _ in range(12):  # twenty times the target: the decrease stops at a half
        window.sample(0.001 + 20 * TARGET)
    assert window.cwnd == 20.0 * (1.0 - 0.8 * (delay - TARGET) / delay) * 0.5


def test_a_result_of_a_re_sent_chunk_counts_in_the_round_without_a_measurement() -> None:
    window = congestion_avoidance(4.0)
    for _ in range(3):
        window.sample(-1.0)  # re-sent: no RTT
    assert window.round_results == 3 and window.round_min == 0.0
    window.sample(-1.0)  # a round without any RTT: the last delay stands (none), +1
    assert window.cwnd == 5.0 and window.delay == 0.0
    window.delay = 2 * TARGET
    assert window.stall() and window.cwnd == 1.0 and window.slow_start and window.delay == 0.0
    window.sample(-1.0)  # after a stall, slow start from one; the stall is not undone
    assert window.cwnd == 2.0 and window.saved == 5.0


def test_the_window_never_falls_below_one_slot() -> None:
    window = congestion_avoidance(1.0)
    window.sample(1.0)
    assert window.cwnd == 1.0 and window.limit == 1


def test_a_stall_drops_to_one_slot_and_a_first_copy_answered_puts_the_window_back() -> None:
    window = congestion_avoidance(20.0)
    assert window.stall() and window.limit == 1 and window.saved == 20.0
    assert window.slow_start and window.round_size == 1
    assert window.stall() and window.saved == 20.0 and window.stalls == 2  # kept, not 1
    window.resume()  # a first copy sent before the stall answered: nothing was lost
    assert window.saved == 0.0 and window.cwnd == 20.0 and not window.slow_start
    assert (window.round_results, window.round_size) == (0, 20)  # a new round
    window.sample(-1.0)  # the transfer gives it no RTT: it waited
    assert window.cwnd == 20.0 and window.round_results == 1
    window.resume()  # nothing saved: nothing changes
    assert window.cwnd == 20.0 and window.round_results == 1


def test_a_fixed_window_is_the_pool_whatever_happens() -> None:
    window = CongestionWindow(16, "fixed")
    assert window.limit == 16
    for rtt in (0.001, 0.5, 0.001):
        window.sample(rtt)
    assert not window.stall()
    assert window.cwnd == 16.0 and window.limit == 16 and window.base == 0.0
    with pytest.raises(ValueError, match="window mode"):
        CongestionWindow(16, "vegas")
    with pytest.raises(ValueError, match="at least one slot"):
        CongestionWindow(0)


def test_c_window_gives_the_python_windows_doubles() -> None:
    """window.c mirrors CongestionWindow operation for operation: a seeded run of samples
    (an idle path, a queue, waits) and stalls gives the same state after every event."""
    module = cpath.load()
    ffi, lib = module.ffi, module.lib
    rng = np.random.default_rng(5)
    for mode in ("adaptive", "fixed"):
        reference = CongestionWindow(48, mode)
        c = ffi.new("struct ncw_cwnd *")
        for name in cpath.WINDOW_FIELDS:
            setattr(c, name, getattr(reference, name))
        for step in range(6000):
            # Phases of 300 events: an idle path, a standing queue of 6-30 ms, a mix.
            low, high = [(0.0005, 0.002), (0.007, 0.031), (0.0005, 0.031)][step // 300 % 3]
            event = rng.integers(40)
            if event == 1 and step % 5 == 0:
                assert lib.ncw_cwnd_stall(c) == reference.stall()
            elif event == 3:
                reference.resume()
                lib.ncw_cwnd_resume(c)
            else:
                rtt = -1.0 if event == 2 else float(rng.uniform(low, high))
                reference.sample(rtt)
                lib.ncw_cwnd_sample(c, rtt)
            for name in cpath.WINDOW_FIELDS:
                assert getattr(c, name) == getattr(reference, name), (step, name)
            assert lib.ncw_cwnd_limit(c) == reference.limit
        if mode == "adaptive":  # the run went through every rule
            assert reference.stalls > 0 and reference.limit < 48


def test_a_client_keeps_the_whole_pool_unless_asked_for_the_adaptive_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default is the fixed window (docs/reliability.md's A/B); ``cwnd`` or
    ``$NCINA_CWND`` choose, the argument first; anything else is refused by name."""
    from ncina.worker.client.allreduce import _choose_window
    from ncina.worker.window import WINDOW_ENV

    monkeypatch.delenv(WINDOW_ENV, raising=False)
    assert _choose_window(None) == "fixed"
    assert _choose_window("adaptive") == "adaptive"
    monkeypatch.setenv(WINDOW_ENV, "adaptive")
    assert _choose_window(None) == "adaptive"
    assert _choose_window("fixed") == "fixed"
    monkeypatch.setenv(WINDOW_ENV, "cubic")
    with pytest.raises(ValueError, match="NCINA_CWND must be one of"):
        _choose_window(None)
    with pytest.raises(ValueError, match="cwnd must be one of"):
        _choose_window("reno")
