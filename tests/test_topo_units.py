"""Topologies and sharding without a network: node and link counts, addresses, options, names.

Nothing here needs root: a Mininet ``Topo`` is only a graph until ``Mininet`` builds it.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Hashable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mininet.util import buildTopo
from ncina.proto.job import JobSpec
from ncina.topo import cli as topo_cli
from ncina.topo import report
from ncina.topo import topos as topos_module
from ncina.topo.config import TopoConfig
from ncina.topo.runner import Progress, check_backend
from ncina.topo.topos import (
    InaHost,
    InaLink,
    LeafSpineTopo,
    MultiTopo,
    StarTopo,
    aggregator_ip,
    worker_ip,
)
from ncina.worker.sharding import ShardedAllreduce, shard_bounds

IFNAMSIZ = 15  # longest Linux interface name


def test_star_has_workers_one_aggregator_and_one_switch() -> None:
    topo = StarTopo(workers=3)
    assert topo.worker_names == ["w0", "w1", "w2"]
    assert topo.aggregator_names == ["a0"]
    assert topo.switches() == ["s1"]
    assert sorted(topo.hosts()) == ["a0", "w0", "w1", "w2"]
    assert sorted(topo.links()) == [("a0", "s1"), ("w0", "s1"), ("w1", "s1"), ("w2", "s1")]
    ips = {h: topo.nodeInfo(h)["ip"] for h in topo.hosts()}
    assert ips == {"w0": "10.0.0.1/16", "w1": "10.0.0.2/16", "w2": "10.0.0.3/16",
                   "a0": "10.0.1.1/16"}
    assert all(topo.nodeInfo(h)["cls"] is InaHost for h in topo.hosts())


def test_links_are_tc_links_with_offloads_off_and_optional_bandwidth() -> None:
    unshaped = StarTopo(workers=2)
    for a, b in unshaped.links():
        opts = unshaped.linkInfo(a, b)
        assert opts["cls"] is InaLink
        assert (opts["txo"], opts["rxo"], opts["gro"]) == (False, False, False)
        assert "bw" not in opts
    # Worker links are shaped; the aggregator's stands in for the switch: only with agg_bw.
    shaped = StarTopo(workers=2, bw=100, use_tbf=True)
    assert {(a, shaped.linkInfo(a, b).get("bw")) for a, b in shaped.links()} == {
        ("w0", 100), ("w1", 100), ("a0", None)
    }
    assert shaped.linkInfo("w0", "s1")["use_tbf"] is True
    both = StarTopo(workers=2, bw=100, agg_bw=1000)
    assert both.linkInfo("a0", "s1")["bw"] == 1000


def test_offloads_turn_every_links_checksum_offloads_on_and_refuse_loss() -> None:
    topo = StarTopo(workers=2, bw=100, offloads=True)
    assert {(topo.linkInfo(*e)["txo"], topo.linkInfo(*e)["rxo"], topo.linkInfo(*e)["gro"])
            for e in topo.links()} == {(True, True, False)}  # fmt: skip
    with pytest.raises(ValueError, match="drop a whole GSO run"):
        StarTopo(workers=2, loss_down=1.0, offloads=True)


@pytest.mark.parametrize(
    ("options", "refused"),
    [({}, False), ({"backend": "python"}, False), ({"backend": "dpdk"}, True),
     ({"backend": "bmv2"}, True), ({"loss": 1.0}, True), ({"topo": "multi"}, True)],
)
def test_offloads_config_is_a_lossless_star_on_kernel_sockets(
    tmp_path: Path, options: dict[str, Any], refused: bool
) -> None:
    if refused:
        with pytest.raises(ValueError, match="offloads: a star without loss on kernel sockets"):
            TopoConfig(out=tmp_path, offloads=True, **options)
    else:
        assert TopoConfig(out=tmp_path, offloads=True, **options).offloads
    # ncina topo's and bench fabric's default (None): on wherever they are allowed, off elsewhere
    assert TopoConfig(out=tmp_path, offloads=None, **options).offloads is not refused
    assert TopoConfig(out=tmp_path, **options).offloads is False  # soak's and bench ddp's


def test_loss_becomes_input_drop_rules_per_worker_link_direction() -> None:
    topo = StarTopo(workers=3, loss=1.0, loss_up=2.0)
    # w0 loses 1 % of everything arriving (its downlink) and 2 % of what each other worker sends
    # (their uplinks); the aggregator, standing in for the switch, sees the workers' uplink loss
    # and has no lossy link of its own.
    assert topo.nodeInfo("w0")["drops"] == [(None, 1.0), ("10.0.0.2", 2.0), ("10.0.0.3", 2.0)]
    assert topo.nodeInfo("a0")["drops"] == [("10.0.0.1", 2.0), ("10.0.0.2", 2.0),
                                            ("10.0.0.3", 2.0)]


@pytest.mark.parametrize(
    "options", [{"workers": 0}, {"aggregators": -1}, {"aggregators": 255}, {"workers": 255},
                {"loss": 100}, {"loss_down": -1}]
)
def test_bad_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StarTopo(**options)


def test_star_for_a_p4_switch_has_no_aggregator_node() -> None:
    topo = StarTopo(workers=2, aggregators=0, prefix="p")
    assert topo.aggregator_names == [] and topo.switch_name == "ps1"
    assert sorted(topo.links()) == [("pw0", "ps1"), ("pw1", "ps1")]


def test_multi_has_several_aggregators_in_shard_order() -> None:
    assert MultiTopo().aggregator_names == ["a0", "a1"]
    topo = MultiTopo(4, 3)
    assert topo.worker_names == ["w0", "w1", "w2", "w3"]
    assert topo.aggregator_names == ["a0", "a1", "a2"]
    assert [topo.nodeInfo(a)["ip"] for a in topo.aggregator_names] == [
        f"{aggregator_ip(j)}/16" for j in range(3)
    ]
    assert len(topo.links()) == 7


def test_hierarchical_leafspine_has_leaf_switches_under_one_spine() -> None:
    topo = LeafSpineTopo(workers=4, leaves=2, bw=100, loss=2.0)
    assert topo.worker_names == ["w0", "w1", "w2", "w3"]
    assert topo.aggregator_names == ["a0", "a1", "a2"]  # the leaves', then the spine's
    assert sorted(topo.switches()) == ["l0", "l1", "s1"]
    assert sorted(topo.links()) == [
        ("a0", "l0"), ("a1", "l1"), ("a2", "s1"), ("l0", "s1"), ("l1", "s1"),
        ("w0", "l0"), ("w1", "l0"), ("w2", "l1"), ("w3", "l1"),
    ]  # fmt: skip
    ips = {h: topo.nodeInfo(h)["ip"] for h in topo.hosts()}
    assert ips == {"w0": "10.0.0.1/16", "w1": "10.0.0.2/16", "w2": "10.0.0.3/16",
                   "w3": "10.0.0.4/16", "a0": "10.0.1.1/16", "a1": "10.0.1.2/16",
                   "a2": "10.0.1.3/16"}  # fmt: skip
    # Worker links and leaf uplinks shaped; aggregator links not (they stand in for switches).
    shaped = {e: topo.linkInfo(*e).get("bw") for e in topo.links()}
    assert {e for e, bw in shaped.items() if bw == 100} == {
        ("l0", "s1"), ("l1", "s1"), ("w0", "l0"), ("w1", "l0"), ("w2", "l1"), ("w3", "l1"),
    }  # fmt: skip
    # A worker's uplink loss is dropped by its leaf aggregator, not by the other leaf's.
    assert topo.nodeInfo("a0")["drops"] == [("10.0.0.1", 2.0), ("10.0.0.2", 2.0)]
    assert "drops" not in topo.nodeInfo("a2")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"workers": 5, "leaves": 2}, "cannot be split evenly"),
        ({"workers": 4, "leaves": 2, "aggregators": 2}, "leaf-spine has 3 aggregators"),
    ],
)
def test_hierarchical_leafspine_refuses_uneven_leaves(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LeafSpineTopo(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backend": "bmv2"}, "runs the python, socket or dpdk backend in INA mode"),
        ({"mode": "server", "compressor": "topk"}, "runs the python, socket or dpdk backend"),
        ({"leaves": 3}, "must split evenly"),
        ({"k": 183}, "the largest k is 182"),
        ({"pcaps": True}, "not in leafspine yet"),
    ],
)
def test_hierarchical_leafspine_config_is_checked(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    given = {"k": 182, **options}
    job = JobSpec(job=1, workers=4, k=given.pop("k"))
    with pytest.raises(ValueError, match=message):
        TopoConfig(out=tmp_path, topo="leafspine", workers=4, job=job, **given)
    job = JobSpec(job=1, workers=4, k=182)
    cfg = TopoConfig(out=tmp_path, topo="leafspine", workers=4, job=job)
    assert (cfg.backend, cfg.aggregators) == ("python", 3)
    for backend in ("socket", "dpdk"):
        assert TopoConfig(out=tmp_path, topo="leafspine", workers=4, job=job,
                          backend=backend).backend == backend  # fmt: skip
    assert topo_cli.topo_k(None, "ina", "nc8", tagged=False, topo="leafspine") == 182


def test_prefixed_names_fit_linux_interface_names() -> None:
    topo = StarTopo(workers=254, prefix="n99999")
    ports = len(topo.hosts())
    assert len(f"{topo.switches()[0]}-eth{ports}") <= IFNAMSIZ
    assert all(len(f"{h}-eth0") <= IFNAMSIZ for h in topo.hosts())
    assert worker_ip(253) == "10.0.0.254"


def test_mn_custom_loads_the_file_alone() -> None:
    # What `mn --custom mininet/topos.py --topo multi,4,2,bw=100` does.
    path = Path(topos_module.__file__)
    customs: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), customs, customs)
    assert set(customs["topos"]) == {"star", "multi", "leafspine"}
    topo = buildTopo(customs["topos"], "multi,4,2,bw=100")
    assert len(topo.hosts()) == 6
    assert {topo.linkInfo(*e).get("bw") for e in topo.links()} == {100, None}


@pytest.mark.parametrize(("n", "k", "shards"), [(1000, 64, 2), (17226, 256, 8), (100, 64, 3),
                                                (0, 64, 2), (64, 64, 1)])
def test_shard_bounds_cut_chunks_evenly(n: int, k: int, shards: int) -> None:
    bounds = shard_bounds(n, k, shards)
    assert len(bounds) == shards
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all(start % k == 0 for start, _ in bounds)
    chunks = [-(-(stop - start) // k) for start, stop in bounds]
    assert max(chunks) - min(chunks) <= 1
    assert sum(chunks) == -(-n // k)


class FakeClient:
    """Stands in for an AllreduceClient: records what it was given (and the tensor's name),
    writes it times 10 into ``out``."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls: list[np.ndarray] = []
        self.tensors: list[Hashable] = []
        self.closed = False

    def allreduce(
        self, x: np.ndarray, op: str, tensor: Hashable = None, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        assert op == "mean" and out is not None  # the fabric hands each client its slice
        self.calls.append(x.copy())
        self.tensors.append(tensor)
        np.multiply(x, 10, out=out)
        return out

    @property
    def stats(self) -> dict[str, int]:
        return {"packets_sent": len(self.calls), "saturated": 0}

    def close(self) -> None:
        self.closed = True


def test_sharded_allreduce_gives_each_aggregator_its_own_chunks() -> None:
    clients = [FakeClient(4) for _ in range(3)]
    fabric = ShardedAllreduce(clients)  # type: ignore[arg-type]
    x = np.arange(30, dtype=np.float32)
    np.testing.assert_array_equal(fabric.allreduce(x), x * 10)
    # 8 chunks of 4: 2, 3 and 3 chunks.
    assert [c.calls[0].tolist() for c in clients] == [
        list(range(0, 8)), list(range(8, 20)), list(range(20, 30))
    ]
    small = np.ones(3, dtype=np.float32)  # one chunk: only the last aggregator gets it
    fabric.allreduce(small, tensor="bias")
    assert [len(c.calls) for c in clients] == [1, 1, 2]
    assert [c.tensors for c in clients] == [[None], [None], [None, "bias"]]  # names pass through
    assert fabric.stats == {"packets_sent": 4, "saturated": 0}
    fabric.close()
    assert all(c.closed for c in clients)


def test_sharded_allreduce_writes_each_range_into_the_given_buffer() -> None:
    clients = [FakeClient(4) for _ in range(2)]
    fabric = ShardedAllreduce(clients)  # type: ignore[arg-type]
    x = np.arange(10, dtype=np.float32)
    out = np.zeros(10, dtype=np.float32)
    assert fabric.allreduce(x, out=out) is out
    np.testing.assert_array_equal(out, np.arange(10) * 10)
    assert fabric.allreduce(x, out=x) is x  # in place: the hook's staging buffer
    np.testing.assert_array_equal(x, np.arange(10) * 10)
    with pytest.raises(ValueError, match=r"out has shape \(9,\), the tensor \(10,\)"):
        fabric.allreduce(x, out=out[:9])
    fabric.close()


def test_sharded_allreduce_cuts_shaped_and_0_dim_tensors_by_element() -> None:
    """Issue 38, case 9: a 16x10 array's 160 elements are 40 chunks of 4, 20 per aggregator
    (axis 0 sliced by element bounds put all of it on the first), and a 0-dim array is one
    element (slicing it raised IndexError)."""
    clients = [FakeClient(4) for _ in range(2)]
    fabric = ShardedAllreduce(clients)  # type: ignore[arg-type]
    x = np.arange(160, dtype=np.float32).reshape(16, 10)
    np.testing.assert_array_equal(fabric.allreduce(x, out=x.copy()), x * 10)
    assert [c.calls[0].tolist() for c in clients] == [list(range(80)), list(range(80, 160))]
    scalar = np.array(3.0, dtype=np.float32)
    assert fabric.allreduce(scalar, out=scalar) is scalar and float(scalar) == 30.0
    assert fabric.allreduce(np.array(2.0, dtype=np.float32)).shape == ()
    with pytest.raises(ValueError, match="C-contiguous"):
        fabric.allreduce(x.T.copy(), out=np.zeros((16, 10), dtype=np.float32).T)
    fabric.close()


def test_sharded_allreduce_needs_one_k() -> None:
    with pytest.raises(ValueError, match="same k"):
        ShardedAllreduce([FakeClient(4), FakeClient(8)])  # type: ignore[list-item]


def test_unavailable_backend_names_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_backend("python")
    monkeypatch.setenv("NCINA_P4C", str(tmp_path / "p4c-bm2-ss"))
    monkeypatch.setenv("NCINA_BMV2", str(tmp_path / "simple_switch_grpc"))
    with pytest.raises(RuntimeError, match=r"BACKEND=bmv2 cannot run: .*p4c-bm2-ss is not "
                       r"installed .*simple_switch_grpc"):  # fmt: skip
        check_backend("bmv2")
    with pytest.raises(RuntimeError, match=r"BACKEND=fpga .*available: python"):
        check_backend("fpga")
    with pytest.raises(RuntimeError, match=r"BACKEND=bmv2 aggregates in the topology's one switch"):
        check_backend("bmv2", aggregators=2)


def test_link_mtu_sets_k_and_the_pool_and_is_checked() -> None:
    assert topo_cli.topo_k("socket", "ina", "nc8", tagged=False, mtu=9000) == 8956
    assert topo_cli.topo_k("socket", "ina", "nc8", tagged=False) == 1456
    # the pool keeps about 64 chunks of MTU 1500 in flight, between 8 and 64 slots
    assert [topo_cli.topo_pool_size("socket", k) for k in (1456, 8956, 256)] == [64, 10, 64]
    assert topo_cli.topo_pool_size("bmv2", 256) == 8
    check_backend("socket", mtu=9000)
    with pytest.raises(ValueError, match=r"--mtu 9000: BACKEND=dpdk runs on links of MTU 1500"):
        check_backend("dpdk", mtu=9000)
    with pytest.raises(ValueError, match=r"--mtu"):
        check_backend("socket", mtu=20000)


def test_topo_without_root_says_root_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topo_cli.os, "geteuid", lambda: 1000)
    parser = argparse.ArgumentParser()
    topo_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["topo"])
    with pytest.raises(PermissionError, match="needs root"):
        topo_cli.run(args)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--compressor", "topk"], r"topk payloads cannot be summed .*: use --mode server"),
        (["--mode", "server"], "--mode server needs --compressor"),
        (["--compressor", "3lc", "--mode", "server", "--verify"], "--verify checks NC8"),
    ],
)
def test_topo_refuses_impossible_compressor_options_before_anything_starts(
    options: list[str], message: str
) -> None:
    parser = argparse.ArgumentParser()
    topo_cli.add_parser(parser.add_subparsers())
    with pytest.raises(ValueError, match=message):
        topo_cli.run(parser.parse_args(["topo", *options]))


