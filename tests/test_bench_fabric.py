"""``ncina bench fabric``: its options and refusals, its link figures (``ncina.harness.links``),
and (as root) one tiny real run over a Mininet star, and that it removes everything it made when
a run is stopped. The benchmark runs through its command, as a user runs it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ncina.aggregator import backends
from ncina.proto.wire import ETH_IPV4_UDP_HEADERS

from ncina.cli import build_parser, main
from ncina.harness.links import (
    MIN_TIME_LIMIT,
    fractions,
    link_fraction,
    time_limit,
    useful_frame_bytes,
)

pytestmark = pytest.mark.timeout(120)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "fabric", *argv])


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse()
    assert (args.workers, args.bw, args.elements, args.mtu, args.repeat) == (4, [100.0], 10**7,
                                                                           [1500], 3)  # fmt: skip
    assert args.backend == "socket"  # the C aggregator, when it is an aggregator backend
    no_socket = tuple(b for b in backends.BACKENDS if b.name != "socket")
    monkeypatch.setattr(backends, "BACKENDS", no_socket)
    assert parse().backend == "python"
    assert parse("--backend", "dpdk", "--mtu", "9000").mtu == [9000]
    # None: on where the fabric allows them (TopoConfig resolves it), --no-offloads: off
    assert (args.offloads, parse("--offloads").offloads, parse("--no-offloads").offloads) == (
        None, True, False)
    many = parse("--bw", "100,200,500.5", "--mtu", "1500,9000")
    assert (many.bw, many.mtu) == ([100.0, 200.0, 500.5], [1500, 9000])


def test_the_faithful_bandwidth_is_the_highest_that_filled_its_links_per_mtu() -> None:
    from ncina.harness.figures import faithful_bandwidths

    rows = [{"bw_mbit": bw, "mtu": mtu, "link_fraction": f} for bw, mtu, f in (
        (100.0, 1500, 0.97), (200.0, 1500, 0.91), (500.0, 1500, 0.6),
        (100.0, 9000, 0.98), (200.0, 9000, 0.8), (500.0, 9000, 0.9))]  # fmt: skip
    assert faithful_bandwidths(rows, [1500, 9000], 0.9) == {"1500": 200.0, "9000": 500.0}
    assert faithful_bandwidths(rows, [1500], 0.99) == {"1500": None}


def test_the_faithful_bandwidth_per_k_is_judged_the_same_way() -> None:
    from ncina.harness.figures import faithful_bandwidths

    rows = [{"bw_mbit": bw, "k": k, "link_fraction": f} for bw, k, f in (
        (100.0, 64, 0.3), (100.0, 1456, 0.95), (500.0, 1456, 0.6))]  # fmt: skip
    assert faithful_bandwidths(rows, [64, 1456], 0.9, key="k") == {"64": None, "1456": 100.0}


def echo_host(completed: int, seconds: float = 2.0, rounds: int = 0) -> dict[str, Any]:
    return {"sent": completed + 64, "received": completed, "completed": completed,
            "retransmit_rounds": rounds, "send_errors": 0, "seconds": seconds}  # fmt: skip


def test_the_fabric_limit_counts_completed_echoes_both_ways() -> None:
    """Issue 36: two hosts, each 100k echoes of a 122-byte frame (K 64) in 2 s on 100 Mbit/s
    links: 2 x 50k datagrams/s each, 50k frames/s up each uplink, 0.488 of its bit rate."""
    from ncina.harness.echo import limit_figures

    figures = limit_figures([echo_host(100_000), echo_host(100_000)], 122, 100.0)
    assert figures["fabric_limit_pps"] == 200_000
    assert figures["fabric_limit_link_fraction"] == 0.488  # 50k x 122 x 8 / 1e8
    assert figures["fabric_limit_refused"] is None


def test_a_dead_or_retransmitting_echo_is_no_yardstick() -> None:
    """An echo that answered nothing still sent: its limit is 0 and the ratio is refused with
    the reason, as is one that retransmitted or could not run."""
    from ncina.harness.echo import limit_figures, limit_ratio

    dead = limit_figures([echo_host(0), echo_host(0)], 122, 100.0)
    assert dead["fabric_limit_pps"] == 0
    assert dead["fabric_limit_refused"] == "the baseline completed nothing"
    lossy = limit_figures([echo_host(1000, rounds=3), echo_host(1000)], 122, 100.0)
    assert lossy["fabric_limit_refused"] == "the baseline retransmitted (3)"
    broken = limit_figures([], 122, 100.0, error="no forwarder")
    assert broken["fabric_limit_refused"] == "the baseline failed: no forwarder"
    assert broken["fabric_limit_pps"] == 0 and broken["fabric_limit_link_fraction"] == 0.0

    # INA: 2 workers of 6400 elements at K 64, 100 chunks each way each: 400 datagrams in 0.01 s
    good = limit_figures([echo_host(40_000), echo_host(40_000)], 122, 100.0)  # 80k/s
    runs = [{"wall_s": 0.01, "extra": good}, {"wall_s": 0.02, "extra": good}]
    figures = limit_ratio(runs, workers=2, elements=6400, k=64)
    assert figures["ina_packets_per_s"] == 40_000 and figures["fabric_limit_pps"] == 80_000
    assert figures["vs_fabric_limit"] == 0.5
    assert figures["vs_fabric_limit_spread"] == {"min": 0.25, "median": 0.25, "max": 0.5}
    assert "vs_fabric_limit_refused" not in figures
    runs[1]["extra"] = dead  # one run's echo answered nothing: no ratio at all
    figures = limit_ratio(runs, workers=2, elements=6400, k=64)
    assert figures["vs_fabric_limit"] is None and figures["vs_fabric_limit_spread"] is None
    assert figures["vs_fabric_limit_refused"] == "the baseline completed nothing"


def test_link_fraction_counts_frames_against_the_link_rate() -> None:
    # 12.5 MB of frames in one second fill a 100 Mbit/s link.
    assert link_fraction(12_500_000, 1.0, 100.0) == 1.0
    assert link_fraction(1_250_000, 2.0, 10.0) == 0.5
    assert fractions([100, 0], [1_250_100, 625_000], 1.0, 10.0) == [1.0, 0.5]


def test_link_fraction_is_useful_bytes_and_wire_fraction_the_copies_too() -> None:
    """Issue 40: at MTU 9000 a run with 11.6 % copies showed link_fraction 0.961 from the
    wire's bytes; only the chunks' frames, each once, do work (the faithful bandwidth is judged
    on them)."""
    import argparse

    from ncina.harness.figures import faithful_bandwidths
    from ncina.harness.links import ina_link_figures, useful_frame_bytes

    # bench fabric's default worker: 10M codes at K 1456, 6,868 full frames and one of 250
    assert useful_frame_bytes(10_000_000, 1456) == 6_868 * 1_514 + 250
    assert useful_frame_bytes(20_000, 1456) == 13 * (1456 + 58) + (1072 + 58)
    args = argparse.Namespace(elements=10_000_000, k=1456, bw=100.0)
    useful = useful_frame_bytes(10_000_000, 1456)
    copies = [round(useful / (1 - 0.116)), useful]  # worker 0 re-sent 11.6 % of its frames
    wall = useful * 8 / 100e6 / 0.85  # the useful bytes filled 0.85 of the link
    got = ina_link_figures([0, 0], copies, wall, args)
    assert got["link_fraction"] == 0.85
    assert got["wire_fractions"] == [0.9615, 0.85]
    assert got["wire_fraction"] == round((0.9615 + 0.85) / 2, 4)
    row = {"bw_mbit": 100.0, "mtu": 9000, **got}
    assert faithful_bandwidths([row], [9000], 0.9) == {"9000": None}  # 0.96 of wire, 0.85 used


def test_the_time_limit_grows_with_the_transfer_over_slow_links() -> None:
    assert time_limit(10**7, 10.0, 30.0) == 3 * 2 * 32 * 10**7 / 10e6 + 30.0
    assert time_limit(10**7, 10_000.0, 30.0) == MIN_TIME_LIMIT


def refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What ``ncina bench fabric ARGV`` says on stderr when it refuses to run (exit status 1,
    no figures written)."""
    output = tmp_path / "fabric.jsonl"
    assert main(["bench", "fabric", *argv, "--output", str(output)]) == 1
    assert not output.exists()
    return capsys.readouterr().err


