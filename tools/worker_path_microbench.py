"""Micro-benchmark of a worker's packet path at K = 64 (issue 36 item 3): the CPU one 122-byte
datagram costs per way of handing it to the kernel, on one veth pair.

Two network namespaces joined by a veth pair with the links' offloads on (as ``bench fabric``'s
default) and tc HTB on the sending end (at 10 Gbit/s: its cost, not its shaping), one process
per end (``tools/worker_path_microbench.c``, built here with ``cc -O2``). Each variant sends at
the same paced rate (``--rate`` datagrams a second, bursts of 32) for ``--seconds``; the figure
is CPU ns per datagram received: the sender's process (a veth delivers in the sender's context,
so the receiver's kernel stack up to its socket or ring is in it), the receiver's, and their
sum (``both_ns``). Softirq work in ``ksoftirqd`` is in neither: the machine's busy time is no
measure on a shared machine, so none is taken. Variants (``send`` mode / ``recv`` mode):

- ``udp``: one datagram a ``sendmmsg`` message / UDP GRO socket;
- ``gso``: ``sendmmsg`` of one UDP GSO run of 32 datagrams (worker/transfer.c) / UDP GRO socket;
- ``ring``: an AF_PACKET TPACKET_V2 TX ring through the qdisc, 32 frames a kick / GRO socket;
- ``ring_bypass``: the same with PACKET_QDISC_BYPASS (skips HTB: unusable on the fabric);
- ``vnet_gso``: AF_PACKET with a virtio-net header, one UDP GSO frame of 32 datagrams a send,
  through the qdisc / GRO socket;
- ``rx_ring``: the worker's receive side: ``gso`` runs received by a TPACKET_V3 RX ring (the IP
  stack's copy dropped in netfilter's raw
  PREROUTING) instead of the GRO socket (``rx_gro``, the same pair with
  the GRO socket, is its baseline).

Run as root, under the shared network lock: ``/work/netlock .venv/bin/python
tools/worker_path_microbench.py`` (about a minute; ``--only NAME,...``, ``--repeat``); prints
one JSON document, lower medians over the repeats and each repeat's values. docs/performance.md,
"The workers' packet path: the options measured", has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "worker_path_microbench.c"
PORT = 47000
SRC_IP, DST_IP = "10.250.0.1", "10.250.0.2"
VARIANTS = {  # name: (send mode, recv mode)
    "udp": ("udp", "gro"),
    "gso": ("gso", "gro"),
    "ring": ("ring", "gro"),
    "ring_bypass": ("ring_bypass", "gro"),
    "vnet_gso": ("vnet_gso", "gro"),
    "rx_gro": ("gso", "gro"),
    "rx_ring": ("gso", "ring"),
}


def sh(*args: str) -> str:
    """Run a command, its stdout; raises on failure with its stderr."""
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


class Pair:
    """Two namespaces ``a`` (the sender) and ``b`` joined by a veth, HTB on ``a``'s end; removed
    on exit."""

    def __init__(self) -> None:
        tag = os.getpid()
        self.a, self.b = f"wpa{tag}", f"wpb{tag}"
        self.ia, self.ib = f"wpa{tag}e", f"wpb{tag}e"

    def __enter__(self) -> Pair:
        sh("ip", "netns", "add", self.a)
        sh("ip", "netns", "add", self.b)
        sh("ip", "link", "add", self.ia, "netns", self.a, "type", "veth", "peer", "name", self.ib,
           "netns", self.b)  # fmt: skip
        for ns, iface, ip in ((self.a, self.ia, SRC_IP), (self.b, self.ib, DST_IP)):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", iface)
            sh("ip", "-n", ns, "link", "set", iface, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", self.a, "tc", "qdisc", "add", "dev", self.ia, "root", "handle",
           "1:", "htb", "default", "1")  # fmt: skip
        sh("ip", "netns", "exec", self.a, "tc", "class", "add", "dev", self.ia, "parent", "1:",
           "classid", "1:1", "htb", "rate", "10gbit")  # fmt: skip
        self.mac_b = json.loads(sh("ip", "-n", self.b, "-j", "link", "show", self.ib))[0]["address"]
        sh("ip", "-n", self.a, "neigh", "add", DST_IP, "lladdr", self.mac_b, "dev", self.ia)
        return self

    def drop_at_ingress(self, on: bool) -> None:
        """Drop the benchmark's datagrams in ``b``'s raw PREROUTING (netfilter, after the packet
        taps; this kernel has no tc drop action): the RX ring sees them, the UDP stack does not."""
        sh("ip", "netns", "exec", self.b, "iptables", "-t", "raw", "-A" if on else "-D",
           "PREROUTING", "-p", "udp", "--dport", str(PORT), "-j", "DROP")  # fmt: skip

    def __exit__(self, *exc: object) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_variant(binary: Path, pair: Pair, name: str, rate: float, seconds: float) -> dict:
    """One run of a variant: the per-datagram CPU of each side."""
    send_mode, recv_mode = VARIANTS[name]
    if recv_mode == "ring":
        pair.drop_at_ingress(True)
    try:
        recv = subprocess.Popen(
            ["ip", "netns", "exec", pair.b, str(binary), "recv", recv_mode, pair.ib, str(PORT),
             str(seconds + 1.5)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert recv.stdout is not None
            if json.loads(recv.stdout.readline()).get("role") != "ready":
                raise RuntimeError("the receiver did not start")
            sent = json.loads(sh("ip", "netns", "exec", pair.a, str(binary), "send", send_mode,
                                 pair.ia, SRC_IP, DST_IP, pair.mac_b, str(PORT), str(rate),
                                 str(seconds)))  # fmt: skip
            got = json.loads(recv.stdout.readline())
        finally:
            recv.wait(timeout=seconds + 10)
    finally:
        if recv_mode == "ring":
            pair.drop_at_ingress(False)
    n = got["datagrams"]
    if not n:
        raise RuntimeError(f"{name}: nothing received ({sent})")
    return {
        "sent": sent["datagrams"],
        "send_failed": sent["failed"],
        "received": n,
        "rx_buffers": got["buffers"],
        "sender_ns": round(sent["cpu_s"] / n * 1e9, 1),
        "receiver_ns": round(got["cpu_s"] / n * 1e9, 1),
        "both_ns": round((sent["cpu_s"] + got["cpu_s"]) / n * 1e9, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200_000, help="datagrams a second")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated variant names")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if os.geteuid():
        parser.error("needs root (network namespaces, AF_PACKET)")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "wpath"
        sh("cc", "-O2", "-Wall", "-Wextra", "-o", str(binary), str(SOURCE))
        runs: dict[str, list[dict]] = {n: [] for n in names}
        with Pair() as pair:
            for _ in range(args.repeat):  # variants alternate within each repeat
                for name in names:
                    runs[name].append(run_variant(binary, pair, name, args.rate, args.seconds))
    result = {
        "rate": args.rate,
        "seconds": args.seconds,
        "loadavg": os.getloadavg(),
        "variants": {
            n: {
                **{f: statistics.median_low(r[f] for r in runs[n])
                   for f in ("sender_ns", "receiver_ns", "both_ns")},
                "runs": runs[n],
            }
            for n in names
        },
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