def test_progress_follows_rank_0s_metrics_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runner shows rank 0's events as the file grows, whole lines only: the bar counts
    steps up to min(epochs x steps/epoch, max_steps), epochs and the end are lines."""
    import json

    metrics = tmp_path / "worker0.jsonl"
    progress = Progress(metrics, "ina rank 0", epochs=3, max_steps=5)
    progress.poll()  # no file yet: nothing
    events = [
        {"event": "start", "model": "mlp", "parameters": 17226, "steps_per_epoch": 4,
         "compute_step_s": 0.002},
        {"event": "step", "loss": 2.1, "tx_bytes": 2_000_000},
        {"event": "step", "loss": 1.9, "tx_bytes": 4_000_000},
    ]  # fmt: skip
    text = "".join(json.dumps(e) + "\n" for e in events)
    metrics.write_text(text + '{"event": "epo')  # a line still being written
    progress.poll()
    assert progress.bar.total == 5 and progress.steps == 2
    with metrics.open("a") as f:
        f.write('ch", "epoch": 1, "test_acc": 91.5, "test_loss": 0.3, "time": 1.5, '
                '"tx_bytes": 8000000}\n')
        f.write(json.dumps({"event": "end", "steps": 5, "samples_per_s": 812.5,
                            "exposed_comm_s": 0.25}) + "\n")  # fmt: skip
    progress.close()
    out = capsys.readouterr().out
    assert "mlp: 17226 parameters, compute 2.0 ms/step" in out
    assert "epoch 1: test accuracy 91.50% loss 0.3000, 1.5 s, 8.00 MB sent" in out
    assert "done: 5 steps, 812.5 samples/s, exposed communication 0.25 s" in out


def test_exposed_communication_is_the_exchange_after_the_slowest_ranks_compute() -> None:
    def step(n: int, ready: float, done: float) -> dict[str, Any]:
        return {"event": "step", "step": n, "grads_ready": ready, "comm_done": done}

    rank0 = [{"event": "start"}, step(1, 10.0, 10.5), step(2, 20.0, 21.0), {"event": "end"}]
    rank1 = [step(1, 10.25, 10.5), step(2, 20.75, 21.0)]  # the slower rank: its compute hid more
    # step 1: 10.5 - 10.25; step 2: 21.0 - 20.75
    assert report.exposed_comm([rank0, rank1]) == 0.5
    # a rank done early (its own wait was 1 s) does not count: only the tail after the last
    assert report.exposed_comm([[step(1, 5.0, 6.0)], [step(1, 7.0, 7.25)]]) == 0.25
    assert report.exposed_comm([[{"event": "start"}]]) is None


def test_uplink_loss_leaves_the_worker_where_no_aggregator_kernel_sees_the_frames() -> None:
    """A DPDK port takes frames before netfilter and a P4 switch has no aggregator host: there a
    worker's uplink loss is an OUTPUT rule on the worker for each aggregator address, and the
    aggregator nodes drop nothing; elsewhere the aggregator node drops them as they arrive."""
    from ncina.topo.config import UPLINK_LOSS_AT_WORKER
    from ncina.topo.topos import LeafSpineTopo, aggregator_ip, worker_ip

    assert set(UPLINK_LOSS_AT_WORKER) == {"dpdk", "bmv2"}
    at_worker = StarTopo(workers=2, aggregators=2, loss=2.0, uplink_at_worker=True)
    for name in at_worker.worker_names:
        assert at_worker.nodeInfo(name)["out_drops"] == [(aggregator_ip(0), 2.0),
                                                          (aggregator_ip(1), 2.0)]
    for name in at_worker.aggregator_names:
        assert at_worker.nodeInfo(name)["drops"] == []
    switch_only = StarTopo(workers=2, aggregators=0, loss=2.0, uplink_at_worker=True)
    assert switch_only.nodeInfo(switch_only.worker_names[0])["out_drops"] == [
        (aggregator_ip(0), 2.0)]  # the P4 switch answers for the first aggregator address
    at_aggregator = StarTopo(workers=2, aggregators=1, loss=2.0)
    assert at_aggregator.nodeInfo(at_aggregator.worker_names[0])["out_drops"] == []
    assert at_aggregator.nodeInfo(at_aggregator.aggregator_names[0])["drops"] == [
        (worker_ip(0), 2.0), (worker_ip(1), 2.0)]
    tree = LeafSpineTopo(workers=4, leaves=2, loss=2.0, uplink_at_worker=True)
    assert tree.nodeInfo(tree.worker_names[3])["out_drops"] == [(aggregator_ip(1), 2.0)]
    assert tree.nodeInfo(tree.aggregator_names[1])["drops"] == []


def test_a_run_beyond_the_machines_headroom_is_warned_about() -> None:
    warn = topo_cli.headroom_warning
    assert warn(4, 100.0, 2) is None  # the default run on this project's 2-core machine
    assert warn(4, None, 2) is None and warn(4, 1000.0, None) is None  # unshaped; cores unknown
    assert warn(4, 200.0, 2) == (
        "ncina topo: warning: 4 workers at 200 Mbit/s ask for 800 Mbit/s of links, more than "
        'the 400 Mbit/s that 2 cores emulate faithfully (docs/performance.md, "Headroom"): '
        "times will measure this machine's CPU more than the links")
    assert warn(4, 200.0, 4) is None


@pytest.mark.parametrize(
    ("options", "offloads"),
    [([], True), (["--no-offloads"], False), (["--loss", "1"], False),
     (["--backend", "dpdk"], False)],
)
def test_topo_turns_the_offloads_on_where_the_star_allows_them(
    monkeypatch: pytest.MonkeyPatch, options: list[str], offloads: bool
) -> None:
    """``ncina topo``'s links carry GSO runs whole by default (issue 36), where allowed."""
    given: list[TopoConfig] = []
    monkeypatch.setattr(topo_cli.os, "geteuid", lambda: 0)
    monkeypatch.setattr("ncina.topo.runner.run_topology", given.append)
    parser = argparse.ArgumentParser()
    topo_cli.add_parser(parser.add_subparsers())
    assert topo_cli.run(parser.parse_args(["topo", "--workdir", "/nonexistent", *options])) == 0
    assert [cfg.offloads for cfg in given] == [offloads]