def test_without_root_it_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in refusal(tmp_path, capsys)


def test_bad_bandwidth_and_dpdk_jumbo_frames_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the checks come before any network
    with pytest.raises(SystemExit):
        parse("--bw", "100,0")
    assert "every value of '100,0' must be positive" in capsys.readouterr().err
    from ncina.aggregator.backends.dpdk import binding

    if binding.missing():
        pytest.skip(f"dpdk: {binding.missing()}")
    assert "MTU 1500" in refusal(tmp_path, capsys, "--backend", "dpdk", "--mtu", "9000")


def test_leafspine_needs_even_leaves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the checks come before any network
    err = refusal(tmp_path, capsys, "--topo", "leafspine", "--backend", "socket", "--leaves", "3")
    assert "--workers 4 cannot be split evenly over --leaves 3" in err
    err = refusal(tmp_path, capsys, "--topo", "leafspine", "--backend", "python", "--leaves", "3")
    assert "--workers 4 cannot be split evenly over --leaves 3" in err


root = pytest.mark.skipif(os.geteuid() != 0, reason="Mininet needs root")


def links(prefix: str) -> list[str]:
    """Interfaces of this namespace whose names start with ``prefix``."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    names = [line.split(": ")[1].split("@")[0] for line in out.splitlines()]
    return [n for n in names if n.startswith(prefix)]


@pytest.mark.root
@root
def test_a_tiny_run_over_mininet(tmp_path: Path) -> None:
    output = tmp_path / "fabric.jsonl"
    status = main(["bench", "fabric", "--workers", "2", "--elements", "20000", "--repeat", "1",
                   "--backend", "python", "--bw", "100,200", "--workdir", str(tmp_path),
                   "--limit-seconds", "1", "--output", str(output)])  # fmt: skip
    assert status == 0
    assert links(f"b{os.getpid() % 100000}") == []
    both = json.loads(output.read_text())
    assert both["benchmark"] == "fabric" and set(both["faithful_bw_mbit"]) == {"1500"}
    figures, other = both["rows"]  # a fabric per bandwidth, in one invocation
    assert (other["bw_mbit"], other["exact"]) == (200.0, True)
    tmp_path = tmp_path / "bw100-mtu1500"
    assert figures["exact"] is True
    for key in ("link_fraction", "wire_fraction", "gloo_link_fraction", "wall_s", "gloo_wall_s",
                "vs_gloo"):
        assert figures[key] > 0, key
    assert figures["link_fraction"] <= figures["wire_fraction"]  # copies only add to the wire
    assert (figures["bw_mbit"], figures["workers"], figures["elements"]) == (100.0, 2, 20000)
    assert (figures["backend"], figures["k"], figures["mtu"]) == ("python", 1456, 1500)
    [run] = figures["runs"]
    # Every uplink carried at least its chunks' frames: 14 chunks of 1456 (the last of 1072)
    # NC8 codes behind Ethernet, IPv4, UDP and the ncina header.
    frames = 13 * (1456 + 58) + (1072 + 58)
    assert all(b >= frames for b in run["uplink_bytes"]), run["uplink_bytes"]
    assert (tmp_path / "run0" / "aggregator0.log").exists()
    assert "leaf_link_fraction" not in figures
    # Issue 36: the fabric's own limit at K's packet size, measured beside the job
    assert figures["packets"] == 2 * 2 * 14 + figures["retransmissions"]
    assert set(figures["cpu_ns_per_packet_split"]) == {"workers", "aggregator", "unattributed"}
    assert figures["fabric_limit_pps"] > 0, run["fabric_limit_hosts"]
    if figures["vs_fabric_limit"] is None:  # a stall of a second on a loaded machine
        assert "retransmitted" in figures["vs_fabric_limit_refused"]
    else:
        assert figures["vs_fabric_limit"] == pytest.approx(
            figures["ina_packets_per_s"] / figures["fabric_limit_pps"], rel=0.01)
    assert [h["completed"] > 0 for h in run["fabric_limit_hosts"]] == [True, True]
    assert set(both["faithful_bw_mbit_per_k"]) == {"1456"}


@pytest.mark.root
@root
@pytest.mark.parametrize("backend", ["python", "socket", "dpdk"])
def test_a_tiny_leafspine_run_reports_the_leaf_uplinks(tmp_path: Path, backend: str) -> None:
    """Two leaves of two workers under a spine: the tree's result is the reference model's
    (exact), and each leaf uplink carried at least its partial sums, 8 bytes per element. With
    dpdk, the leaves resolve the spine's MAC by ARP on the host's interface."""
    if backend == "dpdk":
        from ncina.aggregator.backends.dpdk import binding

        if binding.missing():
            pytest.skip(f"dpdk: {binding.missing()}")
    output = tmp_path / "fabric.jsonl"
    status = main(["bench", "fabric", "--topo", "leafspine", "--leaves", "2", "--workers", "4",
                   "--elements", "20000", "--repeat", "1", "--backend", backend, "--bw", "100",
                   "--workdir", str(tmp_path), "--output", str(output)])  # fmt: skip
    assert status == 0
    assert links(f"b{os.getpid() % 100000}") == []
    figures = json.loads(output.read_text())
    assert figures["exact"] is True
    assert (figures["topo"], figures["leaves"], figures["k"]) == ("leafspine", 2, 182)
    assert figures["leaf_link_fraction"] > 0 and figures["link_fraction"] > 0
    [run] = figures["runs"]
    assert len(run["leaf_link_fractions"]) == 2 and len(run["wire_fractions"]) == 4
    # Each leaf sent the whole tensor's partial sum up: 20000 int lanes of 8 bytes at least.
    for fraction in run["leaf_link_fractions"]:
        assert fraction * run["wall_s"] * 100e6 / 8 >= 20000 * 8, run["leaf_link_fractions"]
    # The spine (aggregator 2) completed every chunk once: 110 chunks of 182 (the last of 162),
    # one of the warm-up's element, and the workers' first call (zeros, as a flat job's
    # agreement).
    spine = json.loads((tmp_path / "run0" / "aggregator2.json").read_text())
    assert spine["jobs"]["1"]["slots_completed"] == 110 + 1 + 1
    assert [(tmp_path / "run0" / f"aggregator{j}.log").exists() for j in range(3)] == [True] * 3


def processes_mentioning(text: str) -> list[int]:
    """The processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_text(errors="replace"):
                found.append(int(entry.name))
        except OSError:  # exited meanwhile
            continue
    return found


