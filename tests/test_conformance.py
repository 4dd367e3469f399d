"""The conformance corpus (``ncina.proto.corpus``) replayed on every backend.

Every backend serves the corpus job from its own network namespace behind a veth into the
tests' bridge (``ncina.aggregator.backends.dpdk.netns``): the python and socket backends through the
namespace's kernel (a site with ``kernel=True``), dpdk (and bmv2) on the bare veth. The test
sends the same steps to each: ordinary datagrams from one UDP socket per rank (and one for a
stranger), odd ones (bad checksums, fragments, IP options ...) as raw Ethernet frames with the
same source addresses. After each case every rank sends a duplicate of its barrier slot's
contribution (``corpus.barrier``: the notice that answers it comes after everything the case
made), and the counters are read.

For every case the replies each address received (bytes, nothing masked: one --generation and
--seed) and the change of every counter must equal the Python reference's, on dpdk over both
af_packet and af_xdp (af_packet's kernel-side reassembly is the one documented exception:
``as_on_af_packet``). A few cases of the reference are pinned by hand, so that the reference
itself cannot drift unnoticed. Needs root (namespaces, raw frames); about 1 s per backend.

The corpus within the Tofino design's limits (``corpus.shape(TOFINO, result)``) is replayed the
same way on socket, dpdk (af_packet) and the twin (``bmv2-tofino``), all under
``--profile tofino``, against the Python reference under the profile (about 11 s on the twin).
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.aggregator.backends.bmv2.entries import NO_INT32
from ncina.aggregator.backends.dpdk import netns
from ncina.proto import corpus
from ncina.proto.descriptor import JOB_DATAGRAM_SIZE
from ncina.proto.header import FLAG_RESULT, FLAG_RETX, HEADER, SUM_DTYPES, Format
from ncina.proto.profiles import TOFINO, tofino_max_k
from ncina_testlib import AGGREGATOR_BACKENDS, TWIN, counters, is_nc8_rounding, wait_learned

from ncina.harness.aggregators import LOCAL_BACKENDS, START_TIMEOUT, RunningAggregator, wait_ready

pytestmark = pytest.mark.timeout(300)

CORPUS_FILE = Path(__file__).parent / "conformance" / "corpus.json"
SENDERS = (*range(corpus.WORKERS), corpus.STRANGER)


@dataclass
class Replay:
    """What one backend did with the corpus: per case, the datagrams each sender's address
    received (in order; ``corpus.STRANGER`` last) and the change of each counter."""

    replies: dict[str, list[list[bytes]]] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    shape: corpus.Shape = field(default_factory=corpus.shape)
    """The corpus replayed."""


def cases(shape: corpus.Shape | None = None) -> list[corpus.Case]:
    """The corpus of ``shape``: the file's for the default profile (None), else generated."""
    if shape is None or shape == corpus.shape():
        return corpus.load(CORPUS_FILE.read_text())
    return corpus.generate(shape)


def site_for(backend: str) -> tuple[netns.Star, netns.Site]:
    """A new site of the shared star for ``backend`` (skips without root, DPDK or P4)."""
    from ncina.aggregator.backends.bmv2 import toolchain
    from ncina.aggregator.backends.dpdk import binding

    reason = netns.missing()
    if reason is None and backend == "dpdk":
        reason = binding.missing()
    if reason is None and backend == "bmv2":
        reason = toolchain.missing()
    if reason:
        pytest.skip(f"{backend} backend: {reason}")
    star = netns.shared_star()
    return star, star.add_site(kernel=backend in LOCAL_BACKENDS)


