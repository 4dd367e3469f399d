"""The Tofino design as a job profile (``--profile tofino``, docs/tofino.md) across backends,
and its v1model twin (``--backend bmv2 --profile tofino``) end to end: four ``AllreduceClient``
workers of the profile all-reduce through socket, dpdk and the twin and get, bit for bit, what
they get from the Python reference under the profile with the same seeds, inputs beyond the
window's capped top and sums at the 32-bit lanes' limit included; a code above the cap is
``bad_code`` on every backend; job handshakes get the reference's answers, byte for byte; a job
the design cannot run (too many lanes, for nc8 results more than 7, or workers) is refused at
configuration with one sentence. The cross-backend packet scenarios run the twin as backend
``bmv2-tofino`` (tests/test_aggregator_packets.py and the others parametrised over
``AGGREGATOR_BACKENDS``)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.aggregator.backends.tofino.twin import limits
from ncina.proto import descriptor as desc
from ncina.proto.header import INT_DTYPE, Format
from ncina.proto.profiles import TOFINO_MAX_K, TOFINO_MAX_WORKERS, tofino_max_code, tofino_max_k
from ncina.worker.client import AllreduceClient
from ncina_testlib import (
    TWIN,
    Worker,
    counters,
    dissect,
    start_aggregator,
    uplink,
    wait_learned,
    window_e_min,
    worker_host,
)

JOB = 12
WORKERS = 4
K = TOFINO_MAX_K
ELEMENTS = 1_200  # 100 chunks a call
# The window's e_max: e_min = 38 - 60 = -22, and the profile takes codes up to
# tofino_max_code(4) = 29, i.e. 2^6: larger inputs saturate there, and four of them sum to
# 2^8 = 2^30 units of 2^e_min, the most a 32-bit lane holds under the cap.
WINDOW_MAX = 38
TOP = {"int": WINDOW_MAX, "nc8": WINDOW_MAX, "int32": WINDOW_MAX - 32}
"""Each result format's --window-max for that window: an int32 window's e_max is its top
(docs/protocol.md, "int32 results"), an int one's the top of 64-bit lanes, 32 powers above the
profile's cap."""
TOFINO = ["--profile", "tofino"]
PROFILE_BACKENDS = ("socket", "dpdk", TWIN)
"""Backends checked against the Python reference under the profile (the twin is
``aggregator_command``'s bmv2 with ``--profile tofino``)."""
PROFILE_RUNS = [("python", "int"),
                *((b, r) for b in PROFILE_BACKENDS for r in ("int32", "int"))]
"""(backend, result) pairs checked against the reference's int32 results: both formats carry the
same sums, at the design's K (32: the dense layout's, which the twin mirrors)."""

pytestmark = pytest.mark.timeout(300)


