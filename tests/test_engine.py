"""The C slot engine offline (``aggregator/engine``, through the socket backend's extension: no
network, no DPDK): datagram for datagram against the Python reference (``ncina.aggregator.
slots``), the replies' bytes and destinations and the counters compared; and its limits (reply
buffers, the reply room, job parameters).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ncina.aggregator.backends.python.handshake import RESTART_IDLE, job_descriptor
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.backends.python.slots import RESEND_BURST, RESEND_INTERVAL
from ncina.aggregator.engine import Engine
from ncina.aggregator.hierarchy import LeafAggregator, SpineSlots, Upstream
from ncina.aggregator.jobs import JobConfig
from ncina.proto import nc8, tag
from ncina.proto.descriptor import UPLINK_INT, Descriptor, pack_job_datagram
from ncina.proto.header import ELEMENT_SIZE, FLAG_RESULT, FLAG_RETX, FLAG_TAG, HEADER, Format
from ncina.proto.nc8 import sum_bits
from ncina.proto.wire import MAX_K, TAG_SIZE
from ncina_parity import GENERATION, KEY, K, schedule
from ncina_testlib import engine_process, uplink, window_e_min

AGG_IP = "10.9.0.1"
STRIDE = 2048


@pytest.fixture
def engine() -> Iterator[Engine]:
    """The process's engine of the socket extension, emptied; jobs are installed by the test."""
    from ncina.aggregator.backends.socket.binding import load

    e = Engine(load())
    e.lib.nce_reset()
    yield e
    e.lib.nce_reset()
    e.set_generation(0)
    e.set_restart_idle(RESTART_IDLE)


def process(e: Engine, datagram: bytes, src: tuple[str, int]) -> list[tuple[bytes, Any]]:
    """One datagram through the C engine; its replies as (datagram, (host, port))."""
    return engine_process(e, datagram, src, AGG_IP, STRIDE)


def replay_against(
    engine: Engine, reference: Any, packets: list[tuple[int, bytes]], sources: list[Any]
) -> int:
    """Each (rank, datagram) through ``reference`` (a Python aggregator) and the C engine: the
    same replies, datagram by datagram; returns how many there were."""
    return sum(len(replay_one(engine, reference, datagram, sources[rank]))
               for rank, datagram in packets)  # fmt: skip


def replay_one(
    engine: Engine, reference: Any, datagram: bytes, source: tuple[str, int]
) -> list[tuple[bytes, Any]]:
    """One datagram from ``source`` through ``reference`` and the C engine: the same replies
    (returned)."""
    want = list(reference.handle(datagram, source))
    got = process(engine, datagram, source)
    assert got == want, f"datagram {datagram[:16].hex()} from {source}"
    return got


@pytest.mark.parametrize("keyed", [False, True], ids=["untagged", "keyed"])
@pytest.mark.parametrize("result", ["int", "nc8", "int32"])
def test_datagram_for_datagram_like_the_reference(
    engine: Engine, result: str, keyed: bool
) -> None:
    workers, pool = 3, 4
    config = JobConfig.create(job=9, workers=workers, k=K, result_format=result, seed=42,
                              pool_size=pool, key=KEY if keyed else None)  # fmt: skip
    reference = Aggregator(GENERATION)
    reference.add_job(config)
    engine.set_generation(GENERATION)
    engine.add_job(config)
    sources = [(f"10.9.1.{rank + 1}", 5000 + rank) for rank in range(workers)]
    packets = schedule(9, workers, rounds=40, pool=pool, seed=7, key=KEY if keyed else None,
                       sum_bits=sum_bits(config.result_format))  # fmt: skip
    assert replay_against(engine, reference, packets, sources) > 40
    assert engine.job_stats(9).to_json() == reference.jobs[9].stats.to_json()
    assert engine.global_stats().to_json() == reference.stats.to_json()


def spine_config(result: str, key: bytes | None = None) -> JobConfig:
    """A spine of 3 leaves of 2 workers each (docs/protocol.md, "Hierarchical aggregation")."""
    return JobConfig.create(job=9, workers=3, k=K, result_format=result, seed=42, pool_size=4,
                            key=key, total_workers=6, uplink_format="int")  # fmt: skip


@pytest.mark.parametrize("keyed", [False, True], ids=["untagged", "keyed"])
@pytest.mark.parametrize("result", ["int", "nc8", "int32"])
def test_spine_datagram_for_datagram_like_the_reference(
    engine: Engine, result: str, keyed: bool
) -> None:
    """A spine's job: int partial sums in bound, at it and beyond it, and nc8 codes, against
    ``hierarchy.SpineSlots``; and its answer to a leaf's hello, uplink byte and window of the
    total workers included."""
    key = KEY if keyed else None
    config = spine_config(result, key)
    reference = Aggregator(GENERATION)
    reference.install(SpineSlots(config))
    engine.set_generation(GENERATION)
    engine.add_job(config)
    sources = [(f"10.9.1.{rank + 1}", 5000 + rank) for rank in range(3)]
    hello = pack_job_datagram(Descriptor(mode=int(config.result_format), workers=3,
                                         pool_size=4, k=K, e_max=10,
                                         e_min=config.window.e_min, keyed=keyed, compressor=0,
                                         uplink=UPLINK_INT),
                              job=9, rank=1, key=key)  # fmt: skip
    packets = [(1, hello), *schedule(9, 3, rounds=40, pool=4, seed=7, key=key, total=6,
                                     sum_bits=sum_bits(config.result_format))]  # fmt: skip
    # fewer than one level: a round with a bad lane needs a duplicate (19 for int32's seed)
    assert replay_against(engine, reference, packets, sources) > 15
    stats = engine.job_stats(9)
    assert stats.to_json() == reference.jobs[9].stats.to_json()
    assert stats.drops["bad_code"] and stats.drops["bad_format"] and stats.handshakes == 1
    assert engine.global_stats().to_json() == reference.stats.to_json()


