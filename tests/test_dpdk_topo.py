"""Mininet with BACKEND=dpdk: ``ncina topo`` trains through the DPDK data plane on the aggregator
host's interface, and that host's kernel stays silent (no ICMP port unreachable)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from ncina.aggregator.backends.dpdk import binding

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="Mininet needs root"),
    pytest.mark.skipif(binding.missing() is not None, reason=f"dpdk: {binding.missing()}"),
]


def icmp_unreachables_sent(node: Any) -> int:
    """Icmp OutDestUnreachs of the node's namespace (/proc/net/snmp)."""
    lines = [line.split() for line in node.cmd("cat /proc/net/snmp").splitlines()]
    icmp = [fields for fields in lines if fields and fields[0] == "Icmp:"]
    return int(icmp[1][icmp[0].index("OutDestUnreachs")])


def test_star_trains_through_the_dpdk_aggregator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ncina.topo import runner
    from ncina.topo.config import TopoConfig
    from ncina.topo.report import RESULTS

    seen: dict[str, Any] = {}
    original = runner.train

    def train_and_look(net: Any, topo: Any, *args: Any, **kwargs: Any) -> Any:
        host = net.get(topo.aggregator_names[0])
        before = icmp_unreachables_sent(host)
        result = original(net, topo, *args, **kwargs)
        seen["unreachables"] = icmp_unreachables_sent(host) - before
        seen["iptables"] = host.cmd("iptables -L INPUT -v -n -x")
        return result

    monkeypatch.setattr(runner, "train", train_and_look)
    cfg = TopoConfig(out=tmp_path / "run", workers=2, epochs=1, max_steps=2, backend="dpdk",
                     baseline=False, prefix=f"d{os.getpid() % 100000}")  # fmt: skip
    runner.run_topology(cfg)
    results = json.loads((cfg.out / RESULTS).read_text())
    ina = results["runs"]["ina"]
    stats = json.loads((cfg.out / "ina" / "aggregator0.json").read_text())
    assert stats["backend"] == "dpdk"
    chunks = math.ceil(17226 / cfg.job.k)  # the MLP's one bucket
    assert stats["jobs"]["1"]["slots_completed"] == 2 * chunks + 1  # +1: the agreement
    assert ina["steps"] == 2
    assert seen["unreachables"] == 0
    assert "dpt:47000" in seen["iptables"]


def test_hierarchical_leafspine_trains_through_dpdk_leaves_and_spine(tmp_path: Path) -> None:
    """Two dpdk leaves of two workers under a dpdk spine (docs/dpdk.md, "A leaf"): each leaf
    resolves the spine's MAC by ARP on its host's interface, every bucket's chunks complete at
    both leaves and once at the spine, and each leaf's partial sums went up in frames."""
    from ncina.proto.job import JobSpec
    from ncina.topo import runner
    from ncina.topo.config import TopoConfig
    from ncina.topo.report import RESULTS

    cfg = TopoConfig(out=tmp_path / "run", topo="leafspine", leaves=2, workers=4,
                     job=JobSpec(job=1, workers=4, k=182),
                     backend="dpdk", epochs=1, max_steps=2, bw=100, baseline=False,
                     prefix=f"d{os.getpid() % 100000}")  # fmt: skip
    runner.run_topology(cfg)
    ina = json.loads((cfg.out / RESULTS).read_text())["runs"]["ina"]
    # The MLP's one bucket, two steps; + 1: the workers' first call (zeros, as a flat job's
    # agreement)
    slots = 2 * math.ceil(17226 / cfg.job.k) + 1
    leaves = [json.loads((cfg.out / "ina" / f"aggregator{i}.json").read_text()) for i in (0, 1)]
    spine = json.loads((cfg.out / "ina" / "aggregator2.json").read_text())
    assert ina["steps"] == 2
    for leaf in leaves:
        assert leaf["backend"] == "dpdk"
        assert leaf["jobs"]["1"]["slots_completed"] == slots
        assert leaf["upstream"]["results"] == slots
        io = leaf["dpdk"]
        assert io["spine_mac_learned"] >= 1
        assert io["uplink_frames"] >= leaf["upstream"]["sent"] == slots
    assert spine["backend"] == "dpdk"
    assert spine["jobs"]["1"]["slots_completed"] == slots
