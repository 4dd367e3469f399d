"""Loss, duplication and reordering: the aggregator's seeded fault knobs, and recovery through them.

Unit tests pin down what each knob does to the datagrams around a handler. End to end, four
workers all-reduce through an aggregator that drops 1-10 % of the datagrams on the way in, on the
way out or both (or duplicates and reorders them): with ``int`` results (exact sums) the outcome
must be bit-identical to a lossless run with the same inputs and client seeds, and the losses must
show up as retransmissions; with ``nc8`` results too, since the re-compression's random bits are
a hash of the seed and the chunk, not of the completion order that loss changes (each element one
of the two powers of two around the exact sum that the lossless ``int`` run measured).
"""

from __future__ import annotations

import dataclasses
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from ncina.aggregator.backends.python.faults import FaultConfig, FaultyPath
from ncina.proto.nc8 import Window

from ncina.harness.faults import JOB, SCENARIOS, allreduce_with_faults

WORKERS = 4
ELEMENTS = 60_000
K = 128  # an int result frame of 128 elements fits a 1500-byte MTU

pytestmark = pytest.mark.timeout(120)


# --- the knobs, without sockets ----------------------------------------------------------------


def run_path(config: FaultConfig, datagrams: list[bytes]) -> tuple[list[bytes], list, dict]:
    """Feed ``datagrams`` through a ``FaultyPath`` whose handler echoes each datagram to two
    destinations; return what the handler saw, what was sent, and the counts."""
    seen: list[bytes] = []
    sent: list = []

    def handle(datagram: bytes, source: tuple[str, int]) -> list:
        seen.append(datagram)
        return [(datagram, ("a", 1)), (datagram, ("b", 2))]

    path = FaultyPath(config, handle, lambda d, dst: sent.append((d, dst)))
    for d in datagrams:
        path.deliver(d, ("w", 9))
    path.idle()
    return seen, sent, path.counts


DATAGRAMS = [i.to_bytes(2, "big") for i in range(2000)]  # sortable: big-endian order


def test_no_fault_is_a_plain_pass_through() -> None:
    assert not FaultConfig().active
    seen, sent, counts = run_path(FaultConfig(), DATAGRAMS[:5])
    assert seen == DATAGRAMS[:5]
    assert [d for d, _ in sent] == [d for d in DATAGRAMS[:5] for _ in (0, 1)]
    assert not any(counts.values())


def test_drop_up_removes_datagrams_before_the_logic() -> None:
    seen, sent, counts = run_path(FaultConfig(drop_up=0.1, seed=1), DATAGRAMS)
    assert counts["dropped_up"] == len(DATAGRAMS) - len(seen)
    assert 140 <= counts["dropped_up"] <= 260  # 200 expected, binomial sd ~13
    assert seen == sorted(seen)  # order kept
    assert len(sent) == 2 * len(seen)


def test_drop_down_decides_per_destination() -> None:
    seen, sent, counts = run_path(FaultConfig(drop_down=0.1, seed=2), DATAGRAMS)
    assert seen == DATAGRAMS
    assert counts["dropped_down"] == 2 * len(DATAGRAMS) - len(sent)
    assert 300 <= counts["dropped_down"] <= 500  # 400 expected
    # some datagram reached one destination and not the other
    by_datagram: dict[bytes, set] = {}
    for d, dst in sent:
        by_datagram.setdefault(d, set()).add(dst)
    assert any(len(dsts) == 1 for dsts in by_datagram.values())


def test_duplicate_hands_a_datagram_over_twice() -> None:
    seen, _, counts = run_path(FaultConfig(duplicate=0.1, seed=3), DATAGRAMS)
    assert len(seen) == len(DATAGRAMS) + counts["duplicated"]
    assert 140 <= counts["duplicated"] <= 260
    assert sorted(set(seen)) == DATAGRAMS


