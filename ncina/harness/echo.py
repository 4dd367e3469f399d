"""The fabric's own packet limit (issue 36): a no-op echo through the same links at a job's
packet size, the yardstick of ``bench fabric``'s ``vs_fabric_limit``.

The socket backend's no-op forwarder (``ncina aggregator --backend socket --socket-mode
forward``: every datagram back to its sender, in C) serves on the aggregator's host; on every
worker host one process of this module (``python -m ncina.harness.echo``) runs the C closed
loop of ``bench aggregator`` (a window of K-element NC8 chunks outstanding, the next into a slot
when its echo is back) through one connected UDP socket, from one instant for a fixed time, and
writes its counters as JSON. It batches as the workers' C transfer does
(``ncd_gen_run_batched``): each refill's chunks go out as UDP GSO runs and the echoes come in as
UDP GRO buffers, each switched off by the same ``NCINA_UDP_GSO=0`` / ``NCINA_UDP_GRO=0`` as the
workers' (``ncina.worker.cpath``), so that with the links' offloads on its runs cross the veths,
the bridge and HTB whole as a job's do (one datagram a send would be no ceiling for such a job).
What came back answered is the work: :func:`limit_figures` turns the hosts' counters into
packets per second (each echo is two datagrams: the chunk up and its copy down, as a job's
chunk and its result), and the yardstick is refused (``ncina.harness.figures.refusal``) when
the echo answered nothing or retransmitted.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ncina.common.address import peer_address
from ncina.common.ratios import put_ratio, ratio, refusal, spread
from ncina.harness.figures import job_packets
from ncina.proto.job import JobSpec

JOB = 1


def limit_figures(hosts: Sequence[dict[str, Any]], frame_bytes: int, bw_mbit: float,
                  error: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The fabric's limit from each worker host's echo counters (``sent``, ``received``,
    ``completed``, ``retransmit_rounds``, ``seconds``; none when the echo failed with
    ``error``): ``fabric_limit_pps``, the datagrams per second the hosts moved both ways in
    completed echoes (2 a completed chunk, each host's over its own time, summed);
    ``fabric_limit_link_fraction``, the frames of ``frame_bytes`` (a job chunk's) one host's
    echo put on its ``bw_mbit`` uplink, the mean over the hosts; and ``fabric_limit_refused``,
    why it is no yardstick (None when it is)."""
    pps = sum(2 * h["completed"] / h["seconds"] for h in hosts if h["seconds"] > 0)
    rounds = sum(int(h["retransmit_rounds"]) for h in hosts)
    up_fps = [h["completed"] / h["seconds"] for h in hosts if h["seconds"] > 0]
    fill = (sum(up_fps) / len(up_fps) * frame_bytes * 8 / (bw_mbit * 1e6)) if up_fps else 0.0
    return {
        "fabric_limit_pps": round(pps),
        "fabric_limit_link_fraction": round(fill, 4),
        "fabric_limit_retransmit_rounds": rounds,
        "fabric_limit_refused": refusal(pps, retransmissions=rounds, error=error),
    }


def limit_ratio(
    repeats: list[dict[str, Any]], workers: int, elements: int, k: int
) -> dict[str, Any]:  # fmt: skip
    """INA's datagrams per second (its chunks up and results down, copies aside:
    ``ina_packets_per_s``) over the fabric's own limit at that packet size measured beside it
    (``fabric_limit_pps``): ``vs_fabric_limit`` of the medians, its spread over the runs, or
    None and ``vs_fabric_limit_refused`` when any run's echo is no yardstick."""
    packets = job_packets(workers, elements, k, 0)
    median = statistics.median_low
    ina_pps = packets / median(r["wall_s"] for r in repeats)
    limit = median(r["extra"]["fabric_limit_pps"] for r in repeats)
    refused = next((r["extra"]["fabric_limit_refused"] for r in repeats
                    if r["extra"]["fabric_limit_refused"]), None)  # fmt: skip
    figures: dict[str, Any] = {
        "ina_packets_per_s": round(ina_pps),
        "fabric_limit_pps": limit,
        "fabric_limit_link_fraction": median(r["extra"]["fabric_limit_link_fraction"]
                                             for r in repeats),
        "vs_fabric_limit_spread": None if refused else spread(
            ratio(packets / r["wall_s"], r["extra"]["fabric_limit_pps"]) for r in repeats),
    }  # fmt: skip
    put_ratio(figures, "vs_fabric_limit", ina_pps, limit, refused)
    return figures


def run_load(target: tuple[str, int], bind: str, k: int, window: int, seconds: float,
             retx_after: float, start_at: float) -> dict[str, Any]:  # fmt: skip
    """One host's echo load: wait until ``CLOCK_MONOTONIC`` reaches ``start_at`` (the same
    clock in every Mininet host), then run the closed loop for ``seconds``; its counters."""
    from ncina.aggregator.backends.dpdk.binding import load
    from ncina.proto.nc8 import Window
    from ncina.worker.cpath import udp_batching

    module = load()
    ffi, lib = module.ffi, module.lib
    rng = np.random.default_rng(0)
    codes = (rng.integers(1, 20, k) | (rng.integers(0, 2, k) << 7)).astype(np.uint8)
    st = ffi.new("struct ncd_gen_stats *")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind((bind, 0))
        s.connect(target)
        fds = ffi.new("int[]", [s.fileno()])
        time.sleep(max(0.0, start_at - time.monotonic()))
        gso, gro = udp_batching()
        rc = lib.ncd_gen_run_batched(fds, 1, JOB, Window.for_job(1).e_min, k, window, seconds,
                                     retx_after, ffi.from_buffer(codes), gso, gro, st)  # fmt: skip
    if rc != 0:
        raise ValueError(f"bad echo load parameters: k {k}, window {window}")
    return {"sent": int(st.sent), "received": int(st.received), "completed": int(st.completed),
            "retransmit_rounds": int(st.retransmit_rounds), "send_errors": int(st.send_errors),
            "seconds": float(st.seconds)}  # fmt: skip


def main(argv: list[str]) -> int:
    """``python -m ncina.harness.echo --target IP:PORT --bind IP --k K --window W --seconds S
    --retx-after S --start-at T --output FILE``: one host's echo load, its counters to FILE."""
    p = argparse.ArgumentParser(prog="ncina.harness.echo")
    p.add_argument("--target", type=peer_address, required=True)
    p.add_argument("--bind", required=True)
    JobSpec.add_arguments(p, "k", required=("k",))
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--retx-after", type=float, required=True)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args(argv)
    counters = run_load(args.target, args.bind, args.k, args.window, args.seconds,
                        args.retx_after, args.start_at)  # fmt: skip
    args.output.write_text(json.dumps(counters))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
