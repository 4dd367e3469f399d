"""The aggregator's logic without sockets: JobConfig, the slot state machine, drops, counters.

Packets are crafted with the scapy layer (``ncina_testlib.uplink``); sums are checked against
code values computed in the tests (``ncina_testlib.code_values``), not by the codec.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ncina.aggregator import cli as aggregator_cli
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.backends.python.slots import JobSlots
from ncina.aggregator.jobs import JobConfig, parse_member
from ncina.aggregator.stats import (
    GLOBAL_DROP_REASONS,
    JOB_DROP_REASONS,
    GlobalStats,
    JobStats,
    LimitStats,
)
from ncina.proto.header import FLAG_POOL, FLAG_RESULT, FLAG_TAG, INT_DTYPE, Format, pack
from ncina_testlib import code_values, dissect, exact_sums, is_nc8_rounding, uplink

from ncina.cli import build_parser
from ncina.common.address import parse_address

JOB = 9
K = 8
POOL = 4
DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def address(rank: int) -> tuple[str, int]:
    return (f"10.0.0.{rank + 1}", 5000 + rank)


class Harness:
    """One aggregator with one job, and workers that send from ``address(rank)``."""

    def __init__(self, workers: int, result: str, *, seed: int = 1, **options: Any) -> None:
        self.config = JobConfig.create(
            job=JOB, workers=workers, k=K, result_format=result, pool_size=POOL, seed=seed,
            **options,
        )  # fmt: skip
        self.aggregator = Aggregator()
        self.slots = self.aggregator.add_job(self.config)
        self.emin = self.config.window.e_min

    def packet(self, rank: int, slot: int, codes: list[int], **fields: Any) -> bytes:
        fields = {"job": JOB, "emin": self.emin, "offset": 1000 * slot, **fields}
        return uplink(rank=rank, slot=slot, codes=codes, **fields)

    def send(
        self, rank: int, slot: int, codes: list[int], *, source: tuple[str, int] | None = None,
        **fields: Any,
    ) -> list[tuple[bytes, tuple[str, int]]]:  # fmt: skip
        datagram = self.packet(rank, slot, codes, **fields)
        return list(self.aggregator.handle(datagram, source or address(rank)))

    def reduce(
        self, slot: int, codes: list[list[int]], **fields: Any
    ) -> list[tuple[bytes, tuple[str, int]]]:
        """Every rank sends its codes for ``slot``; returns what the last packet produced."""
        for rank, c in enumerate(codes[:-1]):
            assert self.send(rank, slot, c, **fields) == []
        return self.send(len(codes) - 1, slot, codes[-1], **fields)

    def job_stats(self) -> dict[str, Any]:
        return self.slots.stats.to_json()

    def global_stats(self) -> dict[str, Any]:
        return self.aggregator.stats.to_json()


def random_codes(rng: np.random.Generator, workers: int, count: int, top: int) -> list[list[int]]:
    """Valid uplink codes (exponent code 0..top, both signs) for every worker."""
    exps = rng.integers(0, top + 1, size=(workers, count))
    signs = rng.integers(0, 2, size=(workers, count)) * 0x80
    return [[int(e | s) if e else 0 for e, s in zip(er, sr, strict=True)] for er, sr in
            zip(exps, signs, strict=True)]  # fmt: skip


def check_results(
    h: Harness,
    out: list[tuple[bytes, tuple[str, int]]],
    *,
    slot: int,
    pool: int,
    offset: int,
    exact: list[int],
    ranks: list[int] | None = None,
) -> list[bytes]:
    """Every result datagram is the documented one for its rank; returns the payloads."""
    ranks = list(range(h.config.workers)) if ranks is None else ranks
    assert [destination for _, destination in out] == [address(r) for r in ranks]
    payloads = []
    for (datagram, _), rank in zip(out, ranks, strict=True):
        fields, payload = dissect(datagram)
        assert fields == {
            "version": 1,
            "flags": FLAG_RESULT | (FLAG_POOL if pool else 0),
            "format": int(h.config.result_format),
            "emin": h.emin,
            "job": JOB,
            "rank": rank,
            "slot": slot,
            "count": len(exact),
            "offset": offset,
        }
        if h.config.result_format == Format.INT:
            assert np.frombuffer(payload, dtype=INT_DTYPE).tolist() == exact
        else:
            assert len(payload) == len(exact)
            assert all(is_nc8_rounding(c, s) for c, s in zip(payload, exact, strict=True)), (
                list(payload), exact)  # fmt: skip
        payloads.append(payload)
    assert len(set(payloads)) == 1, "every member gets the same result"
    return payloads


# --- reduction --------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
@pytest.mark.parametrize("result", ["int", "nc8"])
@pytest.mark.parametrize("pool", [0, 1])
def test_reduction_sums_every_worker_once_and_answers_every_member(
    workers: int, result: str, pool: int
) -> None:
    h = Harness(workers, result)
    codes = random_codes(np.random.default_rng(workers), workers, K, h.config.window.max_code)
    out = h.reduce(2, codes, pool=pool)
    check_results(h, out, slot=2, pool=pool, offset=2000, exact=exact_sums(codes))
    stats = h.job_stats()
    assert stats["contributions"] == workers and stats["slots_completed"] == 1
    assert stats["results_sent"] == stats["packets_out"] == workers
    assert stats["packets_in"] == workers
    assert stats["bytes_out"] == workers * (16 + K * (8 if result == "int" else 1))


def test_int_result_is_the_exact_sum_at_the_edges_of_the_window() -> None:
    """Three workers at the top code of both signs: |sum| reaches 3 * 2**span, no overflow."""
    h = Harness(3, "int")
    top = h.config.window.max_code
    assert top == 61  # span = 62 - ceil(log2 3) = 60
    codes = [[top, top | 0x80, top, 1, 0x81, 0, top, top | 0x80]] * 3
    out = h.reduce(0, codes)
    exact = exact_sums(codes)
    assert exact[0] == 3 << 60 and exact[1] == -(3 << 60)
    check_results(h, out, slot=0, pool=0, offset=0, exact=exact)


def test_nc8_result_of_the_largest_sum_is_code_64_at_most() -> None:
    h = Harness(2, "nc8")
    top = h.config.window.max_code  # 62 for two workers: the sum is 2**62
    out = h.reduce(1, [[top] * K, [top] * K])
    assert list(dissect(out[0][0])[1]) == [63] * K  # 2**62 is a power of two: exact, code h + 1


def test_short_chunk_uses_count_elements() -> None:
    h = Harness(2, "int")
    codes = [[3, 4, 0x85], [1, 0, 2]]
    out = h.reduce(3, codes, offset=77)
    check_results(h, out, slot=3, pool=0, offset=77, exact=exact_sums(codes))


def test_nc8_results_are_seeded() -> None:
    """The same seed gives the same roundings; another seed other ones. Each inexact sum (not a
    power of two) rounds up with p = |S| / 2^h - 1, so two independent seeds agree on it with
    probability p^2 + (1 - p)^2; over these slots all agree with probability below 1e-6 (the
    product, computed from the exact sums), so equal results under seeds 7 and 8 mean a
    rounding that ignores the seed. Every result is one of the two roundings of its sum."""
    rng = np.random.default_rng(5)
    slots = [(i % POOL, random_codes(rng, 3, K, 3)) for i in range(8)]
    agree = 1.0
    for _, codes in slots:
        for total in map(abs, exact_sums(codes)):
            if total & (total - 1):  # not 0 and not a power of two: rounded at random
                p = total / (1 << (total.bit_length() - 1)) - 1
                agree *= p * p + (1 - p) * (1 - p)
    assert agree < 1e-6

    def results(seed: int) -> list[bytes]:
        h = Harness(3, "nc8", seed=seed)
        got = [h.reduce(slot, codes, pool=(i // POOL) % 2, offset=i)[0][0]
               for i, (slot, codes) in enumerate(slots)]  # fmt: skip
        for out, (_, codes) in zip(got, slots, strict=True):
            assert all(map(is_nc8_rounding, dissect(out)[1], exact_sums(codes)))
        return got

    first, again, other = results(7), results(7), results(8)
    assert first == again
    assert first != other


def test_nc8_result_is_unbiased_rounding_of_the_sum() -> None:
    """Many slots with the sum 3 (2 + 1): code 2 (value 2) or 3 (value 4), 4 with p = 1/2."""
    h = Harness(2, "nc8", seed=3)
    ups = 0
    rounds = 200
    for i in range(rounds):
        slot, pool = i % POOL, (i // POOL) % 2
        out = h.reduce(slot, [[2] * K, [1] * K], pool=pool, offset=i)
        codes = list(dissect(out[0][0])[1])
        assert set(codes) <= {2, 3}
        ups += codes.count(3)
    # Binomial(1600, 1/2): mean 800, sd 20; a +-6 sd band never fails by chance in practice.
    assert abs(ups - rounds * K / 2) < 6 * 20


# --- slots, versions and loss recovery --------------------------------------------------------


def test_duplicate_before_completion_is_ignored() -> None:
    h = Harness(3, "int")
    codes = [[1] * K, [2] * K, [3] * K]
    assert h.send(0, 1, codes[0]) == []
    assert h.send(0, 1, codes[0]) == []
    assert h.send(0, 1, codes[0], retx=True) == []
    assert h.send(1, 1, codes[1]) == []
    out = h.send(2, 1, codes[2])
    check_results(h, out, slot=1, pool=0, offset=1000, exact=exact_sums(codes))
    stats = h.job_stats()
    assert stats["duplicates"] == 2 and stats["retx_seen"] == 1 and stats["contributions"] == 3


def test_retransmission_after_completion_gets_the_stored_result_unicast() -> None:
    h = Harness(3, "nc8")
    codes = random_codes(np.random.default_rng(1), 3, K, 50)
    first = h.reduce(2, codes)
    again = h.send(1, 2, codes[1], retx=True)
    assert again == [first[1]]  # identical bytes, to that worker only
    stats = h.job_stats()
    assert stats["results_resent"] == 1 and stats["slots_completed"] == 1
    assert stats["packets_out"] == 4


def test_both_versions_and_slot_reuse_overwrite_the_previous_use() -> None:
    h = Harness(2, "int")
    rng = np.random.default_rng(2)
    for use in range(5):  # versions 0, 1, 0, 1, 0 of slot 3
        codes = random_codes(rng, 2, K, 30)
        out = h.reduce(3, codes, pool=use % 2, offset=use * K)
        check_results(h, out, slot=3, pool=use % 2, offset=use * K, exact=exact_sums(codes))
    assert h.job_stats()["slots_completed"] == 5


def test_retransmission_for_the_previous_version_is_answered_from_its_store() -> None:
    """Rank 1 lost the result of (slot 0, version 0) while rank 0 moved on to version 1."""
    h = Harness(2, "int")
    old = [[5] * K, [6] * K]
    first = h.reduce(0, old, pool=0, offset=0)
    new = [[7] * K, [8] * K]
    assert h.send(0, 0, new[0], pool=1, offset=K) == []  # rank 0 is ahead, on version 1
    again = h.send(1, 0, old[1], pool=0, offset=0, retx=True)  # rank 1 still on version 0
    assert again == [first[1]]
    out = h.send(1, 0, new[1], pool=1, offset=K)
    check_results(h, out, slot=0, pool=1, offset=K, exact=exact_sums(new))
    # Both moved on: the next use of version 0 starts afresh (overwrite, not add).
    newest = [[1] * K, [1] * K]
    out = h.reduce(0, newest, pool=0, offset=2 * K)
    check_results(h, out, slot=0, pool=0, offset=2 * K, exact=exact_sums(newest))


def test_slots_are_independent() -> None:
    h = Harness(2, "int")
    a = [[1] * K, [2] * K]
    b = [[3] * K, [4] * K]
    assert h.send(0, 0, a[0]) == []
    assert h.send(0, 1, b[0]) == []
    check_results(h, h.send(1, 1, b[1]), slot=1, pool=0, offset=1000, exact=exact_sums(b))
    check_results(h, h.send(1, 0, a[1]), slot=0, pool=0, offset=0, exact=exact_sums(a))


@pytest.mark.parametrize("change", [{"offset": 2001}, {"count": K - 1}])
def test_chunk_mismatch_is_dropped_and_changes_nothing(change: dict[str, int]) -> None:
    h = Harness(2, "int")
    codes = [[1] * K, [2] * K]
    assert h.send(0, 2, codes[0]) == []
    bad = codes[1][: change.get("count", K)]
    assert h.send(1, 2, bad, offset=change.get("offset", 2000)) == []
    assert h.job_stats()["drops"]["chunk_mismatch"] == 1
    check_results(h, h.send(1, 2, codes[1]), slot=2, pool=0, offset=2000, exact=exact_sums(codes))


def test_members_are_learned_and_then_fixed() -> None:
    h = Harness(2, "int")
    assert h.send(0, 0, [1] * K) == []
    assert h.send(1, 1, [1] * K, source=("10.9.9.9", 1)) == []  # rank 1's first valid packet
    assert h.send(0, 2, [1] * K, source=("10.9.9.9", 2)) == []  # rank 0 is at address(0)
    assert h.job_stats()["drops"]["non_member"] == 1
    assert h.slots.members == [address(0), ("10.9.9.9", 1)]


def test_configured_members_receive_the_results() -> None:
    h = Harness(2, "int", members=[(1, ("192.168.0.2", 7000))])
    assert h.send(1, 0, [1] * K) == []  # from address(1): not rank 1's configured address
    assert h.job_stats()["drops"]["non_member"] == 1
    assert h.send(0, 0, [1] * K) == []
    out = h.send(1, 0, [1] * K, source=("192.168.0.2", 7000))
    assert [destination for _, destination in out] == [address(0), ("192.168.0.2", 7000)]


# --- drops ------------------------------------------------------------------------------------

# (reason, section the drop is counted in, how to make the packet: fields for Harness.packet, or
# raw bytes; an optional source address).
DROPS: list[tuple[str, str, dict[str, Any]]] = [
    ("truncated", "global", {"raw": b"\x01\x00\x00"}),
    ("truncated", "global", {"raw": b""}),
    ("bad_version", "global", {"version": 2}),
    ("bad_version", "global", {"version": 0, "job": 12345}),
    ("bad_flags", "job", {"flags": 0x08}),
    ("bad_flags", "job", {"flags": FLAG_RESULT}),
    ("bad_tag", "job", {"flags": FLAG_TAG, "count": K, "codes": [1] * (K + 8)}),  # untagged job
    ("bad_length", "global", {"flags": FLAG_TAG, "job": 12345}),  # no room for the tag
    ("bad_format", "job", {"format": Format.INT, "count": K, "codes": [0] * (8 * K)}),
    ("bad_format", "job", {"format": 7}),
    ("bad_count", "job", {"count": 0, "codes": []}),
    ("bad_count", "job", {"count": K + 1, "codes": [1] * (K + 1)}),
    ("bad_length", "job", {"count": K - 1}),
    ("bad_length", "job", {"count": K, "codes": [1] * (K + 3)}),
    ("unknown_job", "global", {"job": JOB + 1}),
    ("non_member", "job", {"rank": 2}),
    ("non_member", "job", {"rank": 0xFFFF}),
    ("non_member", "job", {"source": address(1)}),  # rank 0 (learned) from rank 1's address
    ("window_mismatch", "job", {"emin": -49}),
    ("bad_slot", "job", {"slot": POOL}),
    ("bad_slot", "job", {"slot": 0xFFFF}),
    ("bad_code", "job", {"codes": [1] * (K - 1) + [63]}),  # top code for 2 workers is 62
    ("bad_code", "job", {"codes": [0xBF] + [1] * (K - 1)}),  # negative, code 63
    ("bad_code", "job", {"codes": [0x7F] * K}),
    ("chunk_mismatch", "job", {"offset": 1001}),  # after the held round: not late
    ("late", "job", {"offset": 5}),  # before it
]


@pytest.mark.parametrize("result", ["int", "nc8"])
@pytest.mark.parametrize("reason,section,how", DROPS, ids=[f"{r}-{i}" for i, (r, _, _) in
                                                          enumerate(DROPS)])  # fmt: skip
def test_every_drop_is_counted_once_and_changes_nothing(
    reason: str, section: str, how: dict[str, Any], result: str
) -> None:
    h = Harness(2, result)
    codes = [[3] * K, [0x82] * K]
    assert h.send(0, 1, codes[0]) == []  # learns rank 0; slot 1 holds offset 1000
    before_job, before_global = h.job_stats(), h.global_stats()
    how = dict(how)
    source = how.pop("source", address(0))
    raw = how.pop("raw", None)
    if raw is None:
        how.setdefault("rank", 0)
        how.setdefault("slot", 1)
        how.setdefault("codes", [1] * K)
        datagram = h.packet(how.pop("rank"), how.pop("slot"), how.pop("codes"), **how)
    else:
        datagram = raw
    assert list(h.aggregator.handle(datagram, source)) == []
    after_job, after_global = h.job_stats(), h.global_stats()
    counted, other = (after_job, after_global) if section == "job" else (after_global, after_job)
    counted_before = before_job if section == "job" else before_global
    assert other == (before_global if section == "job" else before_job)
    assert counted["drops"][reason] == counted_before["drops"][reason] + 1
    assert sum(counted["drops"].values()) == sum(counted_before["drops"].values()) + 1
    assert counted["packets_in"] == counted_before["packets_in"] + 1
    assert counted["bytes_in"] == counted_before["bytes_in"] + len(datagram)
    # The slot is untouched: rank 1 completes it with the expected sum.
    out = h.send(1, 1, codes[1])
    if result == "int":
        check_results(h, out, slot=1, pool=0, offset=1000, exact=exact_sums(codes))
    else:
        assert len(out) == 2


def test_drop_reasons_are_the_documented_counters() -> None:
    """The key sets of the stats document are the ones docs/protocol.md lists."""
    section = DOCS.read_text().split("## Counters", 1)[1]
    documented = set(re.findall(r"`([a-z_0-9]+)`", section))
    keys = set(JobStats().to_json()) | set(GlobalStats().to_json())
    keys |= set(JOB_DROP_REASONS) | set(GLOBAL_DROP_REASONS)
    keys |= set(LimitStats().to_json())
    keys |= {"schema", "backend", "started", "time", "global", "jobs", "drops", "limits"}
    assert keys <= documented, keys - documented
    # stale_generation is answered with a notice: tests/test_failures.py; bad_payload is
    # server mode's: tests/test_server_mode.py; resend_limit: tests/test_engine.py
    assert set(JOB_DROP_REASONS) | set(GLOBAL_DROP_REASONS) == {r for r, _, _ in DROPS} | {
        "internal_error", "stale_generation", "bad_payload", "resend_limit"
    }


# --- robustness: whatever arrives is counted exactly once and never raises ----------------------


def accounted(h: Harness) -> int:
    """Packets the counters account for, by the identity every datagram satisfies."""
    j, g = h.job_stats(), h.global_stats()
    job_in = j["contributions"] + j["duplicates"] + j["results_resent"] + sum(j["drops"].values())
    assert j["packets_in"] == job_in
    assert g["packets_in"] == sum(g["drops"].values())
    return j["packets_in"] + g["packets_in"]


def valid_datagram(rank: int, slot: int, pool: int, codes: bytes, emin: int) -> bytes:
    return pack(job=JOB, rank=rank, slot=slot, offset=slot, count=len(codes), emin=emin,
                flags=FLAG_POOL if pool else 0, payload=codes)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.tuples(
                st.integers(0, 3), st.integers(0, POOL), st.integers(0, 1),
                st.binary(min_size=1, max_size=K), st.integers(0, 40), st.integers(0, 255),
            ),
        ),
        max_size=40,
    )
)
def test_fuzz_never_raises_and_counts_every_datagram(items: list[Any]) -> None:
    h = Harness(3, "nc8")
    for n, item in enumerate(items, start=1):
        if isinstance(item, bytes):
            datagram = item
            rank = 0
        else:  # a mostly valid packet with one byte possibly replaced
            rank, slot, pool, codes, where, byte = item
            good = valid_datagram(rank, slot, pool, codes, h.emin)
            datagram = bytearray(good)
            if where < len(datagram):
                datagram[where] = byte
        out = h.aggregator.handle(bytes(datagram), address(rank % 3))
        for result, destination in out:
            fields, payload = dissect(result)
            assert fields["flags"] & FLAG_RESULT and destination in {address(r) for r in range(3)}
            assert all(c & 0x7F <= 64 for c in payload)
        assert accounted(h) == n


def test_code_values_helper_matches_the_protocol() -> None:
    assert code_values([0, 0x80, 1, 0x81, 3, 0x83, 62]) == [0, 0, 1, -1, 4, -4, 1 << 61]


# --- JobConfig and address parsing -------------------------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        ({"workers": 0}, "workers must be in 1..64"),
        ({"workers": 65}, "workers must be in 1..64"),
        ({"k": 0}, r"k \(elements per packet\) must be in 1..9172"),
        ({"k": 9173}, r"k \(elements per packet\) must be in 1..9172"),
        ({"pool_size": 0}, "pool size must be in 1..65535"),
        ({"pool_size": 65536}, "pool size must be in 1..65535"),
        ({"job": 65536}, "job id must be in 0..65535"),
        ({"window_max": 200}, "no exponent window with e_max 200"),
        ({"result_format": "float"}, "unknown result format 'float'"),
        ({"members": [(2, ("1.2.3.4", 5))]}, "member rank 2 is out of range"),
        ({"members": [(0, ("1.2.3.4", 5)), (0, ("1.2.3.4", 6))]}, "rank 0 is given twice"),
    ],
)
def test_job_config_rejects_with_a_clear_message(options: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"job": 1, "workers": 2, "k": 64, "result_format": "nc8"}
    arguments.update(options)
    with pytest.raises(ValueError, match=message):
        JobConfig.create(**arguments)


def test_job_config_window_follows_the_protocol() -> None:
    config = JobConfig.create(job=1, workers=4, k=64, result_format=Format.NC8)
    assert (config.window.e_min, config.window.e_max, config.window.max_code) == (-50, 10, 61)
    assert config.members == {} and config.pool_size == 64


@pytest.mark.parametrize(
    "result,k,mtu,largest",
    [("int", 183, 1500, 182), ("int", 100, 800, 94), ("nc8", 1024, 1000, 956)],
)
def test_result_frame_must_fit_the_mtu(result: str, k: int, mtu: int, largest: int) -> None:
    config = JobConfig.create(job=1, workers=2, k=k, result_format=result)
    message = f"largest k for {result} results at this MTU is {largest}"
    with pytest.raises(ValueError, match=message):
        config.check_mtu(mtu)
    JobConfig.create(job=1, workers=2, k=largest, result_format=result).check_mtu(mtu)


def test_addresses_and_members_parse() -> None:
    assert parse_address("127.0.0.1:47000") == ("127.0.0.1", 47000)
    assert parse_address("localhost:0") == ("127.0.0.1", 0)
    assert parse_member("3=10.0.0.4:5000") == (3, ("10.0.0.4", 5000))
    for bad in ("10.0.0.1", "10.0.0.1:x", ":5", "10.0.0.1:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)
    for bad in ("10.0.0.1:5", "x=10.0.0.1:5", "-1=10.0.0.1:5", "0=10.0.0.1:0"):
        with pytest.raises(ValueError):
            parse_member(bad)


def test_job_slots_keep_their_own_stats_and_jobs_are_unique() -> None:
    config = JobConfig.create(job=3, workers=1, k=4, result_format="int")
    aggregator = Aggregator()
    slots = aggregator.add_job(config)
    assert isinstance(slots, JobSlots) and aggregator.jobs == {3: slots}
    with pytest.raises(ValueError, match="job 3 is already installed"):
        aggregator.add_job(config)


@pytest.mark.parametrize(
    ("options", "k"),
    [
        ([], 1456),  # NC8 both ways at MTU 1500: 1500 - 20 - 8 - 16
        (["--mtu", "9000"], 8956),
        (["--result", "int"], 182),
        (["--key-file", "KEY"], 1448),  # the tag's 8 bytes
        (["--k", "300"], 300),
        (["--mode", "server", "--compressor", "qsgd"], 949),  # its largest payload fits
    ],
)
def test_k_defaults_to_the_largest_that_fits_the_mtu(
    tmp_path: Path, options: list[str], k: int
) -> None:
    key = tmp_path / "job.key"
    key.write_text(bytes(range(16)).hex())
    options = [str(key) if o == "KEY" else o for o in options]
    if "--mode" not in options and "--result" not in options:
        options += ["--result", "nc8"]
    args = build_parser().parse_args(["aggregator", "--job", "1", "--workers", "2", *options])
    assert aggregator_cli.job_config(args)[0].k == k


@pytest.mark.parametrize("mtu", ["67", "9217", "jumbo"])
def test_mtu_out_of_range_is_a_usage_error(mtu: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["aggregator", "--job", "1", "--workers", "2", "--mtu", mtu])
    assert "argument --mtu" in capsys.readouterr().err