def test_spine_partial_sums_at_the_int64_extremes(engine: Engine) -> None:
    """Lanes at the bound sum exactly; lanes at INT64_MIN and INT64_MAX are bad_code, as every
    lane beyond the bound (no overflow, no undefined negation)."""
    config = spine_config("int")
    engine.add_job(config)
    bound = 2 << config.window.span
    emin = config.window.e_min

    def send(rank: int, lanes: list[int]) -> list[tuple[bytes, Any]]:
        payload = b"".join(struct.pack("!q", v) for v in lanes)
        datagram = uplink(job=9, rank=rank, slot=0, offset=0, codes=payload, emin=emin,
                          format=1, count=len(lanes))  # fmt: skip
        return process(engine, datagram, (f"10.9.1.{rank + 1}", 5000 + rank))

    for lanes in ([-(2**63), 0], [2**63 - 1, 0], [bound + 1, 0], [0, -bound - 1]):
        assert send(0, lanes) == []
    assert engine.job_stats(9).drops["bad_code"] == 4
    assert send(0, [bound, -bound]) == [] and send(1, [bound, -bound]) == []
    out = send(2, [bound, -bound])
    assert [d[16:] for d, _ in out] == [struct.pack("!qq", 3 * bound, -3 * bound)] * 3


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3), st.integers(0, 1), st.integers(0, 1),  # rank, slot, version
            st.sampled_from((0, 1, -1, 2)),  # lanes: 0, the bound, minus it, beyond it
            st.integers(0, 120), st.integers(0, 255), st.integers(0, 19),  # one byte, a cut
        ),
        max_size=40,
    )
)  # fmt: skip
def test_spine_fuzz_like_the_reference(engine: Engine, items: list[Any]) -> None:
    """Mostly valid partial sums (a rank beyond the leaves too) with one byte replaced or the
    end cut: the engine's replies and counters are ``SpineSlots``'s, datagram by datagram."""
    engine.lib.nce_reset()
    config = spine_config("nc8")
    reference = Aggregator(GENERATION)
    reference.install(SpineSlots(config))
    engine.set_generation(GENERATION)
    engine.add_job(config)
    bound = 2 << config.window.span
    for rank, slot, version, lane, where, byte, cut in items:
        value = bound + 1 if lane == 2 else lane * bound
        payload = struct.pack("!qq", value, -value)
        good = uplink(job=9, rank=rank, slot=slot, offset=slot + 4 * version,
                      codes=payload, emin=config.window.e_min, pool=version, format=1,
                      count=2)  # fmt: skip
        datagram = bytearray(good[: len(good) - cut] if cut < 3 else good)
        if where < len(datagram):
            datagram[where] = byte
        source = (f"10.9.1.{rank + 1}", 5000 + rank)
        want = list(reference.handle(bytes(datagram), source))
        assert process(engine, bytes(datagram), source) == want, bytes(datagram).hex()
    assert engine.job_stats(9).to_json() == reference.jobs[9].stats.to_json()
    assert engine.global_stats().to_json() == reference.stats.to_json()


@pytest.mark.parametrize(
    ("uplink_format", "total", "reason"),
    [
        (2, 6, r"an uplink is nc8 \(0\) or int \(1\), not 2"),
        (1, 2, "2 total workers are fewer than its 3 members"),
        (1, 7, "a spine's 7 total workers must be a multiple of its 3 leaves"),
    ],
)  # fmt: skip
def test_spine_uplink_parameters_are_checked(
    engine: Engine, uplink_format: int, total: int, reason: str
) -> None:
    window = spine_config("int").window
    assert engine.lib.nce_job_add(9, 3, K, 4, window.e_min, window.span, 1, 0) == 0
    with pytest.raises(RuntimeError, match=reason):
        engine.check(engine.lib.nce_job_set_uplink(9, uplink_format, total), "uplink")
    with pytest.raises(RuntimeError, match="job 10 is not installed"):
        engine.check(engine.lib.nce_job_set_uplink(10, 1, 6), "uplink")
    # A window too wide for the total: the n partial sums could overflow 64 bits.
    assert engine.lib.nce_job_add(11, 3, K, 4, -52, 61, 1, 0) == 0
    with pytest.raises(RuntimeError, match="6 workers of values up to 2\\^61 overflow"):
        engine.check(engine.lib.nce_job_set_uplink(11, 1, 6), "uplink")


