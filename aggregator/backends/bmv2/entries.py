"""What the control plane installs on the switch, as plain data: table entries and multicast
groups for the aggregator's address, each job and L2 forwarding, and how the switch's event
counters become the stats document. ``control`` pushes and reads these over P4Runtime; keeping
them here lets every decision be listed and tested without a switch.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ncina.aggregator.backends.bmv2.gen import high_bit_rows
from ncina.aggregator.backends.bmv2.layout import (
    COUNTED,
    FLOOD_GROUP,
    GLOBAL_EVENTS,
    JOB_EVENTS,
    MAX_JOBS,
    SLOTS,
    TRANSPORT_EVENTS,
)
from ncina.aggregator.backends.python.admission import STALE_GENERATION
from ncina.aggregator.backends.python.handshake import RESTART_IDLE
from ncina.aggregator.jobs import JobConfig
from ncina.aggregator.stats import GlobalStats, JobStats
from ncina.proto.descriptor import JOB_DATAGRAM_SIZE
from ncina.proto.header import ELEMENT_SIZE, NOTICE, Format
from ncina.proto.profiles import TOFINO
from ncina.proto.wire import (
    ETH_IPV4_UDP_HEADERS,
    ETH_IPV4_UDP_NCINA_HEADERS,
    HEADER_SIZE,
    MAX_WORKERS,
)

# P4Info names of what the control plane touches (p4/ncina.p4 and its controls).
LOCAL_TABLE = "NcinaIngress.local_address"
LOCAL_ACTION = "NcinaIngress.aggregator"
JOBS_TABLE = "NcinaIngress.admission.jobs"
JOB_ACTION = "NcinaIngress.admission.set_job"
MEMBERS_TABLE = "NcinaIngress.admission.members.members"
MEMBER_ACTION = "NcinaIngress.admission.members.expect"
L2_TABLE = "NcinaIngress.forward.l2"
L2_ACTION = "NcinaIngress.forward.to_port"
LANE_TABLE = "NcinaIngress.slots.sums.high_{lane}"
LANE_ACTION = "NcinaIngress.slots.sums.round_{lane}"
LANE_KEY = "meta.lane_magnitude"
JOB_COUNTER = "job_events"
GLOBAL_COUNTER = "global_events"
TRANSPORT_COUNTER = "transport_events"


@dataclass(frozen=True)
class Entry:
    """One table entry: exact-match fields and the action's parameters, as P4Runtime-shell
    takes them (strings: decimal numbers, dotted IPv4 addresses, colon-separated MACs)."""

    table: str
    match: Mapping[str, str]
    action: str
    params: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    """A multicast group: ``replicas`` are ``(egress port, instance)`` pairs."""

    group: int
    replicas: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class InstalledJob:
    """Where a job lives on the switch: its index (counters, members, multicast group
    ``index + 1``), its first slot version in the registers, and the seed of its nc8 results
    (``JobConfig.result_seed``: the job's ``--seed``, or one drawn when it is placed)."""

    config: JobConfig
    index: int
    slot_base: int
    generation: int
    seed: int


NO_INT32 = ("the bmv2 backend does not return int32 results (--result): the P4 program's lanes "
            "return nc8 codes or 64-bit int sums")
"""Why the bmv2 backend refuses a job of int32 results (and the tests skip them)."""


def check_job(config: JobConfig) -> None:
    """Refuse what the P4 program cannot do for a job, with the reason."""
    if config.key is not None:
        raise ValueError("the bmv2 backend does not implement the authentication tag (--key-file)")
    if config.workers > MAX_WORKERS:
        raise ValueError(f"the bmv2 backend holds at most {MAX_WORKERS} workers per job")
    if config.result_format == Format.INT32 and config.profile != TOFINO:  # the twin returns them
        raise ValueError(NO_INT32)


def place(configs: Sequence[JobConfig], generation: int, k: int) -> list[InstalledJob]:
    """Give each job an index and a range of slot versions; refuse what does not fit."""
    if len(configs) > MAX_JOBS:
        raise ValueError(f"the bmv2 program holds at most {MAX_JOBS} jobs, not {len(configs)}")
    placed, base = [], 0
    for index, config in enumerate(configs):
        check_job(config)
        if config.k > k:
            raise ValueError(f"job {config.job} has K={config.k}, the program was built for {k}")
        if base + 2 * config.pool_size > SLOTS:
            raise ValueError(
                f"job {config.job}'s pool of {config.pool_size} slots does not fit: the program "
                f"has {SLOTS} slot versions for all jobs (2 per slot)"
            )
        placed.append(InstalledJob(config, index, base, generation, config.result_seed()))
        base += 2 * config.pool_size
    return placed


def local_entry(ip: str, port: int, mac: str, generation: int) -> Entry:
    """The aggregator's own address: ARP answered, ncina datagrams to its UDP ``port``
    aggregated; ``generation`` stamps the answers to a job handshake for no job."""
    return Entry(LOCAL_TABLE, {"meta.target": ip}, LOCAL_ACTION,
                 {"mac": mac, "port": str(port), "generation": str(generation)})  # fmt: skip


def lane_entries(k: int) -> list[Entry]:
    """Each of the ``k`` lanes' table of highest set bits (``gen.high_bit_rows``), the same
    for every job: 64 LPM entries a lane."""
    return [Entry(LANE_TABLE.format(lane=lane), {LANE_KEY: f"{value:#x}/{prefix}"},
                  LANE_ACTION.format(lane=lane), {n: str(v) for n, v in args.items()})
            for lane in range(k) for value, prefix, args in high_bit_rows()]  # fmt: skip


def job_entries(job: InstalledJob, restart_idle: float = RESTART_IDLE) -> list[Entry]:
    """The job's row in the jobs table and its configured members; ``restart_idle``: the
    seconds it must be quiet before a hello restarts it (``--restart-idle``)."""
    c = job.config
    params = {
        "index": job.index,
        "workers": c.workers,
        "k": c.k,
        "pool": c.pool_size,
        "slot_base": job.slot_base,
        "emin": c.window.e_min & 0xFF,  # the header's signed byte, as the switch compares it
        "e_max": c.window.e_max & 0xFF,  # the job handshake's descriptor, a signed byte too
        "max_code": c.window.max_code,
        "result_format": int(c.result_format),
        "generation": job.generation,
        "seed": job.seed,
        "restart_idle": round(restart_idle * 1e6),  # BMv2's ingress clock counts microseconds
    }
    entries = [Entry(JOBS_TABLE, {"hdr.nc.job": str(c.job)}, JOB_ACTION,
                     {name: str(value) for name, value in params.items()})]  # fmt: skip
    for rank, (host, port) in sorted(c.members.items()):
        entries.append(
            Entry(MEMBERS_TABLE, {"meta.job_index": str(job.index), "hdr.nc.rank": str(rank)},
                  MEMBER_ACTION, {"ip": str(ipaddress.IPv4Address(host)), "port": str(port)})
        )  # fmt: skip
    return entries


def job_group(job: InstalledJob, ports: Mapping[int, int]) -> Group:
    """The job's multicast group: one replica per rank (instance = rank, which egress writes
    into the copy's header), out of the rank's switch port (``ports``: rank -> port)."""
    return Group(job.index + 1, tuple((ports[rank], rank) for rank in range(job.config.workers)))


def flood_group(ports: Sequence[int]) -> Group:
    """Every port, for frames the L2 table does not know (egress skips the ingress port)."""
    return Group(FLOOD_GROUP, tuple((port, 0) for port in sorted(ports)))


def l2_entries(hosts: Mapping[str, int]) -> list[Entry]:
    """Known hosts: MAC address -> switch port."""
    return [Entry(L2_TABLE, {"hdr.eth.dst": mac}, L2_ACTION, {"port": str(port)})
            for mac, port in sorted(hosts.items())]  # fmt: skip


Counts = Mapping[int, tuple[int, int]]
"""Counter readings: index -> (packets, bytes)."""


def job_stats(job: InstalledJob, counts: Counts) -> JobStats:
    """The job's stats section from its event counters.

    BMv2 counts the bytes of the frame that caused an event: UDP payload bytes are the frame's
    minus ``ETH_IPV4_UDP_HEADERS``. A result has the 16-byte header and ``count`` elements of the
    job's result format, and ``count`` is the count of the uplink that completed or asked for
    it, so ``sum(count)`` over results is (frame bytes - ``ETH_IPV4_UDP_NCINA_HEADERS`` *
    results); a notice is 24 bytes, but the restart notice that answers each
    ``stale_generation`` drop is the 16-byte header alone.
    """
    base = job.index * len(JOB_EVENTS)
    event = {name: counts.get(base + i, (0, 0)) for i, name in enumerate(JOB_EVENTS)}
    stats = JobStats()
    for name in COUNTED:
        setattr(stats, name, event[name][0])
    for reason in stats.drops:
        stats.drops[reason] = event[reason][0]
    stats.bytes_in = event["packets_in"][1] - ETH_IPV4_UDP_HEADERS * stats.packets_in
    size = ELEMENT_SIZE[job.config.result_format]
    results = stats.results_sent + stats.results_resent
    elements = sum(event[name][1] for name in ("results_sent", "results_resent")) - (
        ETH_IPV4_UDP_NCINA_HEADERS * results)
    stats.packets_out = results + stats.notices_sent + stats.handshakes
    bitmaps = stats.notices_sent - stats.drops[STALE_GENERATION]
    stats.bytes_out = HEADER_SIZE * (results + stats.notices_sent) + size * elements + (
        NOTICE.size * bitmaps + JOB_DATAGRAM_SIZE * stats.handshakes)
    return stats


def global_stats(counts: Counts) -> GlobalStats:
    """The global section: every global event is a drop of a datagram no job claims."""
    stats = GlobalStats()
    for i, reason in enumerate(GLOBAL_EVENTS):
        packets, frame_bytes = counts.get(i, (0, 0))
        stats.drops[reason] = packets
        stats.packets_in += packets
        stats.bytes_in += frame_bytes - ETH_IPV4_UDP_HEADERS * packets
    return stats


def transport_stats(counts: Counts) -> dict[str, int]:
    """The stats document's ``bmv2`` section: packets to the aggregator that no host would
    deliver as a datagram, by reason (``TRANSPORT_EVENTS``)."""
    return {reason: counts.get(i, (0, 0))[0] for i, reason in enumerate(TRANSPORT_EVENTS)}
