"""Training across machines, emulated: one network namespace per node, each running its own
torchrun agent (multi-node rendezvous: ``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint``), and
the aggregator in a namespace of its own, all joined by one bridge as hosts are by a switch
(``ncina.aggregator.backends.dpdk.netns``, kernel addresses on the veths). Nothing is shared between
the nodes but the network: the rendezvous, gloo's broadcast of the initial parameters and the INA
traffic all cross the bridge (docs/deploy.md describes the same run on real machines).

Checks: both agents exit cleanly; the four ranks are spread over the two nodes (two each, as
torchrun numbered them); the aggregator completes every chunk of every step of all four; and all
ranks end with the same parameters (the same test loss and accuracy, to the bit).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ncina.aggregator.backends.dpdk import netns
from ncina.topo import report

from ncina.harness.aggregators import RunningAggregator, wait_ready

NODES = 2
PER_NODE = 2
WORKERS = NODES * PER_NODE
STEPS = 3
PARAMETERS = 17226  # the default model's (the digits MLP)
K = 256
CHUNKS = -(-PARAMETERS // K)
RDZV_PORT = 29400
AGGREGATOR_PORT = 47000

pytestmark = pytest.mark.skipif(netns.missing() is not None, reason=f"{netns.missing()}")


def _start_aggregator(site: netns.Site, workdir: Path) -> RunningAggregator:
    """The socket backend on the aggregator node's own address."""
    workdir.mkdir(parents=True)
    stats, log = workdir / "stats.json", workdir / "aggregator.log"
    argv = [sys.executable, "-m", "ncina.cli", "aggregator", "--backend", "socket",
            "--listen", f"{site.ip}:{AGGREGATOR_PORT}", "--job", "1", "--workers", str(WORKERS),
            "--k", str(K), "--result", "nc8", "--stats", str(stats)]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(site.command(argv), stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip
    return wait_ready(RunningAggregator(process, ("", 0), stats, log))


def _torchrun(node: int, site: netns.Site, master: netns.Site, aggregator: netns.Site,
              metrics: Path) -> subprocess.Popen[str]:  # fmt: skip
    """Node ``node``'s torchrun agent, inside its namespace, starting ``PER_NODE`` ranks of
    ``ncina train``. The rendezvous store lives on the first node (``is_host``: the namespaces
    share the machine's host name, so torchrun cannot tell from it which node that is)."""
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master.ip}:{RDZV_PORT}",
        "--rdzv-id", "ncina-multinode", "--rdzv-conf", f"is_host={int(site is master)}",
        "--local-addr", site.ip,
        "-m", "ncina.cli", "train", "--aggregator", f"{aggregator.ip}:{AGGREGATOR_PORT}",
        "--k", str(K), "--max-steps", str(STEPS), "--iface", site.iface,
        "--metrics", str(metrics / f"node{node}-rank{{rank}}.jsonl"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(site.command(argv), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip


def test_multinode_training_through_one_aggregator(tmp_path: Path) -> None:
    star = netns.shared_star()
    aggregator_site, *node_sites = (star.add_site(kernel=True) for _ in range(NODES + 1))
    agg = _start_aggregator(aggregator_site, tmp_path / "aggregator")
    agents: list[subprocess.Popen[str]] = []
    try:
        agents = [_torchrun(n, site, node_sites[0], aggregator_site, tmp_path)
                  for n, site in enumerate(node_sites)]  # fmt: skip
        outputs = [a.communicate(timeout=300)[0] for a in agents]
        for agent, out in zip(agents, outputs, strict=True):
            assert agent.returncode == 0, out
        stats = agg.stats()
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
        assert agg.stop() == 0
    ranks: dict[int, set[int]] = {}
    ends = []
    for path in sorted(tmp_path.glob("node*-rank*.jsonl")):
        node = int(path.name[4 : path.name.index("-")])
        events = report.read_events(path)
        assert events[0]["world_size"] == WORKERS
        ranks.setdefault(node, set()).add(events[0]["rank"])
        ends.append(events[-1])
    assert sorted(ranks) == list(range(NODES)), ranks
    assert all(len(r) == PER_NODE for r in ranks.values()), ranks
    assert set().union(*ranks.values()) == set(range(WORKERS))
    assert [e["steps"] for e in ends] == [STEPS] * WORKERS
    assert stats["jobs"]["1"]["slots_completed"] == STEPS * CHUNKS + 1  # +1: the agreement
    # Same parameters on every rank: the same test set gives the same loss, bit for bit.
    assert len({(e["test_loss"], e["test_acc"]) for e in ends}) == 1, ends