def test_a_window_whose_sums_overflow_64_bits_is_refused_by_job_add(engine: Engine) -> None:
    # Issue 27, minor: nce_job_add applies nce_job_set_uplink's check, so a one-level job too
    # cannot have workers whose codes sum past an int64 accumulator.
    with pytest.raises(RuntimeError, match="2 workers of values up to 2\\^62 overflow"):
        engine.check(engine.lib.nce_job_add(12, 2, K, 4, -52, 62, 0, 0), "job")
    with pytest.raises(RuntimeError, match="64 workers of values up to 2\\^57 overflow"):
        engine.check(engine.lib.nce_job_add(12, 64, K, 4, -47, 57, 0, 0), "job")
    assert engine.lib.nce_job_add(13, 1, K, 4, -52, 62, 0, 0) == 0  # one worker: 2^62 fits
    assert engine.lib.nce_job_add(14, 64, K, 4, -46, 56, 0, 0) == 0  # Window.for_job(64)


def test_int32_sums_at_the_window_s_extremes_are_bit_exact(engine: Engine) -> None:
    """An int32 job of 4 workers: window span 28 (30 - ceil(log2 4)), top code 29 (2^28 in
    units of 2^e_min). Every worker at the top code sums to 2^30 = 0x40000000, the most
    positive sum the admission allows, at minus the top code to -2^30 = 0xC0000000, the most
    negative; mixed codes sum exactly; the reference and the engine send the same bytes."""
    config = JobConfig.create(job=5, workers=4, k=4, result_format="int32", seed=1)
    assert (config.window.span, config.window.max_code, config.window.e_min) == (28, 29, -18)
    reference = Aggregator()
    reference.add_job(config)
    engine.add_job(config)
    sources = [(f"10.9.1.{rank + 1}", 5000 + rank) for rank in range(4)]
    codes = [[29, 0x80 | 29, 1, 0x80 | 3], [29, 0x80 | 29, 2, 0x80 | 3],
             [29, 0x80 | 29, 3, 0], [29, 0x80 | 29, 0, 0x80 | 1]]  # fmt: skip
    for rank in range(4):
        out = replay_one(engine, reference, uplink(job=5, rank=rank, slot=0, offset=0,
                                                   codes=codes[rank], emin=-18), sources[rank])
    assert [(d[2], d[16:].hex()) for d, _ in out] == [
        (Format.INT32, "40000000" "c0000000" "00000007" "fffffff7")] * 4  # 1+2+4; -4-4-1
    # A code above the window's top is dropped (bad_code) by both: no input overflows a lane.
    over = uplink(job=5, rank=0, slot=1, offset=1, codes=[30, 0, 0, 0], emin=-18)
    assert replay_one(engine, reference, over, sources[0]) == []
    assert engine.job_stats(5).drops["bad_code"] == 1


@pytest.mark.parametrize(
    ("workers", "total", "span", "refused"),
    [(4, None, 28, False), (4, None, 29, True), (3, None, 28, False), (3, None, 29, True),
     (1, None, 30, False), (1, None, 31, True), (2, 4, 28, False), (2, 4, 29, True),
     (2, None, 60, True)],
)  # fmt: skip
def test_int32_admission_refuses_what_the_reference_refuses(
    engine: Engine, workers: int, total: int | None, span: int, refused: bool
) -> None:
    """The overflow rule of int32 results (``nc8.int32_refusal``): N workers' codes up to
    2^span must sum within 2^30. ``JobConfig`` and the engine's ``nce_job_add`` (N: its
    workers) or ``nce_job_set_uplink`` (N: the total workers of a tree) refuse the same jobs
    with the same sentence, and accept the others."""
    n = total or workers
    window = nc8.Window(e_min=10 - span, span=span)
    sentence = nc8.int32_refusal(n, span)
    assert (sentence is not None) == refused
    try:
        JobConfig(job=9, workers=workers, k=K, result_format=Format.INT32, window=window,
                  total_workers=total)  # fmt: skip
        python_error = None
    except ValueError as exc:
        python_error = str(exc)
    rc = engine.lib.nce_job_add(9, workers, K, 4, window.e_min, span, int(Format.INT32), 0)
    if rc == 0:
        rc = engine.lib.nce_job_set_uplink(9, 0, n)
    c_error = engine.ffi.string(engine.lib.nce_error()).decode() if rc else None
    if refused:
        assert python_error == sentence
        assert c_error == f"job 9: {sentence}"
    else:
        # the window is the one JobConfig derives for int32, or only that check refuses it
        assert python_error is None or "is not the one docs/protocol.md derives" in python_error
        assert c_error is None


def test_a_hello_of_rank_65535_is_answered_offline(engine: Engine) -> None:
    # Issue 27, minor: the offline entry point's reply range is rank .. rank + 1 without a
    # 16-bit wrap at rank 65535 (which made a valid answer "does not fit").
    config = JobConfig.create(job=3, workers=2, k=64, result_format="nc8", seed=1)
    engine.add_job(config)
    reference = Aggregator()
    reference.add_job(config)
    hello = pack_job_datagram(job_descriptor(config), job=3, rank=0xFFFF)
    assert len(replay_one(engine, reference, hello, ("10.9.1.1", 5000))) == 1