def allreduce(
    backend: str, workdir: Path, calls: list[list[np.ndarray]], result: str = "int32"
) -> list[list[np.ndarray]]:
    """Every call's inputs (one per rank) summed through a new aggregator of ``backend`` with
    ``result`` results; the outputs per call and rank. The aggregator must have completed each
    chunk once and dropped nothing but retransmissions that came late (a result was on its
    way). K is the design's for the result format (``tofino_max_k``: 7 for nc8)."""
    profile = [] if backend == TWIN else TOFINO
    k = tofino_max_k(result)
    agg = start_aggregator(backend, workdir, job=JOB, workers=WORKERS, k=k, result=result,
                           extra=["--window-max", str(TOP[result]), "--seed", "7", *profile])
    try:

        def worker(rank: int) -> list[np.ndarray]:
            with AllreduceClient(agg.address, job=JOB, rank=rank, workers=WORKERS, k=k,
                                 result_format=result, seed=100 + rank, deadline=60.0,
                                 window_max=TOP[result], profile="tofino") as client:  # fmt: skip
                outputs = [client.allreduce(inputs[rank], op="sum") for inputs in calls]
                assert client.stats["saturated"] > 0  # the capped top was hit
                return outputs

        with ThreadPoolExecutor(WORKERS) as pool:
            done = list(pool.map(worker, range(WORKERS)))
        stats = agg.stats()["jobs"][str(JOB)]
        late = stats["drops"].pop("late")
        assert not any(stats["drops"].values()), stats
        assert late + stats["results_resent"] <= stats["retx_seen"], stats
        assert stats["slots_completed"] == len(calls) * -(-ELEMENTS // k) + 1  # +1: the agreement
    finally:
        assert agg.stop() == 0, agg.log()
    return [[outputs[c] for outputs in done] for c in range(len(calls))]


def profile_calls(k: int = K) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Three calls' inputs per rank: powers of two up to 2^9, the same on every rank (beyond
    the capped top 2^6 they saturate there: four of them sum to 2^30 units, the 32-bit lanes'
    limit, or -2^30); then standard normal inputs times 16 (codes drawn from the seeds, a few
    saturated); then a mix of both aligned to chunks of ``k``. The first call's expected sums
    with them."""
    rng = np.random.default_rng(26)
    sign = rng.choice([-1.0, 1.0], ELEMENTS)
    power = np.ldexp(sign, rng.integers(-20, 10, ELEMENTS)).astype(np.float32)
    power[rng.random(ELEMENTS) < 0.05] = 0.0
    same = [power] * WORKERS
    normal = [16 * rng.standard_normal(ELEMENTS, dtype=np.float32) for _ in range(WORKERS)]
    mixed = [np.where(np.arange(ELEMENTS) // k % 2 == 0, a, b)
             for a, b in zip(same, normal, strict=True)]  # fmt: skip
    capped = np.sign(power) * np.minimum(np.abs(power), 2.0**6)
    return (4 * capped).astype(np.float32), [same, normal, mixed]


@pytest.fixture(scope="module")
def profile_reference(tmp_path_factory: pytest.TempPathFactory) -> list[list[np.ndarray]]:
    """The Python reference's outputs for ``profile_calls`` under the profile, int32 results."""
    expected, calls = profile_calls()
    outputs = allreduce("python", tmp_path_factory.mktemp("python"), calls)
    for output in outputs[0]:
        np.testing.assert_array_equal(output, expected)
    assert np.abs(expected).max() == 4 * 2.0**6  # 2^30 units of 2^-22: the lanes' limit
    return outputs


@pytest.mark.parametrize(("backend", "result"), PROFILE_RUNS)
def test_an_allreduce_under_the_tofino_profile_is_the_reference_bit_for_bit(
    backend: str, result: str, profile_reference: list[list[np.ndarray]], tmp_path: Path
) -> None:
    worker_host(backend)  # skips with the reason when DPDK, BMv2, p4c or root is missing
    ours = allreduce(backend, tmp_path, profile_calls()[1], result)
    for call, reference_call in zip(ours, profile_reference, strict=True):
        for a, b in zip(call, reference_call, strict=True):
            assert a.dtype == b.dtype == np.float32
            assert a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def nc8_reference(tmp_path_factory: pytest.TempPathFactory) -> list[list[np.ndarray]]:
    """The Python reference's outputs for ``profile_calls`` under the profile, nc8 results
    (seed 7, K 7: the build with NC8 results fits 7 lanes): every rank gets the same
    re-compressed sums, within a power of two of the exact ones."""
    expected, calls = profile_calls(tofino_max_k("nc8"))
    outputs = allreduce("python", tmp_path_factory.mktemp("python-nc8"), calls, "nc8")
    for output in outputs[0]:
        assert output.tobytes() == outputs[0][0].tobytes()
        near = expected != 0
        assert np.all(np.abs(output[near] / expected[near]) <= 2)
    return outputs


@pytest.mark.parametrize("backend", PROFILE_BACKENDS)
def test_nc8_results_under_the_tofino_profile_are_the_reference_bit_for_bit(
    backend: str, nc8_reference: list[list[np.ndarray]], tmp_path: Path
) -> None:
    """The design's NC8 results (the TNA build with nc8 results, mirrored by the twin): every
    lane's highest set bit, the CRC-32 rounding word and the compare give the reference's codes
    for the same seed, byte for byte, on socket, dpdk and the twin, at K 7 (a nc8 job of more
    lanes is refused: test_a_job_the_design_cannot_run_is_refused_in_one_sentence)."""
    worker_host(backend)
    ours = allreduce(backend, tmp_path, profile_calls(tofino_max_k("nc8"))[1], "nc8")
    for call, reference_call in zip(ours, nc8_reference, strict=True):
        for a, b in zip(call, reference_call, strict=True):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize(("backend", "result"), [("python", "int32"), ("python", "int"),
                                                  *PROFILE_RUNS[1:-1]])
