"""The P4 program's build parameters and counter layout: the one place both the generator
(``config.p4``) and the control plane (reading counters into the stats document) take them from.
"""

from __future__ import annotations

from ncina.aggregator.backends.python.slots import RESEND_BURST, RESEND_INTERVAL
from ncina.aggregator.stats import GLOBAL_DROP_REASONS, JOB_COUNTERS, JOB_DROP_REASONS
from ncina.proto.wire import MAX_WORKERS

DEFAULT_K = 64
"""Lanes (elements per packet) compiled in by default; a job's K may be smaller."""

MAX_JOBS = 16
"""Jobs one switch holds at once (table and counter sizes)."""

SLOTS = 2048
"""Slot versions in the registers, shared by all jobs (a job takes 2 * pool size of them)."""

FLOOD_GROUP = MAX_JOBS + 1
"""Multicast group of every port, for frames L2 switching floods; job ``i`` uses group ``i + 1``
(BMv2's pre refuses large group ids)."""

DERIVED = ("bytes_in", "packets_out", "bytes_out")
"""Job counters the control plane derives from others: BMv2 counts frames, the stats count UDP
payloads (``entries.job_stats``)."""

COUNTED: tuple[str, ...] = tuple(c for c in JOB_COUNTERS if c not in DERIVED)
"""Job counters the switch counts itself, ``packets_in`` first."""

JOB_EVENTS: tuple[str, ...] = (*COUNTED, *JOB_DROP_REASONS)
"""Counter ``job_index * len(JOB_EVENTS) + i`` counts event ``JOB_EVENTS[i]`` of that job;
``packets_in`` is first, so index 0 never names a drop reason (the P4 code uses 0 as none)."""

GLOBAL_EVENTS: tuple[str, ...] = tuple(r for r in GLOBAL_DROP_REASONS if r != "internal_error")
"""Counter ``i`` of ``global_events`` counts drop reason ``GLOBAL_EVENTS[i]`` (a switch has no
internal errors to count)."""

TRANSPORT_EVENTS: tuple[str, ...] = ("bad_checksum", "fragments", "ignored")
"""Counter ``i`` of ``transport_events`` counts IPv4 packets to the aggregator that no host
would deliver as a datagram (p4/transport.p4), by ``TRANSPORT_EVENTS[i]``: the names of the DPDK
port's counters for the same drops."""


def defines(k: int) -> dict[str, int]:
    """The ``#define``s of ``config.p4`` for ``k`` lanes."""
    values = {
        "NCINA_K": k,
        "NCINA_JOBS": MAX_JOBS,
        "NCINA_MAX_WORKERS": MAX_WORKERS,
        "NCINA_SLOTS": SLOTS,
        "NCINA_FLOOD_GROUP": FLOOD_GROUP,
        "NCINA_JOB_EVENTS": len(JOB_EVENTS),
        "NCINA_GLOBAL_EVENTS": len(GLOBAL_EVENTS),
        "NCINA_TRANSPORT_EVENTS": len(TRANSPORT_EVENTS),
        "NCINA_RESEND_BURST": RESEND_BURST,
        "NCINA_RESEND_INTERVAL_US": round(RESEND_INTERVAL * 1e6),  # BMv2's clock: microseconds
    }
    values.update({f"EV_{name.upper()}": i for i, name in enumerate(JOB_EVENTS)})
    values.update({f"EV_G_{name.upper()}": i for i, name in enumerate(GLOBAL_EVENTS)})
    values.update({f"EV_T_{name.upper()}": i for i, name in enumerate(TRANSPORT_EVENTS)})
    return values