def test_the_topology_passes_its_job_whole_to_every_aggregator_and_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ncina topo`` holds its job as one ``JobSpec`` (``TopoConfig.job``, every job option
    of the flags), each ``ncina aggregator`` and ``ncina train`` it starts reads the same job
    back from its command line (``JobSpec.to_args``: every field of the command's role), and
    results.json's ``config`` records it field by field."""
    from ncina.topo import runner
    from ncina.topo.config import record
    from ncina.worker.train import job_spec

    from ncina.cli import build_parser

    given: list[TopoConfig] = []
    monkeypatch.setattr(topo_cli.os, "geteuid", lambda: 0)
    monkeypatch.setattr("ncina.topo.runner.run_topology", given.append)
    parser = argparse.ArgumentParser()
    topo_cli.add_parser(parser.add_subparsers())
    flags = ["--k", "100", "--pool-size", "9", "--window-max", "12", "--result", "int",
             "--mtu", "9000", "--workers", "3"]  # fmt: skip
    assert topo_cli.run(parser.parse_args(["topo", "--workdir", "/x", *flags])) == 0
    [cfg] = given
    job = JobSpec(job=1, workers=3, k=100, pool_size=9, window_max=12, result="int", mtu=9000)
    assert cfg.job == job
    ncina = build_parser()
    cfg.out = tmp_path
    aggregator = runner.aggregator_argv(cfg, 0, "10.0.0.1:47000", tmp_path, job)
    assert aggregator[:2] == [str(runner.NCINA), "aggregator"]
    assert JobSpec.from_args(ncina.parse_args(aggregator[1:])) == job
    worker = ["train", "--rank", "0", *job.to_args(role="worker", lacks=runner.TRAIN_LACKS)]
    assert job_spec(ncina.parse_args(worker)) == replace(job, total_workers=3)
    assert record(cfg)["job"] == {**job.record(), "result": "int", "uplink": "nc8"}
    assert record(cfg)["workers"] == 3 and record(cfg)["out"] == str(tmp_path)