GSO_SEND = """
import json, socket, sys, time
from ncina.common.htb import LinkCounters
runs, segments, size = (int(a) for a in sys.argv[2:5])
counters = LinkCounters(sys.argv[5])  # what ncina topo's workers count (ncina train --iface)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_UDP, 103, size)  # UDP_SEGMENT: one send, segments datagrams of size
for _ in range(runs):
    s.sendto(bytes(segments * size), (sys.argv[1], 9))
time.sleep(0.2)  # HTB counts what it dequeued: 45 kB take 4 ms at 100 Mbit/s
print(json.dumps(counters.delta()))
"""


@pytest.mark.root
@root
def test_htb_counts_every_datagram_of_a_gso_run_the_bridge_one_frame(tmp_path: Path) -> None:
    """With the offloads on, 10 UDP GSO sends of 32 datagrams of 100 bytes cross the worker's
    veth and the bridge as 10 buffers (the bridge port's counters: 10 frames, headers once);
    the counter the bench reads counts the 320 datagrams and their 320 x 142 frame bytes, and
    so does the one ``ncina topo``'s workers read in their host (``LinkCounters``; their
    interface's own counters, read before, count what the bridge port does)."""
    from ncina.topo.config import TopoConfig
    from ncina.topo.runner import build_net
    from ncina.topo.topos import aggregator_ip

    from ncina.harness.links import htb_sent, uplinks

    runs, segments, size = 10, 32, 100
    script = tmp_path / "gso_send.py"
    script.write_text(GSO_SEND)
    net, topo = build_net(TopoConfig(out=tmp_path, workers=1, bw=100, offloads=True,
                                     prefix=f"g{os.getpid() % 100000}"))  # fmt: skip
    try:
        net.start()
        [end] = uplinks(net, topo)
        port = (end.link.intf2 if end.link.intf1 is end else end.link.intf1).name
        stats = Path("/sys/class/net", port, "statistics")

        def bridge() -> tuple[int, int]:
            return (int((stats / "rx_bytes").read_text()), int((stats / "rx_packets").read_text()))

        before, bridge_before = htb_sent(end), bridge()
        out = end.node.cmd(sys.executable, script, aggregator_ip(0), runs, segments, size,
                           end.name, "2>&1")  # fmt: skip
        after, bridge_after = htb_sent(end), bridge()
    finally:
        net.stop()
    frame = size + ETH_IPV4_UDP_HEADERS
    assert (after[0] - before[0], after[1] - before[1]) == (runs * segments * frame,
                                                            runs * segments)  # fmt: skip
    topo = json.loads(out)
    assert (topo["tx_bytes"], topo["tx_packets"]) == (runs * segments * frame, runs * segments)
    # The bridge's port, the counter before: each run one frame, its headers once.
    assert (bridge_after[0] - bridge_before[0], bridge_after[1] - bridge_before[1]) == (
        runs * (segments * size + ETH_IPV4_UDP_HEADERS), runs)


