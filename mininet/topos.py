"""Mininet topologies for ncina: workers and aggregator nodes behind one Linux-bridge switch, or
workers alone on a :class:`P4Switch` that aggregates (BACKEND=bmv2).

This file imports only the standard library and Mininet, so ``mn`` can load it directly (with
``--switch lxbr --controller none --arp``)::

    mn --custom mininet/topos.py --topo star,4 ...
    mn --custom mininet/topos.py --topo multi,4,2,bw=100,loss=1 ...
    mn --custom mininet/topos.py --topo leafspine,8,2,bw=100 ...

(``ncina topo`` builds the same topologies and runs training over them.)

Addressing (one /16, one broadcast domain): worker ``i`` is ``10.0.0.(i+1)``, aggregator ``j`` is
``10.0.1.(j+1)``. Node names are ``<prefix>w<i>``, ``<prefix>a<j>`` and ``<prefix>s1``; interface
names derive from them (``w0-eth0``), so runs that may overlap in time use different prefixes.
The leaf-spine topology (:class:`LeafSpineTopo`) adds leaf switches ``<prefix>l<i>`` under the
spine switch ``<prefix>s1``, one broadcast domain still (a tree of bridges has no loop).

Links: bandwidth shaping with tc (HTB, or TBF with ``use_tbf``) on both ends of each worker link
(aggregator links only with ``agg_bw``: see :class:`StarTopo`), checksum offloads and GRO off
unless a star asks for ``offloads`` (:func:`link_options`).
Packet loss on worker links is injected with iptables inside the hosts, never with netem: every
drop happens in the INPUT chain of the receiving host (a DROP in OUTPUT would make the sender's
``sendto`` fail with EPERM instead of losing the packet on the wire, and the sender's interface
counters would miss it). The downlink of worker ``h`` (switch -> h) is one rule on h's interface;
the uplink of worker ``g`` (g -> switch) is one rule in every other host matching g's source
address. Each rule draws its own random number, so a packet from g to h is lost with probability
``1 - (1 - up_g) * (1 - down_h)``, as on two lossy links in series.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mininet.link import TCIntf, TCLink
from mininet.node import Host, Switch
from mininet.topo import Topo

WORKER_NET = "10.0.0"
AGGREGATOR_NET = "10.0.1"
PREFIX_LEN = 16
MAX_NODES_PER_ROLE = 254
# tc options that Mininet implements with netem (sch_netem).
NETEM_OPTIONS = ("delay", "jitter", "loss", "max_queue_size")


def worker_ip(rank: int) -> str:
    """Address of worker ``rank``."""
    return f"{WORKER_NET}.{rank + 1}"


def aggregator_ip(index: int) -> str:
    """Address of aggregator ``index``."""
    return f"{AGGREGATOR_NET}.{index + 1}"


class InaHost(Host):
    """A host with IPv6 off and the topology's iptables loss rules installed.

    ``drops`` is a sequence of ``(source, percent)``: drop that share of the packets arriving on the
    host's interface, from ``source`` only (an address) or from anyone (``None``). ``out_drops``
    is a sequence of ``(destination, percent)``: drop that share of the packets the host sends to
    ``destination`` (the sender's socket gets EPERM, which the workers count as ``send_refused``
    and recover from like any loss) — a worker's uplink loss where the receiving end's kernel
    never sees the frames (a DPDK port, the P4 switch).
    """

    def config(self, drops: Sequence[tuple[str | None, float]] = (),
               out_drops: Sequence[tuple[str, float]] = (), **params: Any) -> dict:  # fmt: skip
        result = super().config(**params)
        for key in ("all", "default", "lo"):
            self.cmd(f"sysctl -qw net.ipv6.conf.{key}.disable_ipv6=1")
        intf = self.defaultIntf()
        rules = [(f"INPUT -i {intf} " + (f"-s {source} " if source else ""), percent)
                 for source, percent in drops]  # fmt: skip
        rules += [(f"OUTPUT -o {intf} -d {destination} ", percent)
                  for destination, percent in out_drops]  # fmt: skip
        for match, percent in rules:
            if percent <= 0:
                continue
            rule = (
                f"iptables -A {match}-m statistic --mode random "
                f"--probability {percent / 100:.6f} -j DROP"
            )
            out = self.cmd(rule + " 2>&1 && echo ok").strip()
            if not out.endswith("ok"):
                raise RuntimeError(f"{self.name}: iptables loss rule failed ({rule!r}): {out}")
        return result


class P4Switch(Switch):
    """A switch node whose data plane is a P4 program: ``ncina aggregator --backend bmv2`` runs
    ``simple_switch_grpc`` on its interfaces (the runner starts and stops it; docs/topo.md).

    Mininet's own switches hand the interfaces to a kernel bridge or Open vSwitch; this one only
    brings them up, with IPv6 off so that the kernel sends nothing out of the switch's ports.
    """

    def start(self, controllers: Sequence[Any]) -> None:
        for intf in self.intfList():
            if intf.name != "lo":
                self.cmd(f"sysctl -qw net.ipv6.conf.{intf.name}.disable_ipv6=1")
                intf.ifconfig("up")


class InaIntf(TCIntf):
    """A tc-shaped interface that fails loudly where Mininet only logs.

    Mininet prints tc failures and carries on; a run that asked for delay or loss through netem on
    a kernel without sch_netem (or for a bandwidth outside Mininet's range) would then silently
    measure an unshaped link. Here any such failure raises.
    """

    def config(self, bw: float | None = None, **params: Any) -> dict | None:
        if bw is not None and not 0 < bw <= self.bwParamMax:
            raise ValueError(f"{self}: bandwidth {bw} Mbit/s outside 0..{self.bwParamMax}")
        result = super().config(bw=bw, **params)
        for out in (result or {}).get("tcoutputs", []):
            if "Error" in out or "RTNETLINK" in out:
                asked = [k for k in NETEM_OPTIONS if params.get(k)]
                hint = (
                    f" ({', '.join(asked)} need the netem qdisc, which this kernel may lack;"
                    " inject loss with the topology's iptables loss= option instead)"
                    if asked
                    else ""
                )
                raise RuntimeError(f"tc failed on {self}: {out.strip()}{hint}")
        return result

    def bwCmds(self, **params: Any) -> tuple[list[str], str]:  # noqa: N802 (Mininet's name)
        """Mininet's commands, with an explicit HTB quantum (one frame).

        Without it the kernel derives the quantum from the rate and warns that it is too big for
        rates above ~16 Mbit/s; with one class per interface the quantum has no other effect.
        """
        cmds, parent = super().bwCmds(**params)
        return [c + " quantum 1514" if "htb rate" in c else c for c in cmds], parent


def link_options(offloads: bool = False) -> dict[str, Any]:
    """Mininet link options of every link: :class:`InaLink`, GRO off, checksum offloads off
    unless ``offloads``. With them off a UDP GSO send (the worker's and the socket aggregator's
    runs of datagrams, docs/performance.md) is cut into its datagrams in software at the
    sender's veth, and every one crosses the veths, the bridge and HTB as a frame of its own.
    With them on the run crosses the fabric as one buffer (HTB still charges every datagram's
    bytes, headers included) and a receiver with UDP GRO takes it whole; but the interfaces'
    counters then count it as one frame (HTB's class statistics count its datagrams:
    ``ncina.harness.links.htb_sent``), and an iptables loss rule would drop it whole."""
    return {"cls": InaLink, "txo": offloads, "rxo": offloads, "gro": False}


class InaLink(TCLink):
    """A TCLink whose two ends are :class:`InaIntf`."""

    def __init__(self, *args: Any, **params: Any) -> None:
        params.setdefault("cls1", InaIntf)
        params.setdefault("cls2", InaIntf)
        super().__init__(*args, **params)


class StarTopo(Topo):
    """``workers`` hosts and ``aggregators`` aggregator nodes, all on one switch (no aggregator
    node when the switch aggregates itself, a :class:`P4Switch`).

    The aggregator nodes stand in for the switch's data plane (in a real INA switch, aggregation
    happens inside it, and each result is multicast out of the workers' ports): their links are
    neither shaped nor lossy unless asked (``agg_bw``), since every worker's packets cross them.
    Otherwise an aggregator link at the workers' bandwidth would carry N times a worker's traffic
    each way, and INA would be measured against a parameter server's bottleneck.

    bw: bandwidth of each worker link in Mbit/s (None: unshaped); agg_bw: the same for each
    aggregator link; use_tbf: shape with TBF instead of HTB. loss: percent of packets lost on
    each worker link in each direction; loss_up/loss_down override it for the worker -> switch
    and switch -> worker directions. uplink_at_worker: a worker's uplink loss to the aggregators
    is dropped as it leaves the worker (an OUTPUT rule), not as it arrives (for aggregators whose
    frames the kernel's netfilter never sees: DPDK, the P4 switch). offloads: checksum offloads
    on, so that UDP GSO runs cross the fabric whole (:func:`link_options`; not with loss).
    """

    def build(
        self,
        workers: int = 4,
        aggregators: int = 1,
        bw: float | None = None,
        loss: float = 0.0,
        loss_up: float | None = None,
        loss_down: float | None = None,
        agg_bw: float | None = None,
        use_tbf: bool = False,
        prefix: str = "",
        uplink_at_worker: bool = False,
        offloads: bool = False,
    ) -> None:
        for count, role, least in ((workers, "workers", 1), (aggregators, "aggregators", 0)):
            if not least <= count <= MAX_NODES_PER_ROLE:
                raise ValueError(f"{role}: {count} not in {least}..{MAX_NODES_PER_ROLE}")
        up, down = loss_rates(loss, loss_up, loss_down)
        if offloads and (up or down):
            raise ValueError("offloads: a lossy link's iptables rule would drop a whole GSO run")
        # Host names in rank order and in shard order, for the runner.
        self.worker_names = [f"{prefix}w{i}" for i in range(workers)]
        self.aggregator_names = [f"{prefix}a{j}" for j in range(aggregators)]
        worker_ips = [worker_ip(i) for i in range(workers)]
        self.switch_name = f"{prefix}s1"
        switch = self.addSwitch(self.switch_name)
        link_opts = link_options(offloads)
        # (With the P4 switch aggregating there is no aggregator node; its address is the first.)
        out_drops = [(aggregator_ip(j), up) for j in range(max(aggregators, 1))
                     if uplink_at_worker]  # fmt: skip
        for name, ip in zip(self.worker_names, worker_ips, strict=True):
            drops = [(None, down)] + [(other, up) for other in worker_ips if other != ip]
            self.addHost(name, cls=InaHost, ip=f"{ip}/{PREFIX_LEN}", drops=drops,
                         out_drops=out_drops)  # fmt: skip
            self.addLink(name, switch, **link_opts, **shaping(bw, use_tbf))
        for j, name in enumerate(self.aggregator_names):
            drops = [(other, up) for other in worker_ips if not uplink_at_worker]
            self.addHost(name, cls=InaHost, ip=f"{aggregator_ip(j)}/{PREFIX_LEN}", drops=drops)
            self.addLink(name, switch, **link_opts, **shaping(agg_bw, use_tbf))


def loss_rates(loss: float, loss_up: float | None, loss_down: float | None) -> tuple[float, float]:
    """The percent of packets a worker link loses up and down (``loss`` unless overridden);
    raises ``ValueError`` for one outside [0, 100)."""
    up = loss if loss_up is None else loss_up
    down = loss if loss_down is None else loss_down
    for percent in (up, down):
        if not 0 <= percent < 100:
            raise ValueError(f"loss {percent}% not in [0, 100)")
    return up, down


def shaping(bw: float | None, use_tbf: bool) -> dict[str, Any]:
    """Link options of a bandwidth limit (none for ``None``)."""
    return {} if bw is None else {"bw": bw, "use_tbf": use_tbf}


class MultiTopo(StarTopo):
    """Star with several aggregator nodes (default 2); the workers shard each tensor across them."""

    def build(self, workers: int = 4, aggregators: int = 2, **opts: Any) -> None:
        super().build(workers=workers, aggregators=aggregators, **opts)


class LeafSpineTopo(StarTopo):
    """Two-level aggregation (docs/protocol.md, "Hierarchical aggregation"): ``leaves`` leaf
    switches of ``workers / leaves`` workers each, each with its leaf aggregator node, and one
    spine switch with the spine aggregator node; one link from each leaf switch up to the spine
    switch, the **leaf uplink**, which carries only the leaf's partial sums and the spine's
    results.

    Worker ``g`` is on leaf ``g // W``; aggregator node ``a<i>`` (``i < leaves``) is leaf ``i``'s,
    ``a<leaves>`` the spine's (``aggregator_names`` in that order, the spine last). Worker links
    and leaf uplinks are shaped with ``bw``; aggregator links with ``agg_bw`` only (as in
    :class:`StarTopo`, the nodes stand in for the switches' data planes). Loss is a worker
    link's, as in the star: a worker's downlink on its interface, its uplink in every other
    worker and in its leaf aggregator (or, ``uplink_at_worker``, as it leaves the worker).
    """

    def build(  # type: ignore[override]
        self,
        workers: int = 4,
        leaves: int = 2,
        bw: float | None = None,
        loss: float = 0.0,
        loss_up: float | None = None,
        loss_down: float | None = None,
        agg_bw: float | None = None,
        use_tbf: bool = False,
        prefix: str = "",
        aggregators: int | None = None,
        uplink_at_worker: bool = False,
    ) -> None:
        if not 1 <= leaves <= MAX_NODES_PER_ROLE - 1 or workers % leaves or workers < leaves:
            raise ValueError(f"{workers} workers cannot be split evenly over {leaves} leaves")
        if aggregators not in (None, leaves + 1):
            raise ValueError(f"leaf-spine has {leaves + 1} aggregators (the leaves' and the "
                             f"spine's), not {aggregators}")  # fmt: skip
        up, down = loss_rates(loss, loss_up, loss_down)
        width = workers // leaves
        self.workers_per_leaf = width
        self.worker_names = [f"{prefix}w{i}" for i in range(workers)]
        self.aggregator_names = [f"{prefix}a{j}" for j in range(leaves + 1)]  # the spine last
        self.switch_name = f"{prefix}s1"  # the spine switch
        self.leaf_switch_names = [f"{prefix}l{i}" for i in range(leaves)]
        worker_ips = [worker_ip(i) for i in range(workers)]
        link_opts = link_options()
        spine = self.addSwitch(self.switch_name)
        for i, leaf_name in enumerate(self.leaf_switch_names):
            leaf = self.addSwitch(leaf_name)
            self.addLink(leaf, spine, **link_opts, **shaping(bw, use_tbf))  # the leaf uplink
            mine = range(i * width, (i + 1) * width)
            for g in mine:
                ip = worker_ips[g]
                drops = [(None, down)] + [(other, up) for other in worker_ips if other != ip]
                out_drops = [(aggregator_ip(i), up)] if uplink_at_worker else []
                self.addHost(self.worker_names[g], cls=InaHost, ip=f"{ip}/{PREFIX_LEN}",
                             drops=drops, out_drops=out_drops)  # fmt: skip
                self.addLink(self.worker_names[g], leaf, **link_opts, **shaping(bw, use_tbf))
            drops = [(worker_ips[g], up) for g in mine if not uplink_at_worker]
            self.addHost(self.aggregator_names[i], cls=InaHost,
                         ip=f"{aggregator_ip(i)}/{PREFIX_LEN}", drops=drops)  # fmt: skip
            self.addLink(self.aggregator_names[i], leaf, **link_opts,
                         **shaping(agg_bw, use_tbf))  # fmt: skip
        self.addHost(self.aggregator_names[leaves], cls=InaHost,
                     ip=f"{aggregator_ip(leaves)}/{PREFIX_LEN}")  # fmt: skip
        self.addLink(self.aggregator_names[leaves], spine, **link_opts,
                     **shaping(agg_bw, use_tbf))  # fmt: skip


# For `mn --custom`.
topos = {"star": StarTopo, "multi": MultiTopo, "leafspine": LeafSpineTopo}
