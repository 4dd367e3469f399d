"""The DPDK data plane on several strands (``--lcores N``, docs/dpdk.md "Several lcores"): each
strand polls its own RX queue (af_packet qpairs: the kernel spreads the workers' flows by hash),
owns the slots s with s % N == its index and hands the frames of the others' slots over through
their rings; strand 0 owns the job datagrams and parks the others while it handles one.

- exact sums of four workers over 128 slot rounds on two strands; the job's counters add up to
  what was sent, and both strands aggregated (hand-overs in both directions add up);
- hellos that restart a job while another job's traffic flows on both strands, then that job
  removed (its memory freed once no strand can hold it), the running job exact throughout;
- refusals before EAL starts: more lcores than allowed, af_xdp on an interface with fewer
  combined channels (a veth has none, whatever its RX queues: DPDK 22.11's af_xdp then takes one
  queue only), and a leaf on more than one strand (the command's refusal, and the engine's own,
  offline).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ncina.aggregator.backends.dpdk import binding, netns
from ncina.aggregator.backends.dpdk.eal import (
    MAX_LCORES,
    check_lcores,
    check_queues,
    combined_channels,
)
from ncina.proto import descriptor as desc
from ncina_testlib import (
    Worker,
    dissect,
    exact_sums,
    start_aggregator,
    uplink,
    window_e_min,
    worker_host,
)
from test_jobs import allreduce_job, wait_for_log, write_job

from ncina.cli import main
from ncina.harness import aggregators

_MISSING = netns.missing() or binding.missing()
needs_dpdk = pytest.mark.skipif(_MISSING is not None, reason=f"dpdk backend: {_MISSING}")

JOB = 1
WORKERS = 4
K = 16
POOL = 16
ROUNDS = 8


def strand_work(io: dict[str, int]) -> int:
    """Frames a strand handled itself: those it received and kept, and those handed to it."""
    return io["rx_frames"] - io["handoffs"] - io["handoff_full"] + io["handed_in"]


def two_queue_site(backend: str, arguments: Sequence[str]) -> list[str]:
    """``aggregator_command`` on a site whose veth end has two RX and two TX queues."""
    return netns.shared_star().add_site(queues=2).aggregator_command(arguments, backend)


@needs_dpdk
def test_two_strands_sum_every_slot_exactly_and_share_the_work(tmp_path: Path) -> None:
    agg = start_aggregator("dpdk", tmp_path, job=JOB, workers=WORKERS, k=K, result="int",
                           extra=["--pool-size", str(POOL), "--lcores", "2"])  # fmt: skip
    workers = [Worker(agg.address, timeout=10.0) for _ in range(WORKERS)]
    rnd = random.Random(17)
    emin = window_e_min(WORKERS)
    try:
        assert ", 2 lcores, " in agg.log()
        for r in range(ROUNDS):
            codes = {(rank, s): [rnd.choice([0, 1, 2, 3, 0x81, 0x83]) for _ in range(K)]
                     for rank in range(WORKERS) for s in range(POOL)}  # fmt: skip
            for rank, worker in enumerate(workers):
                for s in range(POOL):
                    worker.send(uplink(job=JOB, rank=rank, slot=s, offset=(r * POOL + s) * K,
                                       codes=codes[rank, s], emin=emin, pool=r % 2))  # fmt: skip
            for worker in workers:
                got = {}
                for _ in range(POOL):
                    fields, payload = dissect(worker.receive())
                    assert fields["offset"] == (r * POOL + fields["slot"]) * K
                    got[fields["slot"]] = [int.from_bytes(payload[i : i + 8], "big", signed=True)
                                           for i in range(0, len(payload), 8)]  # fmt: skip
                want = {s: exact_sums([codes[rank, s] for rank in range(WORKERS)])
                        for s in range(POOL)}  # fmt: skip
                assert got == want
        stats = agg.stats()
    finally:
        for worker in workers:
            worker.close()
        assert agg.stop() == 0
    sent = ROUNDS * POOL * WORKERS
    job = stats["jobs"][str(JOB)]
    assert job["packets_in"] == job["contributions"] == sent
    assert job["slots_completed"] == ROUNDS * POOL
    assert job["results_sent"] == job["packets_out"] == sent
    assert sum(job["drops"].values()) == 0 and stats["global"]["packets_in"] == 0
    io = stats["dpdk"]
    strands = io["strands"]
    assert len(strands) == 2
    assert io["handoff_full"] == 0
    # Every frame handed over was taken (the rings are empty: every result came back), and each
    # strand aggregated its own half of the slots, whichever queue the kernel gave the flows.
    assert io["handoffs"] == io["handed_in"] > 0
    assert all(strand_work(strand) >= sent // 2 for strand in strands), strands
    for name in ("rx_frames", "handoffs", "handed_in", "tx_frames"):
        assert io[name] == sum(strand[name] for strand in strands)


@needs_dpdk
@pytest.mark.timeout(180)
def test_hellos_restart_and_a_job_is_removed_while_another_runs_on_two_strands(
    tmp_path: Path,
) -> None:
    """A static job reduces 300k elements in the background (its clients' hellos first) while a
    second job, added through the jobs directory, is run by three sets of workers in turn: each
    set's hellos find it idle and restart its slots, strand 0 parking the other strand for every
    hello that may restart it. The second job is then removed while the first still runs.
    Every sum exact."""
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    agg = start_aggregator("dpdk", tmp_path, job=21, workers=2, k=64, result="int",
                           extra=["--jobs-dir", str(jobs_dir), "--pool-size", "32",
                                  "--lcores", "2", "--restart-idle", "0"])  # fmt: skip
    host = worker_host("dpdk")
    try:
        background = ThreadPoolExecutor(1)
        static = background.submit(allreduce_job, agg.address, 21, 2, 64, "int", 300_000, 1,
                                   pool_size=32, host=host)  # fmt: skip
        file = write_job(jobs_dir, {"job": 22, "workers": 2, "k": 32, "result_format": "int",
                                    "pool_size": 8})  # fmt: skip
        wait_for_log(agg, "added job 22:")
        for seed in range(3):  # each set restarts job 22: offsets from 0 again
            allreduce_job(agg.address, 22, 2, 32, "int", 2_000, 10 + seed, pool_size=8,
                          host=host)  # fmt: skip
        file.unlink()
        wait_for_log(agg, "removed job 22\n")
        static.result()  # exact, or the assertion inside fails here
        background.shutdown()
        stats = agg.stats()
    finally:
        assert agg.stop() == 0
    assert list(stats["jobs"]) == ["21"]
    assert stats["jobs"]["21"]["slots_completed"] == -(-300_000 // 64) + 1  # +1: the agreement
    # The first hello of each set at least: job 21's, and one per set of job 22 (a new nonce, or
    # the first set's on a quiet job); a set's later hellos restart nothing and park nothing.
    assert stats["dpdk"]["parks"] >= 1 + 3
    assert stats["dpdk"]["handoff_full"] == 0
    assert all(strand_work(strand) > 0 for strand in stats["dpdk"]["strands"])


@needs_dpdk
def test_only_a_hello_that_may_restart_its_job_parks_the_other_strands(tmp_path: Path) -> None:
    """Issue 27, finding 3: every job datagram parked every strand before its length, count, job
    and tag were checked, so unauthenticated 16-byte datagrams stopped the world one each. Now
    strand 0 parks the others only for an authentic hello to a job quiet for --restart-idle; the
    rest (malformed, unknown job, not authentic, a job in use) are answered or dropped with
    the other strands running."""
    agg = start_aggregator("dpdk", tmp_path, job=JOB, workers=WORKERS, k=K, result="int",
                           extra=["--pool-size", str(POOL), "--lcores", "2"])  # fmt: skip
    worker = Worker(agg.address, timeout=5.0)
    mine = desc.Descriptor(mode=1, workers=WORKERS, pool_size=POOL, k=K, e_max=10,
                           e_min=window_e_min(WORKERS), keyed=False, compressor=0)  # fmt: skip
    hello = desc.pack_job_datagram(mine, job=JOB, rank=0)
    try:
        worker.send(hello)  # a fresh job: quiet, so this one parks
        worker.receive()
        emin = window_e_min(WORKERS)
        for rank in range(WORKERS):  # a slot completes: the job is in use for 10 s
            worker.send(uplink(job=JOB, rank=rank, slot=1, offset=1, codes=[1] * K, emin=emin))
        for _ in range(WORKERS):
            worker.receive()
        for _ in range(50):
            worker.send(hello[:16])  # a bare 16-byte job datagram: bad_length
            worker.send(desc.pack_job_datagram(mine, job=JOB + 1, rank=0))  # no such job
            worker.send(desc.pack_job_datagram(mine, job=JOB, rank=0, key=bytes(16)))  # tagged
            worker.send(hello)  # authentic, but the job is in use
        for _ in range(150):
            worker.receive()  # every answered one: the last comes after every datagram
        stats = agg.stats()
    finally:
        worker.close()
        assert agg.stop() == 0
    job = stats["jobs"][str(JOB)]
    assert job["handshakes"] == 1 + 100 and job["drops"]["bad_length"] == 50
    assert stats["dpdk"]["parks"] == 1


@pytest.mark.parametrize(
    ("lcores", "cpus", "said"),
    [
        (0, [0, 1], "runs 1 to 8 lcores"),
        (MAX_LCORES + 1, list(range(16)), "runs 1 to 8 lcores"),
        (3, [0, 1], "may use 2 CPUs (0,1), so at most --lcores 2"),
    ],
)
def test_lcores_beyond_the_strands_or_the_cpus_are_refused(
    lcores: int, cpus: list[int], said: str
) -> None:
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        check_lcores(lcores, cpus)
    check_lcores(2, [0, 1])


def test_the_command_refuses_too_many_lcores_before_eal_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["aggregator", "--backend", "dpdk", "--job", "1", "--workers", "2", "--k", "64",
            "--result", "int", "--listen", "10.0.0.1:47000", "--iface", "ncd-nonexistent",
            "--lcores", str(MAX_LCORES + 1)]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"--lcores {MAX_LCORES + 1}: the dpdk data plane runs 1 to 8 lcores" in err
    assert "Traceback" not in err


VETH_CHANNELS = """Channel parameters for veth0:
Pre-set maximums:
RX:\t\t2
TX:\t\t2
Other:\t\tn/a
Combined:\tn/a
Current hardware settings:
RX:\t\t2
TX:\t\t2
Other:\t\tn/a
Combined:\tn/a
"""
NIC_CHANNELS = """Channel parameters for eth0:
Pre-set maximums:
RX:\t\tn/a
TX:\t\tn/a
Other:\t\t1
Combined:\t8
Current hardware settings:
RX:\t\tn/a
TX:\t\tn/a
Other:\t\t1
Combined:\t2
"""


def test_af_xdp_needs_as_many_combined_channels_as_lcores() -> None:
    """DPDK's af_xdp binds one queue per strand to the interface's combined channels; a veth has
    none (its two RX queues are not enough), a NIC set to two has two."""
    assert combined_channels(VETH_CHANNELS) == 1 and combined_channels(NIC_CHANNELS) == 2
    with pytest.raises(ValueError, match="needs 2 combined channels on veth0, it has 1"):
        check_queues("veth0", "af_xdp", 2, channels=lambda _: VETH_CHANNELS)
    check_queues("veth0", "af_packet", 2, channels=lambda _: VETH_CHANNELS)  # its own queues
    check_queues("veth0", "af_xdp", 1, channels=lambda _: VETH_CHANNELS)
    check_queues("eth0", "af_xdp", 2, channels=lambda _: NIC_CHANNELS)
    with pytest.raises(ValueError, match="needs 3 combined channels on eth0, it has 2"):
        check_queues("eth0", "af_xdp", 3, channels=lambda _: NIC_CHANNELS)


@needs_dpdk
def test_af_xdp_on_two_strands_is_refused_on_a_veth_before_eal_starts(tmp_path: Path) -> None:
    agg = aggregators.launch_aggregator(
        "dpdk", tmp_path, command=two_queue_site, job=JOB, workers=2, k=K, result="int",
        extra=["--lcores", "2", "--dpdk-pmd", "af_xdp"],
    )
    try:
        assert agg.process.wait(60) == 1
    finally:
        agg.stop()
    log = agg.log()
    assert "af_xdp needs 2 combined channels on" in log and "it has 1" in log, log
    assert "EAL" not in log and "Traceback" not in log


@pytest.mark.skipif(binding.missing() is not None, reason=f"dpdk: {binding.missing()}")
def test_the_command_refuses_a_leaf_on_two_lcores(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["aggregator", "--backend", "dpdk", "--iface", "lo", "--job", "1",
                   "--workers", "2", "--result", "int", "--listen", "10.0.0.1:47000",
                   "--upstream", "10.0.0.2:47000", "--upstream-rank", "0", "--total-workers", "4",
                   "--lcores", "2"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert status == 1
    assert err == (
        "ncina aggregator: error: a dpdk leaf (--upstream) serves on one lcore, not --lcores 2: "
        "its link to the spine (ARP, uplinks, the engine's upstream state) is one strand's"
    )


@pytest.mark.skipif(binding.missing() is not None, reason=f"dpdk: {binding.missing()}")
def test_a_leaf_is_refused_on_more_than_one_strand() -> None:
    """The engine's refusal (offline, no EAL): a leaf's upstream state is one strand's, so a
    leaf job on two strands is refused, and so are two strands while a leaf is installed."""
    from ncina.aggregator.backends.dpdk.driver import DataPlane
    from ncina.aggregator.jobs import JobConfig

    dp = DataPlane(binding.load())
    dp.reset()
    lib = dp.lib
    hello = desc.pack_job_datagram(
        desc.Descriptor(mode=0, workers=4, pool_size=8, k=32, e_max=10, e_min=-50,
                        keyed=False, compressor=0), job=5, rank=0)  # fmt: skip
    spine = bytes([10, 0, 0, 9])
    try:
        dp.add_job(JobConfig.create(job=5, workers=2, k=32, pool_size=8, result_format="int",
                                    total_workers=4))  # fmt: skip
        dp.set_strands(2)
        assert lib.nce_job_set_upstream(5, spine, 47000, 0, 1, hello, len(hello)) == -1
        reason = dp.ffi.string(lib.nce_error()).decode()
        assert reason == "job 5: a leaf serves on one strand, not 2 (--lcores 1)"
        dp.set_strands(1)
        assert lib.nce_job_set_upstream(5, spine, 47000, 0, 1, hello, len(hello)) == 0
        with pytest.raises(RuntimeError, match="job 5 is a leaf, which serves on one strand only"):
            dp.set_strands(2)
    finally:
        dp.set_strands(1)
        dp.reset()


@needs_dpdk
def test_a_reassembled_datagram_too_large_to_hand_over_stays_with_its_strand() -> None:
    """Issue 27, finding 2 (offline: reassembly needs EAL and a port with several strands, which a
    veth cannot give af_xdp): a reassembled packet larger than an mbuf stays in strand 0's buffer;
    a valid chunk sent as fragments with IPv4 options can be that large. Strand 0 hands it to the
    engine only when it owns the chunk's slot (or it is a job datagram), so no slot is touched
    by two strands; the loop drops and counts the others (``ignored``)."""
    lib = binding.load().lib
    emin = window_e_min(WORKERS)
    for slot, strands, strand0 in ((1, 2, False), (3, 2, False), (2, 2, True), (1, 1, True),
                               (4, 3, False), (6, 3, True)):  # fmt: skip
        chunk = uplink(job=JOB, rank=0, slot=slot, offset=slot, codes=[1] * K, emin=emin)
        whole = bool(lib.ncd_whole_on_strand0(chunk, len(chunk), strands))
        assert whole is strand0, (slot, strands)
    hello = desc.pack_job_datagram(
        desc.Descriptor(mode=1, workers=WORKERS, pool_size=POOL, k=K, e_max=10, e_min=emin,
                        keyed=False, compressor=0), job=JOB, rank=0)  # fmt: skip
    assert lib.ncd_whole_on_strand0(hello, len(hello), 2) == 1