def test_a_code_above_the_profile_cap_is_bad_code_on_every_backend(
    backend: str, result: str, tmp_path: Path
) -> None:
    """Code max_code(4) = 29 is added, 30 (in the default profile's window) is dropped and
    counted as ``bad_code``, as the twin's ``code_offset`` does; nothing else is counted. The
    cap is one rule for int and int32 results: N workers' sums stay within 2^30."""
    worker_host(backend)
    profile = [] if backend == TWIN else TOFINO
    agg = start_aggregator(backend, tmp_path, job=JOB, workers=WORKERS, k=K, result=result,
                           extra=["--window-max", str(TOP[result]), *profile])  # fmt: skip
    worker = Worker(agg.address, timeout=5.0)
    top = tofino_max_code(WORKERS)
    try:
        for slot, code in ((0, top + 1), (1, 0x80 | top + 1), (2, top), (3, 0x80 | top)):
            worker.send(uplink(job=JOB, rank=0, slot=slot, offset=0, codes=[code] * K,
                               emin=window_e_min(WORKERS, WINDOW_MAX)))  # fmt: skip
        deadline = time.monotonic() + 10
        while (found := counters(agg.stats(), JOB))["job.contributions"] < 2:
            assert time.monotonic() < deadline, found  # the datagrams are handled in order
        assert found["job.drops.bad_code"] == 2 and found["job.contributions"] == 2, found
        assert sum(n for name, n in found.items() if ".drops." in name) == 2, found
    finally:
        worker.close()
        assert agg.stop() == 0, agg.log()


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--result", "int", "--k", str(TOFINO_MAX_K + 1)], limits.LACKS["k"]),
        (["--result", "int", "--k", "8", "--workers", "31"], limits.LACKS["workers"]),
        (["--result", "nc8", "--k", "8"], limits.LACKS["nc8_k"]),
    ],
)
def test_a_job_the_design_cannot_run_is_refused_in_one_sentence(
    options: list[str], says: str
) -> None:
    """Refused before any switch starts (so this runs without BMv2 or root), by the job's
    validation (``JobSpec``: the profile is a job parameter), one line naming the sentence."""
    argv = ["--listen", "10.0.0.1:0", "--job", "1", "--workers", "2", "--iface", "lo", *options]
    proc = subprocess.run(
        [sys.executable, "-m", "ncina.cli", "aggregator", "--backend", "bmv2",
         "--profile", "tofino", *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "ncina aggregator: error: invalid job:" and len(lines) == 2, proc.stderr
    assert lines[1].endswith(says), lines[1]


def hellos() -> list[tuple[bytes, bool]]:
    """Job handshakes to a 2-worker int job (K, pool 16, e_max 10), each with whether an
    aggregator answers it: the job's, another job's, a tagged one, a short one, one with RESULT
    set, a long one for no job, a well-formed last."""
    mine = desc.Descriptor(mode=int(Format.INT), workers=2, pool_size=16, k=K, e_max=10,
                           e_min=window_e_min(2), keyed=False, compressor=0)  # fmt: skip
    hello = desc.pack_job_datagram(mine, job=JOB, rank=1)
    return [
        (hello, True),
        (desc.pack_job_datagram(mine, job=99, rank=1), True),
        (desc.pack_job_datagram(mine, job=JOB, rank=1, key=bytes(range(32))), True),
        (hello[:-1], False),
        (hello[:1] + b"\x01" + hello[2:], False),
        (desc.pack_job_datagram(mine, job=99, rank=1) + b"\x00", False),
        (hello, True),
    ]


def answers(backend: str, workdir: Path) -> tuple[list[bytes], dict[str, int]]:
    """What a new aggregator of ``backend`` answers to ``hellos``, and its counters after.

    Each answered hello waits for its answer before the next is sent: datagrams over the veths
    may be reordered (each CPU has its own backlog queue), which CI saw once with a burst. An
    answer to a silent hello takes the last hello's place, or shows in the counters."""
    profile = [] if backend == TWIN else TOFINO
    agg = start_aggregator(backend, workdir, job=JOB, workers=2, k=K, result="int",
                           extra=["--pool-size", "16", "--generation", "5", *profile])  # fmt: skip
    worker = Worker(agg.address, timeout=5.0)
    try:
        got = []
        for hello, answered in hellos():
            worker.send(hello)
            if answered:
                got.append(worker.receive())
        return got, dict(counters(agg.stats(), JOB))
    finally:
        worker.close()
        assert agg.stop() == 0, agg.log()


def test_the_twin_answers_job_handshakes_as_the_reference_does(tmp_path: Path) -> None:
    worker_host(TWIN)
    twin, twin_counts = answers(TWIN, tmp_path / "twin")
    reference, reference_counts = answers("python", tmp_path / "python")
    assert twin == reference
    assert [d[16] for d in twin] == [desc.OK, desc.NO_SUCH_JOB, desc.NOT_AUTHENTIC, desc.OK]
    assert twin_counts == reference_counts


def test_the_control_plane_installs_the_tna_contract() -> None:
    """Everywhere (no switch): a placed job's entries, as docs/tofino.md's contract lists them."""
    from ncina.aggregator.backends.bmv2 import entries
    from ncina.aggregator.backends.bmv2.layout import JOB_EVENTS
    from ncina.aggregator.backends.tofino import twin
    from ncina.aggregator.jobs import JobConfig

    first = JobConfig.create(job=3, workers=2, k=K, result_format="int", pool_size=8)
    config = JobConfig.create(job=9, workers=5, k=K, result_format="int", pool_size=16,
                              members=[(1, ("10.0.0.7", 4000))])  # fmt: skip
    job = entries.place([first, config], 6, K)[1]
    made = twin.entries(job, ("10.0.0.1", 47000, "02:00:00:00:00:01"))
    # The aggregator's address last: the switch takes nothing for it before the job is whole.
    assert made[-1].table.endswith("local_address")
    by_table: dict[str, list[entries.Entry]] = {}
    for entry in made:
        by_table.setdefault(entry.table.rsplit(".", 1)[1], []).append(entry)
    [local] = by_table["local_address"]
    assert local.params == {"mac": "02:00:00:00:00:01", "port": "47000", "flags": str(6 << 3 | 1)}
    assert by_table["requests"][0].match == {"hdr.arp.tpa": "10.0.0.1", "hdr.arp.op": "1"}
    versions = {e.match["pool"]: e.params for e in by_table["jobs"]}
    assert set(versions) == {"0", "1"}
    assert versions["0"]["slot_base"] == "16" and versions["1"]["slot_base"] == "32"  # after job 3
    for params in versions.values():
        assert params["pair_base"] == "8" and params["index"] == "1" and params["group"] == "2"
        assert params["full"] == str(0b11111) and params["flags"] == str(6 << 3 | 1)
        assert params["events"] == str(len(JOB_EVENTS))
        # 5 workers: codes up to 31 - ceil(log2 5) = 28
        assert params["code_offset"] == str(127 - 28) and tofino_max_code(5) == 28
    assert [e.match for e in by_table["ranks"]] == [{"hdr.nc.job": "9", "hdr.nc.rank": "1"}]
    assert by_table["members"][0].match == {"hdr.nc.job": "9", "hdr.nc.rank": "1",
                                            "hdr.ipv4.src": "10.0.0.7",
                                            "hdr.udp.src_port": "4000"}  # fmt: skip
    [answer] = by_table["answers"]
    assert answer.params["mode"] == str(int(Format.INT)) and answer.params["k"] == str(K)
    # Every job's sums fit a signed 32-bit lane: N * 2^(max_code - 1) <= 2^30.
    assert all(n << tofino_max_code(n) - 1 <= 1 << 30 for n in range(1, TOFINO_MAX_WORKERS + 1))


READ_ENTRIES = """
import json, sys
import grpc
from google.protobuf import text_format
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc
address, p4info, *names = sys.argv[1:]
with open(p4info) as f:
    info = text_format.Parse(f.read(), p4info_pb2.P4Info(), allow_unknown_field=True)
tables = {t.preamble.id: t for t in info.tables if t.preamble.name in names}
actions = {a.preamble.id: a for a in info.actions}
request = p4runtime_pb2.ReadRequest(device_id=1)
for table in tables:
    request.entities.add().table_entry.table_id = table
found = {name: [] for name in names}
for response in p4runtime_pb2_grpc.P4RuntimeStub(grpc.insecure_channel(address)).Read(request):
    for entity in response.entities:
        entry, table = entity.table_entry, tables[entity.table_entry.table_id]
        keys = {f.id: f.name for f in table.match_fields}
        action = actions[entry.action.action.action_id]
        params = {p.id: p.name for p in action.params}
        found[table.preamble.name].append({
            "match": {keys[m.field_id]: int.from_bytes(m.exact.value, "big") for m in entry.match},
            "params": {params[p.param_id]: int.from_bytes(p.value, "big")
                       for p in entry.action.action.params}})
print(json.dumps(found))
"""
"""Every entry of the tables named, read over P4Runtime (a Read needs no session): run in the
switch's namespace with its gRPC address and P4Info."""
GRPC_PORT = 9559  # in the aggregator's own namespace


def switch_entries(agg: Any, tables: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The twin's entries in ``tables``, read back from its switch over P4Runtime."""
    from ncina.aggregator.backends.bmv2 import toolchain

    namespace = agg.process.args[:4]  # ip netns exec NS
    assert namespace[:3] == ["ip", "netns", "exec"], agg.process.args
    p4info = toolchain.build(K, profile="tofino").p4info
    proc = subprocess.run([*namespace, sys.executable, "-c", READ_ENTRIES,
                           f"127.0.0.1:{GRPC_PORT}", str(p4info), *tables],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return json.loads(proc.stdout)


def test_the_twin_learns_a_rank_from_a_digest_into_three_tables(tmp_path: Path) -> None:
    """docs/tofino.md, "How the twin learns members": a rank's first valid packet gives one
    digest, and the control plane installs the rank's entries in ``ranks``, ``members`` and
    egress ``member_addresses`` (read back over P4Runtime; the twin's ``addressed`` too); the
    rank's next packet no second digest; a packet claiming the rank from another address after
    that is ``non_member``, as on the reference; the rank's copy of a result is addressed to
    it; and when the job goes, the entries are deleted."""
    from ncina.aggregator.backends.dpdk import netns
    from ncina.aggregator.backends.tofino.twin import learning

    worker_host(TWIN)
    agg = start_aggregator(TWIN, tmp_path, job=JOB, workers=2, k=K, result="int",
                           extra=["--grpc-port", str(GRPC_PORT)])  # fmt: skip
    rank0, other, rank1 = (Worker(agg.address, timeout=5.0) for _ in range(3))
    emin = window_e_min(2)

    def packet(rank: int, slot: int) -> bytes:
        return uplink(job=JOB, rank=rank, slot=slot, offset=slot * K, codes=[1] * K, emin=emin)

    tables = [learning.RANKS_TABLE, learning.MEMBERS_TABLE, learning.ADDRESSES_TABLE,
              learning.ADDRESSED_TABLE]  # fmt: skip
    try:
        assert switch_entries(agg, tables) == {table: [] for table in tables}
        sent = time.time()
        rank0.send(packet(0, 0))
        wait_learned(agg, 1)
        [line] = [x for x in agg.log().splitlines() if "learned job" in x]
        installed = float(line.partition("entries in at ")[2].partition(",")[0])
        print(f"\nrank 0's entries in {(installed - sent) * 1e3:.1f} ms after its packet: {line}")
        host, port = rank0.address
        ip = int(ipaddress.IPv4Address(host))
        mac = int(Path(f"/sys/class/net/{netns.shared_star().bridge}/address").read_text()
                  .replace(":", "").strip(), 16)  # fmt: skip
        key = {"hdr.nc.job": JOB, "hdr.nc.rank": 0}
        assert switch_entries(agg, tables) == {
            learning.RANKS_TABLE: [{"match": key, "params": {}}],
            learning.MEMBERS_TABLE: [{"match": {**key, "hdr.ipv4.src": ip,
                                                "hdr.udp.src_port": port}, "params": {}}],
            learning.ADDRESSES_TABLE: [{"match": {"hdr.bridge.job_index": 0,
                                                  "eg_md.egress_rid": 0},
                                        "params": {"mac": mac, "ip": ip, "port": port}}],
            learning.ADDRESSED_TABLE: [{"match": key, "params": {}}],
        }  # fmt: skip
        rank0.send(packet(0, 1))
        other.send(packet(0, 2))  # rank 0 from another address
        deadline = time.monotonic() + 10
        while (found := counters(stats := agg.stats(), JOB))["job.contributions"] < 2 or (
                found["job.drops.non_member"] < 1):  # fmt: skip
            assert time.monotonic() < deadline, found
        assert found["job.drops.non_member"] == 1 and found["job.contributions"] == 2, found
        assert stats["learning"] == {"digests": 1, "lists": 1, "members": 1,
                                     "entries_installed": 4, "duplicates": 0,
                                     "entries_removed": 0}  # fmt: skip
        rank1.send(packet(1, 0))  # completes slot 0: rank 0's copy is addressed to it
        fields, payload = dissect(rank0.receive())
        assert (fields["rank"], fields["slot"]) == (0, 0)
        assert np.frombuffer(payload, dtype=INT_DTYPE).tolist() == [2] * K
    finally:
        for worker in (rank0, other, rank1):
            worker.close()
        assert agg.stop() == 0, agg.log()
    final = json.loads(agg.stats_path.read_text())["learning"]
    assert final["digests"] == 2 and final["duplicates"] == 0, final  # rank 1's own
    assert final["entries_removed"] == final["entries_installed"] == 8, final


def test_the_control_plane_learns_each_rank_once_in_the_tna_order() -> None:
    """Everywhere (no switch): what ``twin.learning`` installs for each digest. An unknown
    rank: its copies' address first, ``ranks`` last (until then its packets are accepted, not
    ``non_member``); a configured member: its copies' address only (its MAC address, which
    the job does not name); a second digest for a rank, from another address too: nothing;
    a rank counted as addressed only once its entries are written; when the job goes, every
    entry, in the reverse order."""
    from ncina.aggregator.backends.bmv2 import entries
    from ncina.aggregator.backends.tofino.twin import learning
    from ncina.aggregator.jobs import JobConfig
    from p4.v1 import p4data_pb2

    config = JobConfig.create(job=9, workers=3, k=K, result_format="int", pool_size=16,
                              members=[(1, ("10.0.0.7", 4000))])  # fmt: skip
    [job] = entries.place([config], 6, K)

    def digest(rank: int, ip: bytes, port: int) -> learning.Member:
        data = p4data_pb2.P4Data()
        for value in (b"\x09", bytes([rank]), bytes.fromhex("020000000003"), ip,
                      port.to_bytes(2, "big")):  # fmt: skip
            data.struct.members.add().bitstring = value
        return learning.decode(data)

    member = digest(0, bytes([10, 0, 0, 5]), 4001)
    assert member == learning.Member(9, 0, "02:00:00:00:00:03", "10.0.0.5", 4001)
    learned = learning.Learning(job)
    made = learned.entries(member)
    key = {"hdr.nc.job": "9", "hdr.nc.rank": "0"}
    assert made == [
        entries.Entry(learning.ADDRESSES_TABLE, {"hdr.bridge.job_index": "0",
                                                 "eg_md.egress_rid": "0"},
                      learning.ADDRESS_ACTION,
                      {"mac": "02:00:00:00:00:03", "ip": "10.0.0.5", "port": "4001"}),
        entries.Entry(learning.ADDRESSED_TABLE, key, "NoAction"),
        entries.Entry(learning.MEMBERS_TABLE, {**key, "hdr.ipv4.src": "10.0.0.5",
                                               "hdr.udp.src_port": "4001"}, "NoAction"),
        entries.Entry(learning.RANKS_TABLE, key, "NoAction"),
    ]  # fmt: skip
    assert learned.entries(digest(0, bytes([10, 0, 0, 6]), 4001)) == []  # another address
    assert learned.entries(member) == []
    configured = learned.entries(digest(1, bytes([10, 0, 0, 7]), 4000))
    assert [e.table for e in configured] == [learning.ADDRESSES_TABLE, learning.ADDRESSED_TABLE]
    # Until the entries are written, no rank is counted as addressed (nor its entries installed).
    assert learned.to_json() == {"digests": 4, "lists": 0, "members": 0, "entries_installed": 0,
                                 "duplicates": 2, "entries_removed": 0}  # fmt: skip
    assert learned.entries(member) == []  # pending: a duplicate too
    learned.installed()
    assert learned.to_json() == {"digests": 5, "lists": 0, "members": 2, "entries_installed": 6,
                                 "duplicates": 3, "entries_removed": 0}  # fmt: skip
    forgotten = learned.forget()
    assert forgotten == (made + configured)[::-1]
    assert learned.to_json()["members"] == 0 and learned.to_json()["entries_removed"] == 6
    assert learned.entries(member) == made  # learned again, as a new start would