@pytest.mark.root
@root
def test_with_offloads_gso_runs_cross_the_fabric_whole_and_the_sums_stay_exact(
    tmp_path: Path,
) -> None:
    output = tmp_path / "fabric.jsonl"
    status = main(["bench", "fabric", "--workers", "2", "--elements", "20000", "--repeat", "1",
                   "--backend", "socket", "--k", "64", "--offloads", "--workdir", str(tmp_path),
                   "--limit-seconds", "0", "--output", str(output)])  # fmt: skip
    assert status == 0
    figures = json.loads(output.read_text())
    assert figures["exact"] is True and figures["offloads"] is True
    assert figures["link_fraction"] > 0 and figures["gloo_link_fraction"] > 0
    # HTB counts every datagram of a run: without a copy a worker's uplink carried its chunks'
    # frames once, byte for byte (the bridge's counters had each run's headers once).
    [run] = figures["runs"]
    assert figures["retransmissions"] == 0, run
    assert run["uplink_bytes"] == [useful_frame_bytes(20000, 64)] * 2, run
    # The aggregator's UDP GRO socket took the workers' runs as runs: fewer buffers than
    # datagrams (without offloads the workers' veths cut every run: one buffer a datagram).
    io = json.loads((tmp_path / "run0" / "aggregator0.json").read_text())["socket"]
    assert io["rx_coalesced"] > 0, io


