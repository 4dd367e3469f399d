"""Test and benchmark sites for the DPDK data plane: a network namespace per aggregator, joined
to the calling process's namespace by a veth pair on one Linux bridge (a one-switch star).

The host side of every site is one bridge with one IPv4 address (``Star.host_ip``): sockets of
the calling process reach every aggregator from that address. The aggregator's end of its veth
carries no IP address, so the namespace's kernel never answers the aggregator's traffic (no ICMP
port unreachable, no ARP): the data plane answers ARP for its own address itself.

Names start with ``ncd`` and carry the process id, so concurrent runs do not collide, and
everything made here is removed by ``Star.close`` (and at exit). Needs root.

The tests' star (``shared_star``) delivers in send order: a veth hands each frame to the backlog
queue of the CPU that sent it, so a sender that changes CPU between two datagrams can see the
second overtake the first while the first CPU's queue waits for its softirq (under load, for
ksoftirqd); CI saw a twin's answers to two hellos swapped. Both ends of each of its veths steer
every frame to one CPU's queue (RPS, ``rps_cpus``), which keeps one FIFO per direction, so a test
may take the answer to its last datagram as proof that the earlier ones were handled.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncina.proto.header import PORT

from ncina.common.address import parse_address


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def missing() -> str | None:
    """A one-line reason why sites cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs)"
    if _ip("-V", check=False).returncode != 0:
        return "iproute2 is not installed"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.199.0.0/16 that no interface of this namespace uses."""
    used = _ip("-4", "-o", "addr").stdout
    start = os.getpid() % 250
    for i in range(250):
        net = ipaddress.IPv4Network(f"10.199.{(start + i) % 250 + 1}.0/24")
        if f" 10.199.{net.network_address.packed[2]}." not in used:
            return net
    raise RuntimeError("no free /24 in 10.199.0.0/16")


@dataclass
class Site:
    """One aggregator's namespace: ``iface`` (inside ``ns``, no IP) is where DPDK attaches."""

    ns: str
    iface: str
    peer: str
    ip: str
    port: int = PORT

    @property
    def listen(self) -> str:
        return f"{self.ip}:{self.port}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the site's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def aggregator_command(self, arguments: Sequence[str], backend: str = "dpdk") -> list[str]:
        """``ncina aggregator --backend BACKEND`` on this site: dpdk or bmv2, a data plane on
        ``iface``; python or socket, a kernel socket on the site's address. A ``--listen
        HOST:PORT`` in ``arguments`` keeps its port (0: the protocol's), the host becomes the
        site's."""
        port = self.port
        for i, arg in enumerate(arguments):
            value = arg.partition("=")[2] if arg.startswith("--listen=") else (
                arguments[i + 1] if arg == "--listen" and i + 1 < len(arguments) else "")
            listen_port = parse_address(value)[1] if value else 0
            if listen_port:
                port = listen_port
        return self.command(
            [sys.executable, "-m", "ncina.cli", "aggregator", "--backend", backend, *arguments,
             *(["--iface", self.iface] if backend in ("dpdk", "bmv2") else []),
             "--listen", f"{self.ip}:{port}"]
        )  # fmt: skip