def start(
    backend: str, site: netns.Site, workdir: Path, result: str, options: Sequence[str] = (),
    shape: corpus.Shape | None = None,
) -> RunningAggregator:  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    stats, log = workdir / "stats.json", workdir / "aggregator.log"
    arguments = [*corpus.job_arguments(result, shape), "--stats", str(stats), *options]
    with log.open("wb") as out:
        process = subprocess.Popen(site.aggregator_command(arguments, backend),
                                   stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip
    running = RunningAggregator(process, ("", 0), stats, log)
    return wait_ready(running)


def link_address(ip: str, dev: str) -> str:
    """The MAC the kernel resolved for ``ip`` on ``dev``."""
    out = subprocess.run(["ip", "neigh", "show", "to", ip, "dev", dev], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return out.split("lladdr ")[1].split()[0]


def replay(
    agg: RunningAggregator, star: netns.Star, site: netns.Site, shape: corpus.Shape | None = None
) -> Replay:
    """Send the corpus of ``shape``, case by case; record replies and counter changes."""
    out = Replay(shape=shape or corpus.shape())
    all_cases = cases(out.shape)
    opening = all_cases[0]
    assert opening.name == "open"
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in SENDERS]
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        for s in socks:
            s.bind((star.host_ip, 0))
            s.settimeout(START_TIMEOUT)
        raw.bind((site.peer, 0))
        src_mac = Path(f"/sys/class/net/{star.bridge}/address").read_text().strip()
        dst_mac = ""
        ping_replies: list[bytes] = []
        ip_id = 0
        if out.shape.profile == TOFINO:  # every rank learned before the corpus (the twin's digests)
            for step in corpus.introductions(out.shape):
                sock = socks[SENDERS.index(step.sender)]
                sock.sendto(step.datagram, agg.address)
                sock.sendto(step.datagram, agg.address)  # a duplicate: its notice says it was read
                sock.recv(0xFFFF)
            wait_learned(agg, corpus.WORKERS)
        before = counters(agg.stats(), corpus.JOB)
        for case in all_cases:
            for step in case.steps:
                sock = socks[SENDERS.index(step.sender)]
                if step.plain:
                    sock.sendto(step.datagram, agg.address)
                    continue
                ip_id += 1
                for frame in corpus.frames(step, src_mac=src_mac, dst_mac=dst_mac,
                                           src=sock.getsockname(), dst=agg.address,
                                           ip_id=ip_id):  # fmt: skip
                    raw.send(frame)
            got: list[list[bytes]] = [[] for _ in SENDERS]
            if not ping_replies:  # the opening reduction: one result to each rank
                got[: corpus.WORKERS] = [[socks[r].recv(0xFFFF)] for r in range(corpus.WORKERS)]
                dst_mac = link_address(agg.address[0], star.bridge)
            for rank in range(corpus.WORKERS):  # the barrier: its notice comes last
                socks[rank].sendto(corpus.barrier(rank, out.shape), agg.address)
                if len(ping_replies) <= rank:
                    ping_replies.append(socks[rank].recv(0xFFFF))
                    continue
                while (data := socks[rank].recv(0xFFFF)) != ping_replies[rank]:
                    got[rank].append(data)
            stranger = socks[-1]
            stranger.setblocking(False)
            try:
                while True:
                    got[-1].append(stranger.recv(0xFFFF))
            except BlockingIOError:
                pass
            stranger.settimeout(START_TIMEOUT)
            document = agg.stats()
            after = counters(document, corpus.JOB)
            out.replies[case.name] = got
            out.counters[case.name] = {k: after[k] - before[k] for k in after
                                       if after[k] != before[k]}  # fmt: skip
            before = after
        out.final = {"global": document["global"], "job": document["jobs"][str(corpus.JOB)]}
    finally:
        raw.close()
        for s in socks:
            s.close()
    return out


def run(
    backend: str, workdir: Path, result: str, options: Sequence[str] = (),
    shape: corpus.Shape | None = None,
) -> Replay:  # fmt: skip
    star, site = site_for(backend)
    agg = start(backend, site, workdir, result, options, shape)
    try:
        return replay(agg, star, site, shape)
    finally:
        assert agg.stop() == 0, agg.log()


@pytest.fixture(scope="module", params=corpus.RESULTS)
def result(request: pytest.FixtureRequest) -> str:
    """The corpus job's result format."""
    return request.param


@pytest.fixture(scope="module")
def reference(result: str, tmp_path_factory: pytest.TempPathFactory) -> Replay:
    return run("python", tmp_path_factory.mktemp(f"corpus-python-{result}"), result)


FRAME_ROOM = 2048
"""The largest frame DPDK's af_packet port delivers whole (its ring frames and mbufs)."""

PORT_FRAME = 1514
"""The largest frame BMv2 reads whole from a port of MTU 1500 (libpcap's ring frames)."""

AF_PACKET_ACCEPTS = ("transport_fragments_ip_checksum_bad",)
"""Cases whose odd datagram reaches the dpdk backend on af_packet although a host drops it."""

BMV2_ACCEPTS = ("transport_udp_checksum_bad",)
"""Cases whose odd datagram reaches the P4 switch although a host drops it (no UDP checksums)."""


def _copy(want: Replay) -> tuple[dict[str, dict[str, int]], dict[str, list[list[bytes]]]]:
    counters = {name: dict(change) for name, change in want.counters.items()}
    replies = {name: [list(r) for r in got] for name, got in want.replies.items()}
    return counters, replies


def _never_counted(change: dict[str, int], datagrams: Sequence[bytes]) -> None:
    """``datagrams`` never reach the protocol: each was a drop of the reference (the case's
    only drop reason), which is taken back."""
    reasons = [k for k in change if ".drops." in k]
    if datagrams and reasons:  # (a datagram the reference did not see either changes nothing)
        (reason,) = reasons
        section = reason.split(".")[0]
        change[f"{section}.packets_in"] -= len(datagrams)
        change[f"{section}.bytes_in"] -= sum(map(len, datagrams))
        change[reason] -= len(datagrams)


def _contribution(change: dict[str, int], replies: list[list[bytes]], case: corpus.Case,
                  arrives: bool) -> None:  # fmt: skip
    """Rank 0's odd contribution to a transport case arrives (the reference lost it) or is lost
    (the reference took it): its plain resend then asks for the stored result again, or is the
    contribution that completes the slot and gets no second copy."""
    result = replies[0][0]
    sign = 1 if arrives else -1
    if arrives:
        replies[0].append(result)
    else:
        replies[0].pop()
    for key, more in (("packets_in", 1), ("bytes_in", len(case.steps[0].datagram)),
                      ("results_resent", 1), ("packets_out", 1), ("bytes_out", len(result))):
        change[f"job.{key}"] = change.get(f"job.{key}", 0) + sign * more


def as_on_af_packet(want: Replay) -> Replay:
    """The reference as the dpdk backend on af_packet must answer it (docs/protocol.md,
    "Transport"): that port's socket has the kernel reassemble fragments before DPDK sees them
    (the PMD's fanout asks for it), which neither checks the fragments' IPv4 header checksums
    nor fits a packet larger than the ring frame (FRAME_ROOM bytes: it arrives truncated and is
    ignored). So in AF_PACKET_ACCEPTS rank 0's odd contribution arrives (its plain resend then
    gets the stored result), and a datagram of a larger packet is never counted (it can only be
    a drop). Everything else must be equal. On af_xdp and on a NIC the data plane reassembles
    and checks for itself: the dpdk-af_xdp variant answers exactly like the reference.
    """
    counters, replies = _copy(want)
    for case in cases(want.shape):
        change = counters[case.name]
        _never_counted(change, [s.datagram for s in case.steps
                                if len(s.datagram) + 42 > FRAME_ROOM])  # fmt: skip
        if case.name in AF_PACKET_ACCEPTS:
            _contribution(change, replies[case.name], case, arrives=True)
        counters[case.name] = {k: v for k, v in change.items() if v}
    return Replay(replies, counters, want.final, want.shape)


def beyond_datagram(step: corpus.Step) -> int:
    """Bytes of ``step``'s frame that are not its datagram nor the 42 of Ethernet, a 20-byte
    IPv4 header and UDP: IP options, a trailer after the UDP length, Ethernet padding."""
    (frame,) = corpus.frames(step, src_mac="02:00:00:00:00:01", dst_mac="02:00:00:00:00:02",
                             src=("10.0.0.1", 1), dst=("10.0.0.2", 2), ip_id=1)  # fmt: skip
    return len(frame) - 42 - len(step.datagram)


def as_on_bmv2(want: Replay) -> Replay:
    """The reference as the P4 switch must answer it (docs/bmv2.md, "Transport"). A pipeline
    does not reassemble: every fragment is dropped before the protocol, so a datagram the
    reference reassembled is lost there (rank 0's plain resend completes the slot), and one it
    dropped is never counted. A frame longer than the port's MTU never reaches the pipeline.
    UDP checksums are not verified (BMV2_ACCEPTS arrive). BMv2 counts frame bytes, so a
    datagram's bytes_in includes its frame's IP options, UDP trailer and Ethernet padding.
    """
    counters, replies = _copy(want)
    for case in cases(want.shape):
        change, got = counters[case.name], replies[case.name]
        unseen = [s for s in case.steps
                  if "fragment" in s.transport or len(s.datagram) + 42 > PORT_FRAME]  # fmt: skip
        if unseen and case.name.startswith("transport_") and len(got[0]) == 2:
            _contribution(change, got, case, arrives=False)
        else:
            _never_counted(change, [s.datagram for s in unseen])
        if case.name in BMV2_ACCEPTS:
            _contribution(change, got, case, arrives=True)
        if case.name.startswith("transport_") and len(got[0]) == 2 and not unseen:
            change["job.bytes_in"] += beyond_datagram(case.steps[0])
        counters[case.name] = {k: v for k, v in change.items() if v}
    return Replay(replies, counters, want.final, want.shape)


def final_as_in(want: Replay, reference: Replay) -> dict[str, Any]:
    """The reference's final counters with every case's change as ``want`` has it."""
    final = copy.deepcopy(reference.final)
    for case, change in want.counters.items():
        before = reference.counters[case]
        for key in set(change) | set(before):
            section, *path = key.split(".")
            where = final["global" if section == "global" else "job"]
            for name in path[:-1]:
                where = where[name]
            where[path[-1]] += change.get(key, 0) - before.get(key, 0)
    return final


def differences(backend: str, got: Replay, want: Replay) -> Iterator[str]:
    """One line per difference, naming the case and the field."""
    for case in want.counters:
        a, b = got.counters.get(case, {}), want.counters[case]
        for key in sorted(set(a) | set(b)):
            if a.get(key, 0) != b.get(key, 0):
                yield f"{case}: {key}: python {b.get(key, 0)}, {backend} {a.get(key, 0)}"
        for sender, mine, theirs in zip(SENDERS, got.replies.get(case, []),
                                        want.replies[case], strict=True):  # fmt: skip
            if mine != theirs:
                who = "stranger" if sender == corpus.STRANGER else f"rank {sender}"
                yield (f"{case}: replies to {who}: python {[d.hex() for d in theirs]}, "
                       f"{backend} {[d.hex() for d in mine]}")  # fmt: skip


def test_corpus_file_is_what_the_generator_writes() -> None:
    """tests/conformance/corpus.json is ``python -m ncina.proto.corpus`` of this tree."""
    assert CORPUS_FILE.read_text() == corpus.dump(corpus.generate()), (
        f"regenerate it: python -m ncina.proto.corpus {CORPUS_FILE}")


TOFINO_DOC = Path(__file__).parents[1] / "docs" / "tofino.md"
DESIGN_SECTION = "### The corpus within the design's limits"


def test_docs_list_the_cases_the_design_cannot_match() -> None:
    """docs/tofino.md's list of the cases the profile's corpus leaves out is the generator's:
    one item per reason (``profiles.LACKS``), naming its cases, in the generator's order."""
    text = TOFINO_DOC.read_text()
    section = text.split(DESIGN_SECTION, 1)[1].split("\n#", 1)[0]
    items = [" ".join(item.split("\n\n")[0].split()) for item in section.split("\n- ")[1:]]
    reasons: dict[str, list[str]] = {}
    for name, reason in corpus.left_out(corpus.shape(TOFINO)):
        reasons.setdefault(reason, []).append(f"`{name}`")
    assert items == [f"{', '.join(names)}: {reason}" for reason, names in reasons.items()]


def sums_match(data: bytes, result: str, exact: list[int]) -> bool:
    """Whether a result's payload is ``exact`` (int, int32) or rounds it as NC8 must (nc8)."""
    fmt = Format[result.upper()]
    if fmt in SUM_DTYPES:
        return np.frombuffer(data[16:], dtype=SUM_DTYPES[fmt]).tolist() == exact
    return len(data) == 16 + len(exact) and all(
        is_nc8_rounding(c, e) for c, e in zip(data[16:], exact, strict=True))


def test_reference_is_pinned_by_hand(result: str, reference: Replay) -> None:
    """Exact replies and counters of a few cases, worked out from docs/protocol.md."""
    flags = FLAG_RESULT | corpus.GENERATION << 3
    fmt = Format[result.upper()]
    for rank, (data,) in enumerate(reference.replies["open"][: corpus.WORKERS]):
        head = (1, flags, fmt, corpus.E_MIN, corpus.JOB, rank, 0, corpus.K, 0)
        assert HEADER.unpack_from(data) == head and sums_match(data, result, [3] * corpus.K)
    for case, code in (("window_edges", corpus.TOP), ("window_edges_int32", corpus.TOP_INT32)):
        top = 1 << (code - 1)
        edges = [3 * top, -3 * top, 3, -3, 0, 0] + [3 * top] * (corpus.K - 6)
        if fmt == Format.INT32 and code > corpus.TOP_INT32:  # above an int32 job's window
            assert reference.counters[case]["job.drops.bad_code"] == 3
            continue
        assert all(sums_match(d[0], result, edges) for d in reference.replies[case][:3])
    if fmt == Format.INT32:  # +-3 * 2**28, the int32 window's extremes, on the wire
        lanes = reference.replies["window_edges_int32"][0][0][16:24].hex()
        assert lanes == "30000000" "d0000000"
    pings = {"job.packets_in": 3, "job.duplicates": 3, "job.retx_seen": 3, "job.notices_sent": 3}
    # Rank 0's odd datagram is lost (the kernel drops it) or arrives; its plain resend then
    # completes the slot, or asks for the stored result again.
    lost = {**pings, "job.contributions": 3, "job.slots_completed": 1, "job.results_sent": 3}
    for name in ("udp_checksum_bad", "ip_checksum_bad", "fragment_first_only",
                 "fragment_middle_missing", "fragments_udp_checksum_bad", "udp_length_over",
                 "ip_length_over", "ip_ihl_4"):  # fmt: skip
        change = reference.counters[f"transport_{name}"]
        assert {k: change[k] for k in lost} == {**lost, "job.packets_in": 6, "job.retx_seen": 4}
        assert "job.results_resent" not in change, name
    for name in ("udp_checksum_none", "ip_options_nop", "fragments_in_order",
                 "fragments_tiny", "udp_trailer", "ethernet_padding"):  # fmt: skip
        change = reference.counters[f"transport_{name}"]
        assert change["job.contributions"] == 3 and change["job.results_resent"] == 1, name
    assert reference.counters["truncated_0"] == {
        **pings, "global.packets_in": 1, "global.drops.truncated": 1,
        "job.packets_out": 3, "job.bytes_in": 3 * 32, "job.bytes_out": 3 * 24,
    }  # fmt: skip
    # Issue 27, finding 5, and issue 37: a burst of 4 resends of one round's result to a member,
    # then resend_limit (within RESEND_INTERVAL: the case's datagrams go at once);
    # issue 38: a stale packet of one code gets a restart notice (the header alone).
    change = reference.counters["resend_limit"]
    assert change["job.results_resent"] == 4 and change["job.drops.resend_limit"] == 2
    change = reference.counters["stale_generation_short"]
    assert change["job.drops.stale_generation"] == 1 and change["job.notices_sent"] == 4  # pings
    assert change["job.bytes_out"] == reference.counters["truncated_0"]["job.bytes_out"] + 16
    assert reference.counters["oversized_fragmented"]["job.drops.bad_count"] == 1
    # Issue 37: the generation from a rank that said no hello to this start is stale (a
    # restart notice, the header alone), and a probe's answer carries RETX (not joined).
    notice, answer, again = reference.replies["generation_not_joined"][0][:3]
    assert notice == again and len(notice) == 16
    assert HEADER.unpack(notice)[:5] == (1, flags, fmt, corpus.E_MIN, corpus.JOB)
    assert HEADER.unpack_from(answer)[1] == flags | FLAG_RETX and len(answer) == JOB_DATAGRAM_SIZE
    change = reference.counters["generation_not_joined"]
    assert change["job.drops.stale_generation"] == 2 and change["job.handshakes"] == 1
    assert reference.counters["generation_stamped"]["job.slots_completed"] == 1
    assert reference.final["global"]["drops"]["internal_error"] == 0


VARIANTS = {"dpdk-af_xdp": ("dpdk", ["--dpdk-pmd", "af_xdp"])}


@pytest.mark.parametrize(
    "variant", [b for b in AGGREGATOR_BACKENDS if b not in ("python", TWIN)] + list(VARIANTS)
)
def test_backend_answers_the_corpus_like_the_reference(
    variant: str, result: str, reference: Replay, tmp_path: Path
) -> None:
    # (The twin answers the corpus within the Tofino design's limits: below.)
    if variant == "bmv2" and result == "int32":
        pytest.skip(NO_INT32)
    backend, options = VARIANTS.get(variant, (variant, []))
    got = run(backend, tmp_path, result, options)
    exceptions = {"dpdk": as_on_af_packet, "bmv2": as_on_bmv2}
    want = exceptions[variant](reference) if variant in exceptions else reference
    found = list(differences(variant, got, want))
    assert not found, f"{len(found)} differences:\n" + "\n".join(found[:40])
    assert got.final == final_as_in(want, reference)


@pytest.fixture(scope="module")
def profile_reference(result: str, tmp_path_factory: pytest.TempPathFactory) -> Replay:
    """The Python reference's answers to the corpus within the Tofino design's limits
    (``corpus.shape(TOFINO, result)``, the job under ``--profile tofino``)."""
    workdir = tmp_path_factory.mktemp(f"corpus-python-tofino-{result}")
    return run("python", workdir, result, shape=corpus.shape(TOFINO, result))


def test_profile_reference_is_pinned_by_hand(result: str, profile_reference: Replay) -> None:
    """Under the profile the window's top code is 31 - ceil(log2 3) = 29 for every result
    format: three ranks' top codes sum to +-3 * 2**28, within a signed 32-bit lane, and code 30
    (the default profile's window takes it) is bad_code before anything is added."""
    shape = profile_reference.shape
    assert (shape.top, shape.top_int32) == (29, 29) and shape.k == tofino_max_k(result)
    flags = FLAG_RESULT | corpus.GENERATION << 3
    fmt = Format[result.upper()]
    for rank, (data,) in enumerate(profile_reference.replies["open"][: corpus.WORKERS]):
        head = (1, flags, fmt, corpus.E_MIN, corpus.JOB, rank, 0, shape.k, 0)
        assert HEADER.unpack_from(data) == head and sums_match(data, result, [3] * shape.k)
    edges = [3 << 28, -3 << 28, 3, -3, 0, 0] + [3 << 28] * (shape.k - 6)
    for case in ("window_edges", "window_edges_int32"):
        assert all(sums_match(d[0], result, edges) for d in profile_reference.replies[case][:3])
    change = profile_reference.counters["code_0x1e"]
    assert change["job.drops.bad_code"] == 1 and "job.contributions" not in change
    assert profile_reference.final["global"]["drops"]["internal_error"] == 0


PROFILE_VARIANTS = {TWIN: ("bmv2", [])}
"""The twin is bmv2 under the profile (dpdk on af_xdp differs from af_packet in transport
only, which the design's corpus leaves out: not run)."""


@pytest.mark.parametrize("variant", ["socket", "dpdk", *PROFILE_VARIANTS])
def test_backend_answers_the_profile_corpus_like_the_reference(
    variant: str, result: str, profile_reference: Replay, tmp_path: Path
) -> None:
    """The corpus within the Tofino design's limits, every backend under ``--profile tofino``
    (on bmv2 the twin, p4/twin/), byte for byte and counter for counter as the reference, with
    no exception: it holds no case of the transport rule's (``as_on_af_packet``,
    ``as_on_bmv2``), which the design lacks."""
    if variant == TWIN and result == "int":
        pytest.skip("the twin's int lanes are its int32 lanes sign-extended to 64 bits: the "
                    "int32 corpus and the packet scenarios' int cases cover them (suite time)")
    backend, options = PROFILE_VARIANTS.get(variant, (variant, []))
    got = run(backend, tmp_path, result, options, profile_reference.shape)
    found = list(differences(variant, got, profile_reference))
    assert not found, f"{len(found)} differences:\n" + "\n".join(found[:40])
    assert got.final == profile_reference.final


@pytest.mark.parametrize("backend", ["dpdk", "bmv2"])
@pytest.mark.parametrize("source", ["01:00:5e:00:00:01", "ff:ff:ff:ff:ff:ff", "00:00:00:00:00:00"])
def test_a_frame_from_a_group_or_zero_source_gets_no_reply(
    backend: str, source: str, tmp_path: Path
) -> None:
    """The data planes that answer at L2 (to the frame's Ethernet source) ignore a frame from a
    group or the zero address: its answer would go to the whole segment (issue 27, finding 7).
    Rank 0 asks again for the opening slot's stored result, once in such a frame and once
    plainly: one result comes back, and the frame counts as ignored."""
    star, site = site_for(backend)
    agg = start(backend, site, tmp_path, "int")
    opening = cases()[0]
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(corpus.WORKERS)]
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        for s in socks:
            s.bind((star.host_ip, 0))
            s.settimeout(START_TIMEOUT)
        raw.bind((site.peer, 0))
        for step in opening.steps:
            socks[step.sender].sendto(step.datagram, agg.address)
        result = socks[0].recv(0xFFFF)
        before = agg.stats()[backend]["ignored"]
        again = corpus.Step(0, corpus.retransmission(opening.steps[0].datagram))
        assert HEADER.unpack_from(result)[6] == HEADER.unpack_from(again.datagram)[6]  # its slot
        (frame,) = corpus.frames(again, src_mac=source,
                                 dst_mac=link_address(agg.address[0], star.bridge),
                                 src=socks[0].getsockname(), dst=agg.address, ip_id=1)  # fmt: skip
        raw.send(frame)
        socks[0].sendto(again.datagram, agg.address)
        assert socks[0].recv(0xFFFF) == result
        socks[0].settimeout(0.5)
        with pytest.raises(TimeoutError):  # nothing else: the odd frame was not answered
            socks[0].recv(0xFFFF)
        ignored = agg.stats()[backend]["ignored"] - before
        # (The DPDK port's count takes in any other frame it is not for: the bridge floods.)
        assert ignored == 1 if backend == "bmv2" else ignored >= 1
    finally:
        raw.close()
        for s in socks:
            s.close()
        assert agg.stop() == 0, agg.log()


def test_the_tests_star_queues_each_direction_on_one_cpu() -> None:
    """The replays send a case's steps back to back, from several sockets and a packet socket,
    and compare each address's answers in order: the corpus's order is the claim. A veth
    queues a frame on its sender's CPU, so a sender that changes CPU could see a later frame
    overtake an earlier one; both ends of each of the star's veths steer every frame they
    receive to one CPU's queue instead (``netns.steer_to_one_cpu``), one FIFO each way."""
    _, site = site_for("python")
    mask = 1 << min(os.sched_getaffinity(0))
    for dev, where in ((site.peer, []), (site.iface, ["ip", "netns", "exec", site.ns])):
        read = f"cat /sys/class/net/{dev}/queues/rx-*/rps_cpus"
        masks = subprocess.run([*where, "sh", "-c", read], capture_output=True, text=True,
                               check=True).stdout.split()  # fmt: skip
        assert masks and {int(m.replace(",", ""), 16) for m in masks} == {mask}, (dev, masks)