def test_reorder_swaps_neighbours_and_loses_nothing() -> None:
    seen, _, counts = run_path(FaultConfig(reorder=0.1, seed=4), DATAGRAMS)
    assert sorted(seen) == DATAGRAMS  # nothing lost or added
    swaps = sum(1 for a, b in pairwise(seen) if a > b)
    assert swaps == counts["reordered"]
    assert 140 <= swaps <= 260


def test_same_seed_same_faults() -> None:
    """The same seed gives the same faults, another seed others: with 2000 datagrams at 5 %
    per fault kind, two independent draws agreeing on every datagram is beyond chance."""
    config = FaultConfig(drop_up=0.05, drop_down=0.05, duplicate=0.05, reorder=0.05, seed=9)
    run = run_path(config, DATAGRAMS)
    assert run == run_path(config, DATAGRAMS)
    assert all(run[2][kind] > 0 for kind in ("duplicated", "reordered"))
    assert run_path(dataclasses.replace(config, seed=10), DATAGRAMS) != run


def test_drop_every_drops_the_nth_datagram_of_each_address_each_way() -> None:
    """A fixed pattern, per address: from two sources, each loses its 5th, 10th, ...; each of
    the two destinations loses its 5th, 10th, ... of what the handler sends it."""
    config = FaultConfig(drop_every=5)
    seen: list[bytes] = []
    sent: list = []
    path = FaultyPath(config, lambda d, s: seen.append(d) or [(d, ("a", 1)), (d, ("b", 2))],
                      lambda d, dst: sent.append((d, dst)))  # fmt: skip
    for i, d in enumerate(DATAGRAMS[:40]):
        path.deliver(d, ("w", i % 2))  # two sources, alternating
    dropped = {DATAGRAMS[i] for i in range(40) if (i // 2 + 1) % 5 == 0}
    assert seen == [d for d in DATAGRAMS[:40] if d not in dropped]
    assert path.counts["dropped_up"] == 8
    for destination in (("a", 1), ("b", 2)):
        got = [d for d, dst in sent if dst == destination]
        assert got == [d for i, d in enumerate(seen) if (i + 1) % 5]
    assert path.counts["dropped_down"] == 2 * (len(seen) // 5)
    with pytest.raises(ValueError, match="drop-every 1"):
        FaultConfig(drop_every=1)


@pytest.mark.parametrize("field", ["drop_up", "drop_down", "duplicate", "reorder"])
def test_probabilities_are_checked(field: str) -> None:
    with pytest.raises(ValueError, match="outside"):
        FaultConfig(**{field: 1.0})
    with pytest.raises(ValueError, match="outside"):
        FaultConfig(**{field: -0.1})


# --- end to end through the aggregator process --------------------------------------------------


def inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(42)
    return [rng.standard_normal(ELEMENTS).astype(np.float32) * 1e-2 for _ in range(WORKERS)]


def allreduce(tmp: Path, result: str, faults: dict[str, float]) -> tuple[list, list, dict]:
    """One sum all-reduce of ``inputs()`` by 4 worker threads through an aggregator with the
    given fault knobs; returns the outputs, the clients' stats and the aggregator's stats."""
    run = allreduce_with_faults(inputs(), tmp, k=K, result=result, faults=faults)
    return run.outputs, run.clients, run.aggregator


@pytest.fixture(scope="module")
def lossless_sums(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The exact per-element sums of the workers' codes (``int`` results, no faults)."""
    outputs, clients, stats = allreduce(tmp_path_factory.mktemp("lossless"), "int", {})
    for out in outputs[1:]:
        np.testing.assert_array_equal(out, outputs[0])
    assert "faults" not in stats
    # No retransmission is needed, but a busy scheduler can outrun a worker's timer: a spurious
    # retransmission is legitimate, and must be answered (a resent result or an ignored
    # duplicate), never added twice. So: every chunk of every rank added once, every slot
    # completed once, nothing dropped, and each retransmission the aggregator saw accounted for.
    job = stats["jobs"][str(JOB)]
    chunks = -(-ELEMENTS // K)
    assert job["contributions"] == WORKERS * (chunks + 1)  # + 1: the agreement after the handshake
    assert job["slots_completed"] == chunks + 1
    assert sum(job["drops"].values()) == 0
    assert job["results_resent"] + job["duplicates"] <= job["retx_seen"]
    assert job["retx_seen"] <= sum(c["retransmissions"] for c in clients)
    assert job["packets_in"] == (job["contributions"] + job["duplicates"]
                                 + job["results_resent"] + job["handshakes"])  # fmt: skip
    return outputs[0]



@pytest.mark.parametrize("scenario", [name for name, faults in SCENARIOS.items() if faults])
def test_int_results_are_identical_to_the_lossless_run(
    scenario: str, lossless_sums: np.ndarray, tmp_path: Path
) -> None:
    faults = SCENARIOS[scenario]
    outputs, clients, stats = allreduce(tmp_path, "int", faults)
    for out in outputs:
        np.testing.assert_array_equal(out, lossless_sums)
    counted = stats["faults"]
    job = stats["jobs"][str(JOB)]
    chunks = -(-ELEMENTS // K)
    assert job["slots_completed"] == chunks + 1  # every slot once, and the agreement's
    # The only drop loss may cost: rule 2's budget (a burst of RESEND_BURST copies of a result
    # per member and slot version, then one per RESEND_INTERVAL). A worker whose result copies
    # are lost, or whose asks pile up behind a descheduled aggregator (a loaded machine), may
    # spend it; it then waits for the interval, and its result is still exact (above).
    # Deterministically: test_engine.py's burst test. Without duplicated datagrams, each such
    # drop, like each resend and ignored duplicate, is a retransmission the aggregator saw.
    drops = {reason: n for reason, n in job["drops"].items() if n}
    assert set(drops) <= {"resend_limit"}, drops
    if "duplicate" not in faults:
        assert (job["results_resent"] + job["duplicates"] + drops.get("resend_limit", 0)
                <= job["retx_seen"])  # fmt: skip
    if "drop_up" in faults or "drop_down" in faults:
        lost = counted["dropped_up"] + counted["dropped_down"]
        assert lost > 0
        assert sum(c["retransmissions"] for c in clients) > 0
        assert job["retx_seen"] > 0
    if "duplicate" in faults:
        assert counted["duplicated"] > 0 and counted["reordered"] > 0
        # A duplicated hello is one more handshake (the workers sent sum(handshakes) of them).
        hellos = job["handshakes"] - sum(c["handshakes"] for c in clients)
        assert job["duplicates"] + job["results_resent"] + hellos >= counted["duplicated"]


def test_nc8_results_under_loss_are_the_lossless_ones(
    lossless_sums: np.ndarray, tmp_path: Path
) -> None:
    for name in ("lossy", "lossless"):
        (tmp_path / name).mkdir()
    outputs, clients, _ = allreduce(tmp_path / "lossy", "nc8",
                                    {"drop_up": 0.05, "drop_down": 0.05})  # fmt: skip
    assert sum(c["retransmissions"] for c in clients) > 0
    lossless, _, _ = allreduce(tmp_path / "lossless", "nc8", {})
    for out in outputs:
        np.testing.assert_array_equal(out, lossless[0])  # bit for bit, every worker
    e_min = Window.for_job(WORKERS).e_min
    exact = lossless_sums.astype(np.float64) / 2.0**e_min  # integer sums of the codes
    got = outputs[0].astype(np.float64) / 2.0**e_min
    assert np.array_equal(np.sign(got), np.sign(exact))
    nonzero = exact != 0
    low = 2.0 ** np.floor(np.log2(np.abs(exact[nonzero])))
    assert np.all((np.abs(got[nonzero]) == low) | (np.abs(got[nonzero]) == 2 * low))
