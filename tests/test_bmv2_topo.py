"""Mininet with BACKEND=bmv2: the topology's switch is the P4 program on BMv2. ``ncina topo``
trains through it (it answers ARP for the aggregator's address, aggregates, and sends each
result out of every rank's port), then runs the gloo baseline, whose frames it switches at L2."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from ncina.aggregator.backends.bmv2 import toolchain

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="Mininet needs root"),
    pytest.mark.skipif(toolchain.missing() is not None, reason=f"bmv2: {toolchain.missing()}"),
]


def test_star_trains_through_the_p4_switch(tmp_path: Path) -> None:
    from ncina.proto.job import JobSpec
    from ncina.topo import runner
    from ncina.topo.config import BMV2_POOL_SIZE, TopoConfig
    from ncina.topo.report import RESULTS

    cfg = TopoConfig(out=tmp_path / "run", workers=3, epochs=1, max_steps=2, backend="bmv2",
                     job=JobSpec(job=1, workers=3, k=32, pool_size=BMV2_POOL_SIZE),
                     prefix=f"b{os.getpid() % 100000}")  # fmt: skip
    runner.run_topology(cfg)
    results = json.loads((cfg.out / RESULTS).read_text())
    stats = json.loads((cfg.out / "ina" / "aggregator0.json").read_text())
    assert stats["backend"] == "bmv2"
    job = stats["jobs"]["1"]
    # The MLP's one bucket, two steps, and the agreement the clients make after their handshake
    slots = 2 * math.ceil(17226 / cfg.job.k) + 1
    assert job["slots_completed"] == slots
    assert job["results_sent"] == 3 * slots
    assert sum(job["drops"].values()) == 0 and sum(stats["global"]["drops"].values()) == 0
    assert results["runs"]["ina"]["steps"] == results["runs"]["gloo"]["steps"] == 2
    assert list((cfg.out / "ina" / "logs").glob("bmv2-*.log"))  # the switch's own output



def test_lossy_links_through_the_p4_switch_recover_and_its_pcaps_decode(tmp_path: Path) -> None:
    """``--pcaps`` with BACKEND=bmv2 and 3 % loss on every link: the workers' retransmissions
    complete every slot once per chunk and step (uplink loss is dropped as it leaves a worker,
    the switch's ports reading frames before any netfilter rule; the sockets' refusals are
    counted), and the switch's own pcaps, one per port and direction, decode with the
    Wireshark dissector as scapy reads them."""
    from ncina.proto.job import JobSpec
    from ncina.topo import runner
    from ncina.topo.config import BMV2_POOL_SIZE, TopoConfig
    from ncina_wireshark import TSHARK, check_capture
    from scapy.layers.inet import UDP
    from scapy.utils import rdpcap, wrpcap

    cfg = TopoConfig(out=tmp_path / "run", workers=2, epochs=1, max_steps=2, backend="bmv2",
                     job=JobSpec(job=1, workers=2, k=32, pool_size=BMV2_POOL_SIZE),
                     baseline=False, pcaps=True, loss=3.0,
                     prefix=f"l{os.getpid() % 100000}")  # fmt: skip
    results = runner.run_topology(cfg)
    ina = results["runs"]["ina"]
    assert ina["steps"] == 2
    assert ina["fabric"]["send_refused"] > 0 and ina["fabric"]["retransmissions"] > 0
    job = json.loads((cfg.out / "ina" / "aggregator0.json").read_text())["jobs"]["1"]
    assert job["slots_completed"] == 2 * math.ceil(17226 / cfg.job.k) + 1  # + 1: the agreement
    pcaps = sorted((cfg.out / "ina" / "pcaps").glob("*.pcap"))
    assert len(pcaps) == 2 * cfg.workers  # a port per rank, in and out
    if TSHARK is None:  # the checks above passed; the capture's decoding was not checked
        pytest.skip("tshark is not installed (make setup installs it): the capture is undecoded")
    frames = 0
    for pcap in pcaps:
        udp = [p for p in rdpcap(str(pcap)) if UDP in p]  # (ARP shares the ports)
        wrpcap(str(tmp_path / pcap.name), udp)
        frames += len(check_capture(tmp_path / pcap.name))
    chunks = math.ceil(17226 / cfg.job.k)
    assert frames >= 2 * cfg.workers * chunks  # every rank's chunk in, its result out