def test_a_hello_between_two_steps_restarts_nothing(engine: Engine) -> None:
    # Issue 27, finding 4: a job whose slot completed a moment ago is in use (its workers are
    # between two steps, or one lost its result): a hello, a stranger's too, restarts nothing,
    # so the lost result is still resent and no learned rank can be taken over. Once the job
    # has been quiet for restart_idle (0 here), a hello restarts it: a new set of workers.
    config = JobConfig.create(job=3, workers=2, k=8, result_format="int", seed=1)
    engine.add_job(config)
    reference = Aggregator()
    reference.add_job(config)
    emin, sources, stranger = window_e_min(2), [("10.9.1.1", 5000), ("10.9.1.2", 5000)], (
        "10.9.1.66", 6000)
    def chunk(rank: int, **fields: Any) -> bytes:
        return uplink(job=3, rank=rank, slot=0, offset=0, codes=[1] * 8, emin=emin, **fields)
    hello = pack_job_datagram(job_descriptor(config), job=3, rank=1)
    for rank in range(2):
        replay_one(engine, reference, chunk(rank), sources[rank])
    assert len(replay_one(engine, reference, hello, stranger)) == 1  # answered
    (resent,) = replay_one(engine, reference, chunk(0, retx=True), sources[0])
    assert resent[1] == sources[0] and len(resent[0]) == 16 + 8 * 8  # the lost result, again
    assert replay_one(engine, reference, chunk(1), stranger) == []  # rank 1 is still its own
    drops = engine.job_stats(3).drops
    assert drops["non_member"] == 1 == reference.jobs[3].stats.drops["non_member"]
    engine.set_restart_idle(0)
    reference.restart_idle = 0
    replay_one(engine, reference, hello, stranger)  # quiet long enough: a new set of workers
    assert replay_one(engine, reference, chunk(1), stranger) == []  # learned, waits for rank 0
    assert engine.job_stats(3).contributions == 3 == reference.jobs[3].stats.contributions


def test_results_are_resent_in_a_burst_of_4_then_once_per_interval(engine: Engine) -> None:
    # Issue 27, finding 5: spoofed copies of a member's completed chunk made the member receive
    # a stored result (8 bytes an element for int) per copy, without limit; then 16 a round.
    # Issue 37: 40 spoofed retransmissions must make at most 4: rule 2 now sends a member one
    # round's result again RESEND_BURST times per slot version, then once per RESEND_INTERVAL.
    config = JobConfig.create(job=3, workers=2, k=8, result_format="int", seed=1)
    engine.add_job(config)
    reference = Aggregator()
    reference.add_job(config)
    emin, sources = window_e_min(2), [("10.9.1.1", 5000), ("10.9.1.2", 5000)]

    def chunk(rank: int, slot: int = 0, offset: int = 0, pool: int = 0) -> bytes:
        return uplink(job=3, rank=rank, slot=slot, offset=offset, codes=[1] * 8, emin=emin,
                      pool=pool, retx=True)  # fmt: skip

    for slot in (0, 1):
        for rank in range(2):
            replay_one(engine, reference, chunk(rank, slot, slot), sources[rank])
    # 40 copies within the interval (a test takes far less than its second): 4 answers.
    answered = [len(replay_one(engine, reference, chunk(0), sources[0])) for _ in range(40)]
    assert answered == [1] * RESEND_BURST + [0] * 36 and RESEND_BURST == 4
    # Another member, and another slot, have budgets of their own.
    assert all(replay_one(engine, reference, chunk(1), sources[1]) for _ in range(4))
    assert replay_one(engine, reference, chunk(0, 1, 1), sources[0])
    # The next round of the slot (its version 1, then version 0 again) starts a new burst.
    for pool, offset in ((1, 2), (0, 4)):
        for rank in range(2):
            replay_one(engine, reference, chunk(rank, 0, offset, pool), sources[rank])
        assert all(replay_one(engine, reference, chunk(0, 0, offset, pool), sources[0])
                   for _ in range(4))  # fmt: skip
        assert replay_one(engine, reference, chunk(0, 0, offset, pool), sources[0]) == []
    stats = engine.job_stats(3)
    assert stats.drops["resend_limit"] == 36 + 2 == reference.jobs[3].stats.drops["resend_limit"]
    assert stats.results_resent == 4 + 4 + 1 + 2 * 4
    # Once the interval has passed since the last, one more: a worker whose result was lost
    # five times in a row still gets it (never a stall for good, as with a fixed budget).
    engine.set_resend_interval(0)
    reference.resend_interval = 0
    try:
        assert all(replay_one(engine, reference, chunk(0, 0, 4), sources[0]) for _ in range(3))
    finally:
        engine.set_resend_interval(RESEND_INTERVAL)


