"""The topology runner: one Mininet network, training over it with INA+NC8, then the gloo baseline.

:func:`run_topology` builds the topology (:mod:`ncina.topo.topos`) on Linux bridges (on a P4 switch
with BACKEND=bmv2), starts ``ncina aggregator`` on every aggregator node (the switch's) and ``ncina
train`` on every worker host, waits for training to finish while showing rank 0's progress (a
tqdm bar and a line per epoch, from its metrics file), stops
the aggregators (which write their stats on SIGTERM), then trains again with gloo's fp32 all-reduce
on the same network. Everything a run writes goes to its directory: per-worker logs and metrics
(``<mode>/worker<r>.log|.jsonl``), aggregator logs and stats (``ina/aggregator<j>.log|.json``),
``results.json`` and ``plot.png``.

The runner owns every process it starts (:class:`Processes`) and stops each by its PID, then
stops the network, whatever happened: nothing is left behind, and nothing it did not start is
touched. Node and interface names carry a per-process prefix so that concurrent runs (a test
while ``make topo`` runs) do not collide.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ncina.aggregator import process as aggproc
from ncina.aggregator.backends import names
from ncina.aggregator.backends.bmv2 import toolchain
from ncina.aggregator.backends.dpdk import netns as dpdk_netns
from ncina.aggregator.jobs import check_mtu_range
from ncina.proto.header import PORT
from ncina.proto.job import JobSpec
from ncina.proto.profiles import DEFAULT, DEFAULT_RESULTS, TOFINO, TOFINO_MAX_K
from ncina.proto.wire import DEFAULT_MTU
from ncina.topo import report
from ncina.topo.config import UPLINK_LOSS_AT_WORKER, TopoConfig, record
from ncina.topo.topos import (
    LeafSpineTopo,
    P4Switch,
    StarTopo,
    aggregator_ip,
    topos,
    worker_ip,
)
from ncina.worker import models
from ncina.worker.train import LACKS as TRAIN_LACKS

from mininet.net import Mininet
from mininet.node import Host
from mininet.nodelib import LinuxBridge
from ncina.common import cpu
from ncina.common.jsonlines import read_new_events

NCINA = Path(sys.executable).with_name("ncina")  # the console script of this environment


def profile_config(cfg: TopoConfig) -> TopoConfig:
    """The run under ``cfg.profile`` (``tofino``): the design's int32 results, at most its lanes
    per packet (``ncina.proto.profiles.TOFINO_MAX_K``) and the pool chosen for them."""
    job = cfg.job
    return replace(cfg, job=replace(job, profile=TOFINO, result=DEFAULT_RESULTS[TOFINO],
                                    k=min(job.k, TOFINO_MAX_K),
                                    pool_size=cfg.profile_pool_size or job.pool_size))  # fmt: skip
# The rendezvous port of each mode (no TIME_WAIT clash).
GLOO_PORTS = {"ina": 29500, "gloo": 29501, "ncina": 29502, "tofino": 29503}
STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
CAPTURE_DRAIN = 0.5  # seconds tcpdump gets to write the last packets before its SIGTERM
PID_FILE = Path("runs", "topo.pid")  # the running topology's PID, for `make stop`


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def check_backend(
    backend: str, aggregators: int = 1, mtu: int = DEFAULT_MTU, topo: str = "star"
) -> None:
    """Raise a clear error when the chosen aggregator backend cannot run here (or not on links
    of this MTU, or not in this topology)."""
    if backend not in names():
        raise RuntimeError(f"BACKEND={backend} is not a backend (available: {', '.join(names())})")
    if topo == "leafspine" and backend not in ("python", "socket", "dpdk"):
        raise RuntimeError(f"--topo leafspine runs the python, socket or dpdk backend "
                           f"(BACKEND={backend}: the P4 data plane carries no int partial "
                           "sums)")  # fmt: skip
    check_mtu_range(mtu)
    if mtu != DEFAULT_MTU and backend in ("dpdk", "bmv2"):
        # af_packet's default frames and the P4 switch's ports are set up for 1500-byte frames
        raise ValueError(f"--mtu {mtu}: BACKEND={backend} runs on links of MTU {DEFAULT_MTU}")
    if backend == "bmv2":
        if aggregators != 1:
            raise RuntimeError("BACKEND=bmv2 aggregates in the topology's one switch: use the star "
                               "topology (one aggregator)")  # fmt: skip
        reason = toolchain.missing()
        if reason:
            raise RuntimeError(f"BACKEND=bmv2 cannot run: {reason}")


class Processes:
    """The processes of a run: started in Mininet hosts, stopped by PID."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, host: Host, argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host``'s namespace, stdout and stderr to ``log``."""
        with log.open("wb") as out:
            proc = host.popen(list(argv), stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        """SIGTERM each running process, SIGKILL those still running after the grace period."""
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        self.stop(self.procs)


def set_mtu(net: Mininet, mtu: int) -> None:
    """Give every interface of the started network (hosts, switch ports, the bridge) ``mtu``."""
    for node in [*net.hosts, *net.switches]:
        names = [i.name for i in node.intfList() if i.name != "lo"]
        names += [node.name] if node in net.switches else []  # the bridge device itself
        for name in names:
            out = node.cmd(f"ip link set dev {name} mtu {mtu} 2>&1 && echo ok").strip()
            if not out.endswith("ok"):
                raise RuntimeError(f"cannot set MTU {mtu} on {name}: {out}")


def build_net(cfg: TopoConfig) -> tuple[Mininet, StarTopo]:
    """The network of ``cfg``, not yet built: ``net.start()`` builds it (inside the caller's
    ``try``, so that ``net.stop()`` also removes a half-built network)."""
    in_switch = cfg.backend == "bmv2"  # the switch aggregates: no aggregator nodes
    shape = {"bw": cfg.bw, "agg_bw": cfg.agg_bw, "loss": cfg.loss, "prefix": cfg.prefix,
             "uplink_at_worker": cfg.backend in UPLINK_LOSS_AT_WORKER}  # fmt: skip
    if cfg.offloads:  # a star's only (TopoConfig checks)
        shape["offloads"] = True
    if cfg.topo == "leafspine":
        topo: StarTopo = LeafSpineTopo(workers=cfg.workers, leaves=cfg.leaves, **shape)
    else:
        topo = topos[cfg.topo](
            workers=cfg.workers, aggregators=0 if in_switch else cfg.aggregators, **shape
        )
    net = Mininet(topo=topo, switch=P4Switch if in_switch else LinuxBridge, controller=None,
                  autoStaticArp=True, build=False)  # fmt: skip
    return net, topo


def start_aggregators(
    net: Mininet, topo: StarTopo, cfg: TopoConfig, procs: Processes, run_dir: Path,
    extra: Sequence[str] = (),
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Start one ``ncina aggregator`` per aggregator node (with BACKEND=bmv2, the one of the
    P4 switch), with the further options ``extra`` (star and multi only); wait until each is
    listening. Returns the processes and the addresses the workers use (in leaf-spine: the
    leaves', the spine is the last process)."""
    if isinstance(topo, LeafSpineTopo):
        return start_tree(net, topo, cfg, procs, run_dir)
    started, addresses = [], []
    for j, name in enumerate(topo.aggregator_names or [topo.switch_name]):
        address = f"{aggregator_ip(j)}:{PORT}"
        log = run_dir / f"aggregator{j}.log"
        argv = aggregator_argv(cfg, j, address, run_dir, cfg.job)
        argv += ["--seed", str(cfg.seed + j)]
        if cfg.backend == "dpdk":
            argv += _dpdk_host(net, cfg, name)
        elif cfg.backend == "bmv2":
            argv += switch_arguments(net, topo, cfg, run_dir)
        argv += extra
        started.append(procs.start(net.get(name), argv, log))
        addresses.append(address)
    # A bmv2 aggregator may first compile the P4 program for K (once per K and source change).
    timeout = 600.0 if cfg.backend == "bmv2" else 30.0
    for j, proc in enumerate(started):
        aggproc.wait_ready(proc, run_dir / f"aggregator{j}.log", timeout=timeout)
    return started, addresses


def _dpdk_host(net: Mininet, cfg: TopoConfig, name: str) -> list[str]:
    """With BACKEND=dpdk, the extra arguments of aggregator node ``name``: the data plane serves
    the host's interface, and the host's kernel must stay silent (``prepare_host``)."""
    return dpdk_netns.prepare_host(net.get(name)) if cfg.backend == "dpdk" else []


def aggregator_argv(
    cfg: TopoConfig, j: int, address: str, run_dir: Path, job: JobSpec
) -> list[str]:
    """``ncina aggregator`` for aggregator node ``j`` serving ``job``: its fields, the mode
    (server mode: the workers' compressor; INA: the result format), the key file."""
    server = cfg.mode == "server"  # no result format: the workers' compressor's payloads
    argv = [
        str(NCINA), "aggregator", "--backend", cfg.backend, "--listen", address,
        *job.to_args(role="aggregator", lacks=("result",) if server else ()),
        "--stats", str(run_dir / f"aggregator{j}.json"),
    ]  # fmt: skip
    if server:  # the aggregator runs the workers' compressor
        argv += ["--mode", "server", "--compressor", str(cfg.compressor)]
    if cfg.key_file is not None:
        argv += ["--key-file", str(cfg.key_file.resolve())]
    return argv


def start_tree(
    net: Mininet, topo: LeafSpineTopo, cfg: TopoConfig, procs: Processes, run_dir: Path
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """The spine's aggregator (``--uplink int``, the leaves its members), then each leaf's
    (``--upstream`` the spine), every one with the total of the workers (docs/protocol.md,
    "Hierarchical aggregation"); the leaves do the spine's handshake before they are ready."""
    leaves = len(topo.aggregator_names) - 1
    star = cfg.job
    spine_address = f"{aggregator_ip(leaves)}:{PORT}"
    spine_job = replace(star, workers=leaves, total_workers=cfg.workers, uplink="int")
    argv = aggregator_argv(cfg, leaves, spine_address, run_dir, spine_job)
    argv += ["--seed", str(cfg.seed)]
    argv += _dpdk_host(net, cfg, topo.aggregator_names[leaves])
    spine = procs.start(net.get(topo.aggregator_names[leaves]), argv,
                        run_dir / f"aggregator{leaves}.log")  # fmt: skip
    aggproc.wait_ready(spine, run_dir / f"aggregator{leaves}.log", timeout=30.0)
    started, addresses = [], []
    for i in range(leaves):
        address = f"{aggregator_ip(i)}:{PORT}"
        leaf_job = replace(star, workers=topo.workers_per_leaf, total_workers=cfg.workers)
        argv = aggregator_argv(cfg, i, address, run_dir, leaf_job)
        argv += ["--seed", str(cfg.seed), "--upstream", spine_address, "--upstream-rank", str(i)]
        argv += _dpdk_host(net, cfg, topo.aggregator_names[i])  # resolves the spine by ARP
        started.append(procs.start(net.get(topo.aggregator_names[i]), argv,
                                   run_dir / f"aggregator{i}.log"))  # fmt: skip
        addresses.append(address)
    for i, proc in enumerate(started):
        aggproc.wait_ready(proc, run_dir / f"aggregator{i}.log", timeout=30.0)
    return [*started, spine], addresses


def start_captures(
    net: Mininet, topo: StarTopo, procs: Processes, run_dir: Path
) -> list[subprocess.Popen[bytes]]:
    """``--pcaps`` without BMv2: tcpdump on the switch's end of every aggregator's link (in the
    root namespace, so that it sees what any backend sends and receives, DPDK's included)
    writes the job's UDP to ``pcaps/aggregator<j>.pcap``; returns once each is capturing."""
    if shutil.which("tcpdump") is None:
        raise RuntimeError("--pcaps needs tcpdump (a Debian package: make setup installs it)")
    switch = net.get(topo.switch_name)
    (run_dir / "pcaps").mkdir(exist_ok=True)
    started = []
    for j, name in enumerate(topo.aggregator_names):
        [link] = net.linksBetween(net.get(name), switch)
        iface = (link.intf1 if link.intf1.node is switch else link.intf2).name
        # Each packet to the file as it comes (--immediate-mode, -U); -Z root: the run's
        # directory is root's.
        argv = ["tcpdump", "-i", iface, "--immediate-mode", "-U", "-Z", "root", "-B", "16384",
                "-w", str(run_dir / "pcaps" / f"aggregator{j}.pcap"), "udp", "port", str(PORT)]
        log = run_dir / "pcaps" / f"tcpdump{j}.log"
        started.append(procs.start(switch, argv, log))
        deadline = time.monotonic() + 10.0
        while "listening on" not in log.read_text(errors="replace"):
            if started[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tcpdump on {iface} did not start:\n{aggproc.tail(log)}")
            time.sleep(0.05)
    return started


def switch_arguments(net: Mininet, topo: StarTopo, cfg: TopoConfig, run_dir: Path) -> list[str]:
    """``ncina aggregator --backend bmv2`` arguments for the P4 switch: its worker-facing
    interfaces in rank order (rank r on switch port r + 1), then any other host's on the switch
    (``ncina soak``'s stranger: a port of its own, switched, in no job), each host's MAC address
    on its port (the gloo baseline's frames are switched, not flooded), its log and pcaps."""
    switch = net.get(topo.switch_name)
    ifaces, argv = [], []
    for rank, name in enumerate(topo.worker_names):
        host = net.get(name)
        [link] = net.linksBetween(host, switch)
        ifaces.append((link.intf1 if link.intf1.node is switch else link.intf2).name)
        argv += ["--rank-port", f"{rank}={rank + 1}", "--l2-host", f"{host.MAC()}={rank + 1}"]
    for host in net.hosts:
        links = net.linksBetween(host, switch) if host.name not in topo.worker_names else []
        for link in links:
            ifaces.append((link.intf1 if link.intf1.node is switch else link.intf2).name)
            argv += ["--l2-host", f"{host.MAC()}={len(ifaces)}"]
    argv += ["--iface", ",".join(ifaces), "--device-id", "1",
             "--switch-log", str(run_dir / "logs" / f"bmv2-{topo.switch_name}.log")]  # fmt: skip
    if cfg.pcaps:
        argv += ["--pcap-dir", str(run_dir / "pcaps")]
    return argv


def train(
    net: Mininet,
    topo: StarTopo,
    cfg: TopoConfig,
    procs: Processes,
    run_dir: Path,
    aggregators: Sequence[str],
    mode: str,
) -> list[Path]:
    """Run ``ncina train`` on every worker: ``mode`` ``ina`` (the hook, through
    ``aggregators``), ``ncina`` (the process-group backend, through them) or ``gloo``.

    Shows rank 0's progress while waiting; returns the metrics files in rank order.
    """
    workers, metrics = start_workers(net, topo, cfg, procs, run_dir, aggregators, mode)
    progress = Progress(metrics[0], f"{mode} rank 0", cfg.epochs, cfg.max_steps)
    try:
        wait_workers(workers, progress, run_dir, time.monotonic() + cfg.timeout)
    finally:
        progress.close()
    return metrics


def start_workers(
    net: Mininet,
    topo: StarTopo,
    cfg: TopoConfig,
    procs: Processes,
    run_dir: Path,
    aggregators: Sequence[str],
    mode: str,
    extra: Sequence[str] = (),
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """Start ``ncina train`` on every worker (see :func:`train`; ``extra``: further options of
    every rank) without waiting; returns the processes and their metrics files, in rank order."""
    master = f"{worker_ip(0)}:{GLOO_PORTS[mode]}"
    workers, metrics = [], []
    for rank, name in enumerate(topo.worker_names):
        host = net.get(name)
        metrics.append(run_dir / f"worker{rank}.jsonl")
        argv = [
            str(NCINA), "train", "--rank", str(rank),
            # --mtu too: a worker checks that K fits its own MTU (JobSpec)
            *cfg.job.to_args(role="worker", lacks=TRAIN_LACKS),
            "--master", master, "--iface", host.defaultIntf().name, "--model", cfg.model,
            "--epochs", str(cfg.epochs), "--batch-size", str(cfg.batch_size),
            "--bucket-cap-mb", str(cfg.bucket_cap_mb),
            "--seed", str(cfg.seed), "--metrics", str(metrics[-1]),
        ]
        if isinstance(topo, LeafSpineTopo) and aggregators:  # this rank's leaf aggregator
            width = topo.workers_per_leaf
            argv += ["--aggregator", aggregators[rank // width], "--leaf-workers", str(width)]
        else:
            argv += [arg for a in aggregators for arg in ("--aggregator", a)]
        argv += ["--lr", str(cfg.lr)] if cfg.lr is not None else []
        argv += ["--max-steps", str(cfg.max_steps)] if cfg.max_steps else []
        argv += ["--verify"] if cfg.verify else []
        argv += ["--compressor", cfg.compressor] if cfg.compressor else []
        argv += ["--mode", cfg.mode]
        argv += ["--backend", "ncina"] if mode == "ncina" else []
        if aggregators and cfg.key_file is not None:
            argv += ["--key-file", str(cfg.key_file.resolve())]
        workers.append(procs.start(host, [*argv, *extra], run_dir / f"worker{rank}.log"))
    return workers, metrics


class Progress:
    """Rank 0's progress, read from its metrics file as it grows: a tqdm bar of the steps (on a
    terminal; tqdm turns itself off elsewhere) with the loss and the bytes sent, and one line per
    epoch and at the end. The workers' full per-step lines stay in their logs."""

    def __init__(self, metrics: Path, label: str, epochs: int, max_steps: int | None) -> None:
        from tqdm import tqdm

        self.metrics = metrics
        self.epochs = epochs
        self.max_steps = max_steps
        self.offset = 0
        self.steps = 0  # rank 0's steps shown (the bar keeps no count when it is turned off)
        self.bar = tqdm(desc=label, unit="step", disable=None, dynamic_ncols=True, leave=True)

    def poll(self) -> None:
        """Show the events rank 0 has written since the last call (whole lines only)."""
        self.offset, events = read_new_events(self.metrics, self.offset)
        for event in events:
            self.show(event)

    def show(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "start":
            total = self.epochs * event["steps_per_epoch"]
            self.bar.reset(total=min(total, self.max_steps or total))
            self.bar.write(f"{event['model']}: {event['parameters']} parameters, "
                           f"compute {event['compute_step_s'] * 1e3:.1f} ms/step")  # fmt: skip
        elif kind == "step":
            self.steps += 1
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{event['loss']:.4f}",
                                 MB=f"{event.get('tx_bytes', 0) / 1e6:.2f}")  # fmt: skip
        elif kind == "epoch":
            self.bar.write(f"epoch {event['epoch']}: test accuracy {event['test_acc']:.2f}% "
                           f"loss {event['test_loss']:.4f}, {event['time']:.1f} s, "
                           f"{event.get('tx_bytes', 0) / 1e6:.2f} MB sent")  # fmt: skip
        elif kind == "end":
            exposed = event["exposed_comm_s"]  # None: not measured (the ncina backend, no hook)
            self.bar.write(f"done: {event['steps']} steps, {event['samples_per_s']:.1f} "
                           "samples/s" + ("" if exposed is None else
                                          f", exposed communication {exposed:.2f} s"))

    def close(self) -> None:
        self.poll()
        self.bar.close()


def wait_workers(
    workers: Sequence[subprocess.Popen[bytes]], progress: Progress, run_dir: Path,
    deadline: float,
) -> None:
    """Wait until every worker has exited 0, showing rank 0's progress; raise on any failure."""
    while True:
        progress.poll()
        codes = [w.poll() for w in workers]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r = failed[0]
            log = run_dir / f"worker{r}.log"
            raise RuntimeError(f"worker {r} exited with status {codes[r]}:\n{aggproc.tail(log)}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"training did not finish in time; logs in {run_dir}")
        time.sleep(0.2)


def run_mode(
    net: Mininet, topo: StarTopo, cfg: TopoConfig, procs: Processes, mode: str, repeat: int = 0
) -> dict[str, Any]:
    """One training run (``ina``, ``ncina``, ``tofino``: INA under the profile, or ``gloo``) on
    the running network; its summary. Repeats after the first go to ``<mode>-<repeat>/`` and
    train with seed ``cfg.seed + repeat`` (the initial weights, the shuffles, the rounding), so
    that their spread is the seed's."""
    cfg = replace(cfg, seed=cfg.seed + repeat)
    if mode == "tofino" or (cfg.profile != DEFAULT and cfg.backend == "bmv2"):
        cfg = profile_config(cfg)  # BMv2: the switch runs the twin for every mode
    run_dir = cfg.out / (f"{mode}-{repeat}" if repeat else mode)
    run_dir.mkdir(parents=True, exist_ok=True)
    label = report.LABELS[mode]
    if mode == "ina" and cfg.compressor:  # e.g. "server+3lc", "INA+natdither:s=8"
        label = f"{'INA' if cfg.mode == 'ina' else 'server'}+{cfg.compressor}"
    print(f"*** {label}: {cfg.workers} workers, {cfg.model}, logs in {run_dir}")
    aggregators: list[subprocess.Popen[bytes]] = []
    addresses: list[str] = []
    captures: list[subprocess.Popen[bytes]] = []  # BMv2 writes pcaps; other backends, tcpdump
    if mode == "ina" and cfg.pcaps and cfg.backend != "bmv2":
        captures = start_captures(net, topo, procs, run_dir)
    # The P4 switch is the network: it runs for the baseline too, whose workers it only switches.
    if mode in ("ina", "ncina", "tofino") or cfg.backend == "bmv2":
        aggregators, addresses = start_aggregators(net, topo, cfg, procs, run_dir)
    if mode == "gloo":
        addresses = []
    aggregator_cpu = -sum(cpu.process_cpu_s(p.pid) for p in aggregators)
    try:
        metrics = train(net, topo, cfg, procs, run_dir, addresses, mode)
        aggregator_cpu += sum(cpu.process_cpu_s(p.pid) for p in aggregators)
    finally:
        procs.stop(aggregators)  # SIGTERM: the aggregators write their stats and exit
        if captures:  # tcpdump drops what it has not read at SIGTERM: let it drain first
            time.sleep(CAPTURE_DRAIN)
            procs.stop(captures)
    spine = 1 if addresses and isinstance(topo, LeafSpineTopo) else 0  # its stats come last
    stats = [run_dir / f"aggregator{j}.json" for j in range(len(addresses) + spine)]
    return report.summarize(mode, metrics, stats, label, max(0.0, aggregator_cpu))


def run_topology(cfg: TopoConfig) -> dict[str, Any]:
    """Build the network, train with INA+NC8 (and the gloo baseline), write the results."""
    check_backend(cfg.backend, cfg.aggregators, cfg.job.mtu, cfg.topo)
    models.check(cfg.model)
    if not NCINA.exists():
        raise RuntimeError(f"{NCINA} not found: install ncina into this environment (make setup)")
    cfg.out.mkdir(parents=True, exist_ok=True)
    net, topo = build_net(cfg)
    procs = Processes()
    # `make stop` sends SIGTERM to this PID: stop the run as Ctrl-C would, cleaning up below.
    PID_FILE.parent.mkdir(parents=True, exist_ok=True)
    PID_FILE.write_text(f"{os.getpid()}\n")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        net.start()
        if cfg.job.mtu != DEFAULT_MTU:
            set_mtu(net, cfg.job.mtu)
        # --profile tofino: a run under it beside the default profile's (BMv2: instead of it)
        ina = ("ina",) if cfg.profile == DEFAULT or cfg.backend != "bmv2" else ()
        modes = (*ina, *(("tofino",) if cfg.profile != DEFAULT else ()),
                 *(("ncina",) if cfg.torch_backend else ()),
                 *(("gloo",) if cfg.baseline else ()))  # fmt: skip
        repeats: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for i in range(cfg.repeat):
            if cfg.repeat > 1:
                print(f"*** repeat {i + 1} of {cfg.repeat}")
            for mode in modes:
                repeats[mode].append(run_mode(net, topo, cfg, procs, mode, i))
    finally:
        procs.stop_all()
        net.stop()
        signal.signal(signal.SIGTERM, previous)
        PID_FILE.unlink(missing_ok=True)
    return report.write(cfg.out, record(cfg), repeats)