@pytest.mark.root
@root
def test_a_stopped_run_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM while the workers all-reduce (as Ctrl-C or a CI timeout would stop it): the run
    ends with status 130, its network is gone and so is every process it started (each one's
    command line names a file of its --workdir)."""
    workdir = tmp_path / "work"
    bench = subprocess.Popen(
        [sys.executable, "-m", "ncina.cli", "bench", "fabric", "--workers", "2", "--elements",
         "1000000", "--bw", "1", "--repeat", "1", "--backend", "python", "--workdir",
         str(workdir), "--output", str(tmp_path / "fabric.jsonl")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        cwd=tmp_path,  # not the repository root, whose mininet/ would shadow Mininet's package
    )  # fmt: skip
    try:
        # The INA workers' spec exists once the network, the aggregator and the reference are
        # up; a megabyte per worker over 1 Mbit/s links then takes seconds.
        spec = workdir / "run0" / "ina" / "spec.json"
        limit = time.monotonic() + 100
        while not spec.exists() and bench.poll() is None and time.monotonic() < limit:
            time.sleep(0.05)
        assert spec.exists(), bench.communicate(timeout=60)[1].decode(errors="replace")
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130, err.decode(errors="replace")
    assert links(f"b{bench.pid % 100000}") == []
    assert processes_mentioning(str(workdir)) == []


def test_inas_advantage_splits_into_compression_and_aggregation() -> None:
    """The README's headline: at N = 4 gloo's ring sends 1.5 tensors of 4-byte floats per
    worker, INA one of 1-byte codes: 4x from compression, 1.5x from adding in the network, 6x
    in all, so INA's time is at best 1/6 of gloo's on the same links (issue 36's 0.167)."""
    from ncina.harness.figures import ina_advantage

    assert ina_advantage(4) == {"compression": 4.0, "aggregation": 1.5, "bytes_ratio": 6.0,
                                "ideal_vs_gloo": 0.1667}  # fmt: skip
    assert ina_advantage(2)["aggregation"] == 1.0  # two workers: a ring sends one tensor too
    assert ina_advantage(8)["bytes_ratio"] == 7.0



def test_a_k_past_the_leaves_int_lanes_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leaf-spine run's job is a leaf's (JobSpec: its workers of the tree's total), whose
    partial sums go up as 8-byte int lanes: K 183 does not fit MTU 1500 (182 does), refused
    before any network is built."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # the checks come before any network
    err = refusal(tmp_path, capsys, "--topo", "leafspine", "--backend", "python", "--k", "183")
    assert "k=183 int elements take 1464 payload bytes, more than a datagram has at MTU 1500; " \
        "the largest k there is 182" in err