def test_a_burst_spent_waits_for_the_resend_interval() -> None:
    now = [100.0]
    agg = Aggregator(clock=lambda: now[0])
    agg.add_job(JobConfig.create(job=3, workers=2, k=8, result_format="int", seed=1))
    emin, sources = window_e_min(2), [("10.9.1.1", 5000), ("10.9.1.2", 5000)]
    for rank in range(2):
        agg.handle(uplink(job=3, rank=rank, slot=0, offset=0, codes=[1] * 8, emin=emin),
                   sources[rank])  # fmt: skip
    retx = uplink(job=3, rank=0, slot=0, offset=0, codes=[1] * 8, emin=emin, retx=True)
    answered = []
    for at in (0, 0, 0, 0, 0, 0.5, 0.99, 1.0, 1.5, 1.99, 2.0, 2.0):
        now[0] = 100.0 + at
        answered.append(len(agg.handle(retx, sources[0])))
    assert answered == [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    assert RESEND_INTERVAL == 1.0


@pytest.mark.parametrize("key", [None, bytes(range(16))])
def test_a_stale_packet_of_any_length_gets_a_restart_notice_no_longer(
    engine: Engine, key: bytes | None
) -> None:
    # Issue 27, finding 5: a stale packet's source may be forged (an unlearned rank is accepted
    # from anywhere), so its answer must not be longer than it (no amplified reflection).
    # Issue 38: a chunk of 1-7 elements got no answer then and never learned of the restart;
    # now the answer is a restart notice, the header alone (and the tag).
    config = JobConfig.create(job=3, workers=2, k=8, result_format="int", seed=1, key=key)
    engine.add_job(config)
    engine.set_generation(GENERATION)
    reference = Aggregator(GENERATION)
    reference.add_job(config)
    stale = (GENERATION % 15 + 1) << 3
    tagged = FLAG_TAG if key is not None else 0
    for count in (1, 7, 8):
        datagram = uplink(job=3, rank=1, slot=0, offset=count, codes=[1] * count,
                          emin=window_e_min(2), flags=stale | tagged)  # fmt: skip
        if key is not None:
            datagram = tag.sign(key, datagram)
        ((notice, to),) = replay_one(engine, reference, datagram, ("10.9.1.66", 6000))
        assert to == ("10.9.1.66", 6000)
        assert len(notice) == HEADER.size + (TAG_SIZE if key else 0) < len(datagram)
        assert HEADER.unpack_from(notice) == (
            1, FLAG_RESULT | GENERATION << 3 | tagged, 1, window_e_min(2), 3, 1, 0, 0, count,
        )  # fmt: skip
    assert engine.job_stats(3).drops["stale_generation"] == 3


def test_reply_buffers_are_checked_before_any_write(engine: Engine) -> None:
    config = JobConfig.create(job=1, workers=2, k=64, result_format="int", seed=1)
    engine.add_job(config)
    ffi, lib = engine.ffi, engine.lib
    emin = window_e_min(2)
    stride = 16 + 64 * 8 - 1  # one byte short of a result
    out = ffi.new(f"uint8_t[{2 * stride + 8}]")  # a guard after the two buffers
    lens, ips, ports = ffi.new("uint32_t[2]"), ffi.new("uint32_t[2]"), ffi.new("uint16_t[2]")
    ip = bytes([10, 9, 1, 1])
    for rank in range(2):
        datagram = uplink(job=1, rank=rank, slot=0, offset=0, codes=[1] * 64, emin=emin)
        n = lib.nce_process_datagram(datagram, len(datagram), ip, 5000 + rank, ip, out, stride,
                                     2, lens, ips, ports)  # fmt: skip
    assert n == -1  # the slot completed, but its results do not fit
    assert bytes(ffi.buffer(out)[2 * stride :]) == bytes(8)
    assert engine.job_stats(1).slots_completed == 1  # the decision stands, counted


def test_a_job_whose_results_exceed_the_reply_room_is_refused(engine: Engine) -> None:
    engine.set_reply_room(16 + 100, "a 116-byte test buffer")
    try:
        with pytest.raises(RuntimeError, match="largest k for int results is 12"):
            engine.add_job(JobConfig.create(job=2, workers=2, k=13, result_format="int"))
        with pytest.raises(RuntimeError, match="largest k for nc8 results is 92"):
            engine.add_job(JobConfig.create(job=2, workers=2, k=100, result_format="nc8",
                                            key=bytes(16)))  # fmt: skip
        stats = engine.ffi.new("struct nce_counters *")
        assert engine.lib.nce_job_stats(2, stats) == -1  # removed, not left unkeyed
        engine.add_job(JobConfig.create(job=2, workers=2, k=12, result_format="int"))
    finally:
        engine.set_reply_room(0xFFFFFFFF, "no limit")
    assert engine.lib.nce_max_k() == MAX_K  # the C engine and JobConfig agree


def test_late_and_out_of_step_packets_like_the_reference(engine: Engine) -> None:
    """Rounds in SwitchML order (use u of slot u * S + slot, two slots' rounds interleaved) with
    noise: copies of earlier rounds' packets, the next round's, the wrong version, another count.
    Every slot rule of docs/protocol.md ("Late and duplicate packets") is taken, and the engine
    decides each datagram as the reference does."""
    import random

    workers, pool = 3, 2
    config = JobConfig.create(job=9, workers=workers, k=K, result_format="int", pool_size=pool)
    reference = Aggregator(GENERATION)
    reference.add_job(config)
    engine.set_generation(GENERATION)
    engine.add_job(config)
    sources = [(f"10.9.1.{rank + 1}", 5000 + rank) for rank in range(workers)]
    rnd = random.Random(11)

    def packet(rank: int, chunk: int, version: int, count: int = K) -> tuple[int, bytes]:
        slot, use = chunk % pool, chunk // pool
        codes = [rnd.randint(0, 9) for _ in range(count)]
        return rank, uplink(job=9, rank=rank, slot=slot, offset=(use * pool + slot) % 2**32,
                            codes=codes, emin=config.window.e_min, pool=version)  # fmt: skip

    traffic: list[tuple[int, bytes]] = []
    for pair in range(0, 200, 2):  # chunks `pair` and `pair + 1`: one round of each slot
        batch = [packet(r, c, c // pool & 1) for c in (pair, pair + 1) for r in range(workers)]
        for _ in range(rnd.randint(0, 4)):
            rank, chunk = rnd.randrange(workers), pair + rnd.randint(-6, 3)
            version = chunk // pool & 1 if rnd.random() < 0.8 else rnd.randint(0, 1)
            batch.append(packet(rank, max(chunk, 0), version, K if rnd.random() < 0.9 else 1))
        rnd.shuffle(batch)
        traffic += batch
    for rank, datagram in traffic:
        want = list(reference.handle(datagram, sources[rank]))
        assert process(engine, datagram, sources[rank]) == want, datagram[:16].hex()
    stats = reference.jobs[9].stats
    assert engine.job_stats(9).to_json() == stats.to_json()
    assert min(stats.drops["late"], stats.drops["chunk_mismatch"], stats.duplicates,
               stats.results_resent, stats.notices_sent, stats.slots_completed) > 0  # fmt: skip


def test_nc8_results_do_not_depend_on_arrival_order(engine: Engine) -> None:
    """One schedule and the same packets reordered (the packets of each pass over the pool
    permuted, so that its slots complete in another order): the engine and the reference send
    the same result bytes for every (rank, slot, version, offset) in both orders."""
    import random

    workers, pool = 3, 4
    config = JobConfig.create(job=9, workers=workers, k=K, result_format="nc8", seed=42,
                              pool_size=pool)  # fmt: skip
    sources = [(f"10.9.1.{rank + 1}", 5000 + rank) for rank in range(workers)]
    packets = schedule(9, workers, rounds=40, pool=pool, seed=7)
    # Permute each pass over the pool (the packets of `pool` consecutive chunks: one use of
    # every slot, in one version), so that its slots complete in another order.
    passes: dict[int, list[tuple[int, bytes]]] = {}
    for rank, datagram in packets:
        chunk = int.from_bytes(datagram[12:16], "big") // K
        passes.setdefault(chunk // pool, []).append((rank, datagram))
    rnd = random.Random(3)
    reordered = []
    for chunk_pass in passes.values():
        rnd.shuffle(chunk_pass)
        reordered += chunk_pass

    def results(feed: Any, order: list[tuple[int, bytes]]) -> dict[tuple[int, bytes], bytes]:
        out = {}
        for rank, datagram in order:
            for reply, _ in feed(datagram, sources[rank]):
                if reply[10:12] != bytes(2):  # a result (a notice has count 0)
                    out[reply[6:8] + reply[1:2] + reply[8:10] + reply[12:16]] = reply
        return out

    def engine_feed() -> Any:
        engine.lib.nce_reset()
        engine.add_job(config)
        return lambda datagram, source: process(engine, datagram, source)

    def reference_feed() -> Any:
        reference = Aggregator()
        reference.add_job(config)
        return reference.handle

    first = results(engine_feed(), packets)
    assert len(first) > 60
    assert results(engine_feed(), reordered) == first
    assert results(reference_feed(), reordered) == first
    assert results(reference_feed(), packets) == first


def test_nc8_rounding_is_fresh_at_every_use_of_a_chunk(engine: Engine) -> None:
    """A training job sends the same chunk (slot, version) step after step: its results' bits
    change with the slot version's use (and the offset, use u's sequence number u * S + slot),
    so each element's rounding is unbiased over the steps, not only over elements
    (docs/protocol.md, "Re-compression"). Engine and reference agree at every step."""
    import numpy as np
    from ncina.proto import nc8

    config = JobConfig.create(job=5, workers=2, k=K, result_format="nc8", seed=8, pool_size=1)
    engine.add_job(config)
    reference = Aggregator()
    reference.add_job(config)
    emin = window_e_min(2)
    halves = [[3, 5, 0x87, 20, 2, 0x83, 33, 9], [2, 5, 0x82, 19, 1, 0x81, 31, 9]]
    exact = np.sum([nc8.codes_to_int(np.array(c, np.uint8)) for c in halves], axis=0)
    steps = 1500
    values = []
    for step in range(steps):
        for rank, codes in enumerate(halves):
            datagram = uplink(job=5, rank=rank, slot=0, offset=step, codes=codes, emin=emin,
                              pool=step % 2)  # fmt: skip
            source = (f"10.9.1.{rank + 1}", 5000 + rank)
            got = process(engine, datagram, source)
            assert got == list(reference.handle(datagram, source))
        values.append(nc8.codes_to_int(np.frombuffer(got[0][0][16:], np.uint8)))
    mean = np.mean(values, axis=0)
    low = np.array([1 << (abs(s).bit_length() - 1) for s in exact.tolist()], np.float64)
    mag = np.abs(exact.astype(np.float64))
    var = (mag - low) * (2 * low - mag)
    assert np.count_nonzero(var) == 6  # elements 1 and 7 sum to powers of two
    assert np.array_equal(mean[var == 0], exact[var == 0])
    z = (mean[var > 0] - exact[var > 0]) / np.sqrt(var[var > 0] / steps)
    assert np.max(np.abs(z)) < 5.5, z


SPINE = ("10.9.2.1", 47000)
SPINE_GENERATION = 5


def leaf_pair(engine: Engine, result: str, key: bytes | None) -> LeafAggregator:
    """The same leaf twice: the reference (``hierarchy.LeafAggregator``, returned, its spine's
    generation set as its handshake would) and the engine's job 9, a leaf at rank 1 of
    ``SPINE`` with 2 of 4 workers."""
    config = JobConfig.create(job=9, workers=2, k=K, result_format=result, seed=42,
                              pool_size=4, key=key, total_workers=4)  # fmt: skip
    reference = LeafAggregator(Upstream(SPINE, 1), GENERATION)
    reference.add_leaf(config)
    reference.upstream.generation = SPINE_GENERATION
    engine.set_generation(GENERATION)
    engine.add_job(config)
    engine.set_upstream(9, reference)
    return reference


def spine_answers(rnd: random.Random, up: bytes, result: str, key: bytes | None) -> list[bytes]:
    """What a spine may send for the partial sum ``up``: its result (a random payload), maybe
    twice, maybe first for another offset, of another generation, a notice, a restart notice,
    a job datagram, or with one byte replaced or the end cut."""
    _, flags, _, emin, job, rank, slot, count, offset = struct.unpack_from("!BBBbHHHHI", up)
    fmt = Format[result.upper()]
    size = ELEMENT_SIZE[fmt]

    def make(flags: int, count: int, offset: int, payload: bytes) -> bytes:
        flags |= 0x80 if key is not None else 0
        d = struct.pack("!BBBbHHHHI", 1, flags, fmt, emin, job, rank, slot, count, offset)
        return tag.sign(key, d + payload) if key is not None else d + payload

    base = 0x01 | (flags & 0x04) | SPINE_GENERATION << 3
    good = make(base, count, offset, rnd.randbytes(count * size))
    out = []
    what = rnd.randrange(8)
    if what == 0:
        out.append(make(base, count, offset + 1, rnd.randbytes(count * size)))  # another offset
    elif what == 1:
        out.append(make(base & ~0x78 | 6 << 3, count, offset, rnd.randbytes(count * size)))
    elif what == 2:
        out.append(make(base, 0, offset, bytes(8)))  # a notice
    elif what == 5:  # a restart notice (the header alone): of another generation, or not
        generation = 6 if offset % 2 else SPINE_GENERATION  # (no draw: the stream stays)
        out.append(make(base & ~0x78 | generation << 3, 0, offset, b""))
    elif what == 3:
        bad = bytearray(good)
        bad[rnd.randrange(len(bad))] = rnd.randrange(256)
        out.append(bytes(bad[: len(bad) - rnd.choice((0, 0, 1, 9))]))
    elif what == 4:
        hello = pack_job_datagram(Descriptor(mode=fmt, workers=2, pool_size=4, k=K, e_max=10,
                                             e_min=emin, keyed=key is not None, compressor=0,
                                             uplink=UPLINK_INT), job=job, rank=rank, key=key)
        out.append(hello)
    out.append(good)
    if rnd.random() < 0.3:
        out.append(good)  # a duplicate: late
    return out


@pytest.mark.parametrize("keyed", [False, True], ids=["untagged", "keyed"])
@pytest.mark.parametrize("result", ["int", "nc8", "int32"])
def test_hierarchical_c_leaf_datagram_for_datagram_like_the_reference(
    engine: Engine, result: str, keyed: bool
) -> None:
    """A leaf's job (``Engine.set_upstream``) against ``hierarchy.LeafAggregator``: the workers'
    codes (duplicates, retransmissions while the slot waits and after), the exact partial sums
    going up (RETX again), the spine's results (late, duplicated, for another offset, of
    another generation, notices, job datagrams, mangled) and the workers' hellos (a new set of
    workers restarts the leaf and its hello goes up): replies, destinations and every counter
    equal."""
    key = KEY if keyed else None
    reference = leaf_pair(engine, result, key)
    reference.restart_idle = 0  # a hello restarts whenever no round is partly filled
    engine.set_restart_idle(0)
    # int32's results are shorter, so its draws differ: a seed whose run has every event
    rnd = random.Random(17 if result == "int32" else 15)
    assert reference.leaf is not None
    emin = reference.leaf.config.window.e_min
    sources = [(f"10.9.1.{rank + 1}", 5000 + rank) for rank in range(2)]
    hello = pack_job_datagram(job_descriptor(reference.leaf.config), job=9, rank=0, key=key)

    def both(datagram: bytes, source: tuple[str, int]) -> list[tuple[bytes, Any]]:
        return replay_one(engine, reference, datagram, source)

    pending: list[bytes] = []
    ups = 0
    for chunk in range(60):
        slot, version = chunk % 4, (chunk // 4) % 2
        count = rnd.randint(1, K)
        packets = []
        for rank in range(2):
            codes = bytes(rnd.choice((0, 0x80)) | rnd.randint(0, 8) for _ in range(count))
            flags = (0x04 if version else 0) | (0x80 if keyed else 0)
            d = struct.pack("!BBBbHHHHI", 1, flags, 0, emin, 9, rank, slot, count, chunk * K)
            packets.append((rank, tag.sign(key, d + codes) if key else d + codes))
        packets += [p for p in packets if rnd.random() < 0.2]
        rnd.shuffle(packets)
        for rank, datagram in packets:
            for out, to in both(datagram, sources[rank]):
                if to == SPINE:
                    ups += 1
                    pending += spine_answers(rnd, out, result, key)
        if rnd.random() < 0.3:  # a worker retransmits while the slot waits (or after)
            rank, datagram = packets[0]
            retx = bytearray(datagram[:16])
            retx[1] |= 0x02
            body = bytes(retx) + datagram[16 : len(datagram) - (8 if keyed else 0)]
            both(tag.sign(key, body) if key else body, sources[rank])
        rnd.shuffle(pending)
        while pending and rnd.random() < 0.7:
            both(pending.pop(), SPINE)
        if rnd.random() < 0.1:  # a hello: restarts the leaf if it is idle
            both(hello, sources[rnd.randrange(2)])
    for datagram in pending:
        both(datagram, SPINE)
    up = reference.upstream.stats.to_json()
    assert ups > 60 and up["results"] > 20 and up["late"] and up["resent"] and up["hellos"]
    assert engine.upstream_stats().to_json() == up
    assert engine.job_stats(9).to_json() == reference.jobs[9].stats.to_json()
    assert engine.global_stats().to_json() == reference.stats.to_json()


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
def test_a_new_set_of_workers_starts_at_once_and_shuts_the_last_one_out(
    engine: Engine, keyed: bool
) -> None:
    # Issue 38, case 8: a new client of a rank (another incarnation nonce in its hello) starts
    # the job afresh at once, not after --restart-idle (an hour here); a retransmitted hello
    # (the same nonce) or a probe restarts nothing; the last set's late datagrams are
    # non_member, never a contribution; a hello from another host, or without the key, resets
    # nothing. Before the nonce, the second set's chunks were late and its sums never came.
    key = KEY if keyed else None
    config = JobConfig.create(job=3, workers=2, k=8, result_format="int", seed=1, key=key)
    engine.add_job(config)
    engine.set_restart_idle(3600)
    reference = Aggregator(restart_idle=3600)
    reference.add_job(config)
    emin, mine = window_e_min(2), job_descriptor(config)
    first = [("10.9.1.1", 5000), ("10.9.1.2", 5000)]
    second = [("10.9.1.1", 5001), ("10.9.1.2", 5001)]  # the same hosts, new ports

    def chunk(rank: int, slot: int, value: int, retx: bool = False) -> bytes:
        flags = (FLAG_TAG if key else 0) | (FLAG_RETX if retx else 0)
        datagram = uplink(job=3, rank=rank, slot=slot, offset=slot, codes=[value] * 8, emin=emin,
                          flags=flags)  # fmt: skip
        return tag.sign(key, datagram) if key else datagram

    def hello(rank: int, nonce: int, **fields: Any) -> bytes:
        return pack_job_datagram(mine, job=3, rank=rank, nonce=nonce, key=key, **fields)

    def result(replies: list[tuple[bytes, Any]]) -> list[int]:
        (datagram, _), *_ = replies
        return list(struct.unpack_from(">8q", datagram, 16))

    for rank in range(2):
        replay_one(engine, reference, hello(rank, 11 + rank), first[rank])
    replay_one(engine, reference, chunk(0, 0, 3), first[0])  # 2^2 + 2^1: exact int sums
    replay_one(engine, reference, hello(1, 12), first[1])  # rank 1's hello again: no restart
    assert result(replay_one(engine, reference, chunk(1, 0, 2), first[1])) == [6] * 8
    replay_one(engine, reference, chunk(0, 1, 1), first[0])
    replay_one(engine, reference, hello(0, 99, probe=True), first[0])  # a probe: nothing
    assert result(replay_one(engine, reference, chunk(1, 1, 1), first[1])) == [2] * 8
    replay_one(engine, reference, hello(0, 77), ("10.9.1.66", 6000))  # another host: nothing
    if keyed:  # an unkeyed hello to a keyed job: not authentic, nothing
        replay_one(engine, reference, pack_job_datagram(mine, job=3, rank=0, nonce=21), second[0])
    assert reference.jobs[3].members == first
    # The second set: rank 0's new client says hello (nonce 21), the job starts afresh.
    replay_one(engine, reference, hello(0, 21), second[0])
    assert replay_one(engine, reference, chunk(0, 0, 3), second[0]) == []
    assert replay_one(engine, reference, chunk(1, 0, 3, retx=True), first[1]) == []  # late: old set
    replay_one(engine, reference, hello(1, 22), second[1])
    assert replay_one(engine, reference, chunk(1, 0, 1), first[1]) == []  # old port: not its
    assert result(replay_one(engine, reference, chunk(1, 0, 1), second[1])) == [5] * 8
    drops = engine.job_stats(3).drops
    assert drops["non_member"] == 2 == reference.jobs[3].stats.drops["non_member"]
    assert engine.job_stats(3).contributions == 6 == reference.jobs[3].stats.contributions
