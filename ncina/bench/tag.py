"""``ncina bench tag``: what the authentication tag costs an aggregator per packet.

The same recorded uplink schedule (``--workers`` ranks, chunks of ``--k`` NC8 codes, every slot
completing) goes through each backend's packet logic without any I/O, once for an untagged job
and once for a keyed one, alternating, ``--repeat`` times; the figures are medians.

- Python: ``ncina.aggregator.backends.python.pipeline.Aggregator.handle`` on datagrams (hashlib's
  BLAKE2b checks each uplink tag and tags every result);
- DPDK: the C engine on Ethernet frames through ``ncd_process_frame`` (the data plane's own
  BLAKE2b). Each call crosses cffi, which costs more than the engine itself, so the packets/s
  here are far below the data plane's; the difference of the per-packet times, keyed minus
  untagged (``tag_ns_per_packet``), is the tag's own cost either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.jobs import JobConfig
from ncina.common.options import deprecated_alias
from ncina.common.progress import progress
from ncina.proto import tag
from ncina.proto.header import FLAG_TAG, pack
from ncina.proto.job import JobSpec

JOB = 5
KEY = bytes(range(1, 33))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench tag``."""
    p = subparsers.add_parser(
        "tag",
        help="per-packet cost of the authentication tag in the Python and DPDK packet logic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    JobSpec.add_arguments(p, "workers", "k", workers=4, k=256)
    p.add_argument("--chunks", type=int, default=4000, help="chunks per rank (default: 4000)")
    repeat = p.add_argument("--repeat", type=int, default=5, help="default: %(default)s")
    deprecated_alias(p, "--repeats", repeat)
    return p


def schedule(config: JobConfig, chunks: int, key: bytes | None) -> list[tuple[bytes, int]]:
    """(datagram, rank) of every rank for every chunk, SwitchML order, tagged with ``key``."""
    rng = np.random.default_rng(1)
    top = config.window.max_code
    out = []
    for chunk in range(chunks):
        slot, pool = chunk % config.pool_size, (chunk // config.pool_size) % 2
        for rank in range(config.workers):
            codes = rng.integers(0, top + 1, config.k, dtype=np.uint8).tobytes()
            flags = (4 if pool else 0) | (FLAG_TAG if key is not None else 0)
            datagram = pack(job=JOB, rank=rank, slot=slot, offset=chunk * config.k,
                            count=config.k, emin=config.window.e_min, flags=flags,
                            payload=codes)  # fmt: skip
            out.append((datagram if key is None else tag.sign(key, datagram), rank))
    return out


def python_seconds(config: JobConfig, packets: Sequence[tuple[bytes, int]]) -> float:
    """Seconds for the reference logic to handle ``packets`` (and build every result)."""
    aggregator = Aggregator(generation=3)
    aggregator.add_job(config)
    sources = [("10.0.0.1", 5000 + r) for r in range(config.workers)]
    handle = aggregator.handle
    began = time.perf_counter()
    for datagram, rank in packets:
        handle(datagram, sources[rank])
    return time.perf_counter() - began


def dpdk_seconds_factory() -> Callable[[JobConfig, Sequence[tuple[bytes, int]]], float] | None:
    """The C engine's timer, or None when the DPDK extension cannot be built here."""
    from ncina.aggregator.backends.dpdk import binding

    if binding.missing() is not None:
        return None
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from ncina.aggregator.backends.dpdk.driver import DataPlane

    plane = DataPlane(binding.load())
    ffi, lib = plane.ffi, plane.lib
    out = ffi.new("uint8_t[]", 2048 * 64)
    lens = ffi.new("uint32_t[64]")
    process = lib.ncd_process_frame

    def seconds(config: JobConfig, packets: Sequence[tuple[bytes, int]]) -> float:
        lib.nce_reset()
        plane.set_mac("02:00:00:00:0a:01")
        plane.set_address(("10.0.0.254", 47000))
        plane.set_generation(3)
        plane.add_job(config)
        frames = [
            bytes(Ether(src="02:00:00:00:0b:01", dst="02:00:00:00:0a:01")
                  / IP(src="10.0.0.1", dst="10.0.0.254") / UDP(sport=5000 + rank, dport=47000)
                  / datagram)
            for datagram, rank in packets
        ]
        began = time.perf_counter()
        for frame in frames:
            process(frame, len(frame), out, 2048, 64, lens)
        took = time.perf_counter() - began
        lib.nce_reset()
        return took

    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Median packets/s of each backend's logic, untagged and keyed, and their ratio."""
    job = JobSpec.from_args(args, job=JOB, result="nc8")
    plain = JobConfig.from_spec(job, seed=1)
    keyed = JobConfig.from_spec(dataclasses.replace(job, key=KEY), seed=1)
    packets = {"untagged": schedule(plain, args.chunks, None),
               "keyed": schedule(keyed, args.chunks, KEY)}  # fmt: skip
    configs = {"untagged": plain, "keyed": keyed}
    timers: dict[str, Callable[[JobConfig, Sequence[tuple[bytes, int]]], float]] = {
        "python": python_seconds
    }
    dpdk = dpdk_seconds_factory()
    if dpdk is not None:
        timers["dpdk"] = dpdk
    n = len(packets["untagged"])
    figures: dict[str, Any] = {"workers": args.workers, "k": args.k, "packets": n}
    for backend, timer in timers.items():
        runs: dict[str, list[float]] = {"untagged": [], "keyed": []}
        for _ in progress(range(args.repeat), desc=f"bench tag {backend}", unit="run"):
            for kind in runs:
                runs[kind].append(timer(configs[kind], packets[kind]))
        rates = {kind: n / statistics.median(seconds) for kind, seconds in runs.items()}
        figures[backend] = {
            "untagged_packets_per_s": round(rates["untagged"]),
            "keyed_packets_per_s": round(rates["keyed"]),
            "keyed_vs_untagged": round(rates["keyed"] / rates["untagged"], 3),
            "tag_ns_per_packet": round(1e9 * (1 / rates["keyed"] - 1 / rates["untagged"])),
        }
    return figures