@dataclass
class Star:
    """A bridge in this namespace with ``host_ip``, and the sites attached to it."""

    bridge: str
    subnet: ipaddress.IPv4Network
    sites: list[Site] = field(default_factory=list)
    _tag: str = ""
    in_order: bool = False
    """Every site's veth delivers in send order both ways (``steer_to_one_cpu``)."""

    @classmethod
    def create(cls, in_order: bool = False) -> Star:
        tag = f"{os.getpid() % 100000}"
        bridge = f"ncdb{tag}"
        # Two processes at once (the sanitized suite's two groups) could both find one /24
        # free and both take it: the choice and the address that takes it are one step.
        with (Path(tempfile.gettempdir()) / "ncina-star-subnet.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            subnet = _free_subnet()
            _ip("link", "add", bridge, "type", "bridge", "forward_delay", "0")
            star = cls(bridge, subnet, _tag=tag, in_order=in_order)
            atexit.register(star.close)
            _ip("addr", "add", f"{star.host_ip}/{subnet.prefixlen}", "dev", bridge)
        _ip("link", "set", bridge, "up")
        return star

    @property
    def host_ip(self) -> str:
        """The address the calling process's sockets use to reach the sites."""
        return str(self.subnet.network_address + 254)

    def add_site(self, kernel: bool = False, queues: int | None = None) -> Site:
        """A new namespace with a veth into the bridge; the aggregator's address is the next
        free one of the subnet (answered by DPDK's ARP responder, not by a kernel).

        ``kernel``: the address is the namespace kernel's instead, on the veth, for an
        aggregator that serves a kernel UDP socket (the python and socket backends) behind the
        same path (tests/test_conformance.py sends every backend the same frames).
        ``queues``: RX and TX queues of both veth ends (None: the kernel's default, one per
        possible CPU; XDP on a veth wants no more TX queues on the peer than RX queues here).
        """
        i = len(self.sites) + 1
        ns, iface, peer = f"ncd{self._tag}n{i}", f"ncd{self._tag}a{i}", f"ncd{self._tag}h{i}"
        site = Site(ns, iface, peer, str(self.subnet.network_address + i))
        self.sites.append(site)
        _ip("netns", "add", ns)
        sizes = [] if queues is None else ["numrxqueues", str(queues), "numtxqueues", str(queues)]
        _ip("link", "add", iface, *sizes, "type", "veth", "peer", "name", peer, *sizes)
        _ip("link", "set", iface, "netns", ns)
        _ip("link", "set", peer, "master", self.bridge, "up")
        _ip("-n", ns, "link", "set", iface, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if kernel:
            _ip("-n", ns, "addr", "add", f"{site.ip}/{self.subnet.prefixlen}", "dev", iface)
        # No offloads on the veth: DPDK's af_packet sees and sends whole, checksummed frames.
        for dev, where in ((peer, []), (iface, ["ip", "netns", "exec", ns])):
            subprocess.run([*where, "ethtool", "-K", dev, "tx", "off", "rx", "off"],
                           capture_output=True, check=False)  # fmt: skip
            if self.in_order:
                steer_to_one_cpu(dev, where)
        return site

    def close(self) -> None:
        """Remove every namespace, veth and the bridge made here (idempotent)."""
        for site in self.sites:
            _ip("link", "del", site.peer, check=False)
            _ip("netns", "del", site.ns, check=False)
        self.sites.clear()
        _ip("link", "del", self.bridge, check=False)


def steer_to_one_cpu(dev: str, where: Sequence[str] = ()) -> None:
    """Steer every frame ``dev`` receives to the backlog queue of one CPU (the lowest this
    process may use), whichever CPU sent it: RPS with a one-CPU mask on each of its RX queues,
    set through ``where`` (a command prefix that enters its namespace). A veth otherwise queues
    a frame on its sender's CPU, and two frames queued on two CPUs may arrive in either order.
    The mask must be set in the device's final namespace (moving a device drops it)."""
    mask = f"{1 << min(os.sched_getaffinity(0)):x}"
    script = f"for q in /sys/class/net/{dev}/queues/rx-*/rps_cpus; do echo {mask} > $q; done"
    proc = subprocess.run([*where, "sh", "-c", script], capture_output=True, text=True,
                          check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"cannot steer {dev}'s frames to one CPU: {proc.stderr.strip()}")


_STAR: Star | None = None


def shared_star() -> Star:
    """The process's one star (made on first use), delivering in send order (``in_order``):
    the tests synchronise on the answer to their last datagram."""
    global _STAR
    if _STAR is None:
        _STAR = Star.create(in_order=True)
    return _STAR


def prepare_host(node: Any, port: int = PORT) -> list[str]:
    """Make a Mininet host ready for the dpdk aggregator; returns the extra ``ncina aggregator``
    arguments (``--iface``).

    DPDK's af_packet port sees the host interface's frames next to the host's kernel, which owns
    the interface's address: without a socket on the port, the kernel would answer every uplink
    packet with an ICMP port unreachable. An iptables rule in the host's namespace drops the
    port's UDP on INPUT (packet sockets see frames before netfilter, so DPDK still gets them).
    """
    rule = f"INPUT -p udp --dport {port} -j DROP"
    out = node.cmd(f"iptables -C {rule} 2>/dev/null || iptables -A {rule}; echo rc=$?")
    if "rc=0" not in out:
        raise RuntimeError(f"cannot install the iptables rule on {node.name}: {out.strip()}")
    return ["--iface", node.defaultIntf().name]
