"""``ncina soak``: train for a given time over Mininet while the aggregator is SIGKILLed and
restarted, the links lose packets and a stranger sends hostile datagrams (docs/reliability.md,
"Soak").

The topology runner's network (:func:`ncina.topo.runner.build_net`, the star) gets one more
host, the stranger (``<prefix>x0``, ``STRANGER_IP``), whose frames the loss rules let through
(the loss is the workers' links'; what the stranger sends is accounted for exactly). Training is
a sequence of runs of ``ncina train`` (:func:`ncina.topo.runner.start_workers`), each of
``steps_per_run`` steps of the default model through a keyed job (unkeyed on a backend without
the tag, bmv2: no forged results then, as nothing tells a worker one from a real one), until
``minutes`` have passed. On bmv2 the stranger has a switch port of its own in no job
(``ncina.topo.runner.switch_arguments``); ``profile`` tofino runs the Tofino design's twin
(int results, its K).
One thread drives everything, so nothing overlaps that would blur a count: it polls every
rank's metrics file, kills the aggregator at seeded random times (and once per
``last_bucket_every`` runs when rank 0 enters the run's last step), starts it again and times
the recovery, runs a stranger round (:mod:`ncina.harness.stranger`) between the aggregator's
stats read before and after it, samples resident memory, and declares a hang when no rank's step
count grows for ``hang_s`` seconds. The summary (``ncina.harness.soak_checks.judge`` names each
failed target) goes to ``soak.json``.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ncina.aggregator import process as aggproc
from ncina.aggregator.backends import names
from ncina.harness.fuzzing import resident_kib
from ncina.harness.soak_checks import (
    RankLog,
    changed,
    checkpoints,
    drawn_generation,
    handshakes_of,
    hostile_counted,
    judge,
    restarted_in_last_step,
    rss_summary,
)
from ncina.proto.header import MAX_GENERATION, PORT
from ncina.proto.job import JobSpec
from ncina.proto.profiles import TOFINO, TOFINO_MAX_K
from ncina.topo.config import JOB, SoakConfig, TopoConfig
from ncina.topo.runner import Processes, build_net, check_backend, start_aggregators, start_workers
from ncina.topo.topos import PREFIX_LEN, InaHost, InaLink, aggregator_ip, worker_ip

STRANGER_IP = "10.0.2.1"
SUMMARY = "soak.json"
QUIET_AFTER_RESTART = 3.0  # seconds after a restart before a stranger round (handshakes settle)
# A rank that gave up at its --deadline says one of these (ncina.worker.client's TimeoutError).
DEADLINE_MESSAGES = ("TimeoutError", "no result from aggregator")
POLL = 0.05  # seconds between two looks at the ranks' metrics
POLL_AT_THE_END = 0.01  # the same while a kill waits for rank 0's last step
END_MARGIN = 30  # steps before a run's last in which nothing else may delay that kill


class Soak:
    """The soak's state while it runs (see the module's docstring)."""

    def __init__(self, cfg: SoakConfig) -> None:
        from ncina.topo.cli import topo_k, topo_pool_size

        self.cfg = cfg
        self.rnd = random.Random(cfg.seed)
        key = cfg.out / "job.key"
        cfg.out.mkdir(parents=True, exist_ok=True)
        key.write_text(self.rnd.randbytes(16).hex())
        self.keyed = cfg.backend in names(keyed=True)
        twin = cfg.profile == TOFINO
        k = TOFINO_MAX_K if twin else topo_k(cfg.backend, "ina", "nc8", self.keyed)
        job = JobSpec(job=JOB, workers=cfg.workers, k=k,
                      pool_size=topo_pool_size(cfg.backend, k, cfg.bw),
                      result="int" if twin else "nc8", profile=cfg.profile)  # fmt: skip
        self.topo_cfg = TopoConfig(
            out=cfg.out, workers=cfg.workers, backend=cfg.backend, bw=cfg.bw, loss=cfg.loss,
            epochs=10_000, max_steps=cfg.steps_per_run, seed=cfg.seed, job=job,
            key_file=key if self.keyed else None, baseline=False, prefix=cfg.prefix,
        )  # fmt: skip
        self.procs = Processes()
        self.generation = 0
        self.instances = 0
        self.aggregator: subprocess.Popen[bytes] | None = None
        self.agg_dir = cfg.out
        self.last_stats: dict[str, Any] | None = None  # the current instance's, last read
        self.drops: dict[str, int] = {}  # every instance's last counters, summed
        self.restarts: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.hostile: list[dict[str, Any]] = []
        self.hangs: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.rss: dict[str, list[tuple[float, int]]] = {}
        self.began = time.monotonic()
        self.current_run = 0

    # ---- the aggregator ----
    def start_aggregator(self, net: Any, topo: Any) -> float:
        """Start a new aggregator instance; returns when it is ready (monotonic time). Its
        generation is the one it names in its readiness line (``--generations random``: what
        it drew)."""
        self.instances += 1
        self.agg_dir = self.cfg.out / f"aggregator-{self.instances}"
        self.agg_dir.mkdir(parents=True, exist_ok=True)
        extra: list[str] = []
        if self.cfg.generations == "distinct":
            self.generation = self.rnd.choice(
                [g for g in range(1, MAX_GENERATION + 1) if g != self.generation])
            extra = ["--generation", str(self.generation)]
        [proc], _ = start_aggregators(net, topo, self.topo_cfg, self.procs, self.agg_dir, extra)
        self.aggregator = proc
        self.generation = drawn_generation(self.agg_dir / "aggregator0.log")
        return time.monotonic()

    def stop_aggregator(self) -> None:
        """Stop the aggregator (SIGTERM: it writes its last counters) and count them."""
        assert self.aggregator is not None
        aggproc.stop(self.aggregator)
        try:
            self.account(json.loads((self.agg_dir / "aggregator0.json").read_text()))
        except (OSError, ValueError) as exc:
            self.failures.append(f"aggregator {self.instances} left no stats: {exc}")
        self.aggregator = None

    def read_stats(self) -> dict[str, Any]:
        assert self.aggregator is not None
        self.last_stats = aggproc.request_stats(self.aggregator, self.agg_dir / "aggregator0.json")
        return self.last_stats

    def account(self, document: dict[str, Any]) -> None:
        """Add an instance's last counters to the soak's drops by reason."""
        self.last_stats = None
        if not document:
            return
        for section in (document["global"], *document["jobs"].values()):
            for reason, count in section["drops"].items():
                self.drops[reason] = self.drops.get(reason, 0) + count

    def kill(self, net: Any, topo: Any, ranks: list[RankLog], why: str,
             read_first: bool = True) -> dict[str, Any]:  # fmt: skip
        """SIGKILL the aggregator and start another. Its counters are read just before, or
        without ``read_first`` (a kill that must not wait: the one aimed at the last step) the
        last counters read are what it counted."""
        assert self.aggregator is not None
        try:
            self.account(self.read_stats() if read_first else self.last_stats or {})
        except RuntimeError as exc:
            self.failures.append(f"aggregator {self.instances} gave no stats before its "
                                 f"kill: {exc}")  # fmt: skip
        killed_at = time.monotonic()
        self.aggregator.send_signal(signal.SIGKILL)
        self.aggregator.wait()
        before = self.generation
        ready = self.start_aggregator(net, topo)
        restart = {"run": self.current_run, "why": why, "at_s": round(killed_at - self.began, 2),
                   "generation": self.generation, "same_generation": self.generation == before,
                   "steps_at_kill": [r.steps for r in ranks], "ready_s": ready,
                   "missed": all(r.end is not None for r in ranks), "recovery_s": None}  # fmt: skip
        self.restarts.append(restart)
        return restart

    # ---- the stranger ----
    def member_sockets(self, net: Any, topo: Any, workers: list[Any]) -> list[str]:
        """Each rank's UDP socket (``IP:PORT``), read with ``ss`` in its host ([] if not yet)."""
        members = []
        for rank, (name, proc) in enumerate(zip(topo.worker_names, workers, strict=True)):
            out = net.get(name).cmd("ss -Huanp")
            ports = [int(m.group(1)) for line in out.splitlines() if f"pid={proc.pid}," in line
                     for m in [re.search(r"\S+:(\d+)\s+\S+:\S+\s", line)] if m]  # fmt: skip
            if len(ports) != 1:
                return []
            members.append(f"{worker_ip(rank)}:{ports[0]}")
        return members

    def stranger_link(self, net: Any) -> dict[str, int]:
        """The counters of the stranger's link: what its interface sent and dropped, what the
        other end (a port of the switch or bridge, in this namespace) received and dropped."""
        node = net.get(f"{self.cfg.prefix}x0")
        own = node.defaultIntf()
        port = own.link.intf2 if own.link.intf1 is own else own.link.intf1
        sent = node.cmd(f"cat /sys/class/net/{own.name}/statistics/tx_packets "
                        f"/sys/class/net/{own.name}/statistics/tx_dropped").split()  # fmt: skip
        got = [int((Path("/sys/class/net") / port.name / "statistics" / name).read_text())
               for name in ("rx_packets", "rx_dropped")]  # fmt: skip
        return {"stranger_tx_packets": int(sent[0]), "stranger_tx_dropped": int(sent[1]),
                "port_rx_packets": got[0], "port_rx_dropped": got[1]}  # fmt: skip

    def stranger_round(self, net: Any, members: list[str]) -> dict[str, Any]:
        """One round of the stranger's datagrams between two reads of the aggregator's
        counters: how many of each kind were sent and how many the aggregator counted."""
        cfg = self.cfg
        before = self.read_stats()
        link_before = self.stranger_link(net)
        argv = [sys.executable, "-m", "ncina.harness.stranger",
                "--aggregator", f"{aggregator_ip(0)}:{PORT}",
                *self.topo_cfg.job.to_args("job", "k", "pool_size"),
                "--seed", str(self.rnd.getrandbits(32)), "--fuzz", str(cfg.fuzz),
                "--hellos", str(cfg.hellos), "--spoofed", str(cfg.spoofed),
                "--forged", str(cfg.forged if members and self.keyed else 0)]  # fmt: skip
        argv += [a for m in members for a in ("--member", m)]
        out = net.get(f"{cfg.prefix}x0").cmd(" ".join(argv))
        try:
            sent = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise RuntimeError(f"the stranger failed:\n{out}") from None
        time.sleep(0.3)  # its last datagrams reach the aggregator
        after = self.read_stats()
        counted = hostile_counted(after) - hostile_counted(before)
        handshakes = handshakes_of(after) - handshakes_of(before)
        to_aggregator = sent["fuzzed"] + sent["hellos"] + sent["spoofed"]
        round_ = {**sent, "dropped": counted, "answered": handshakes,
                  "uncounted": max(0, to_aggregator - counted - handshakes)}  # fmt: skip
        if round_["uncounted"]:  # where the uncounted ones went (the link's frames: every kind)
            round_["counters"] = changed({**before, "link": link_before},
                                         {**after, "link": self.stranger_link(net)})  # fmt: skip
        self.hostile.append(round_)
        return round_

    # ---- memory ----
    def sample(self, workers: list[Any], ranks: list[RankLog], run: int) -> None:
        """Resident memory of the aggregator and of every rank that has made a step (a rank's
        warm-up counts from its first step: importing PyTorch and loading the data before it
        are not what a soak judges)."""
        now = time.monotonic() - self.began
        named = [(f"aggregator-{self.instances}", self.aggregator)]
        named += [(f"run-{run}-rank{r}", w) for r, w in enumerate(workers) if ranks[r].steps]
        for name, proc in named:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(OSError, RuntimeError):  # exited since the poll
                    self.rss.setdefault(name, []).append((round(now, 2), resident_kib(proc.pid)))

    # ---- one run ----
    def run_once(self, net: Any, topo: Any, index: int, bar: Any) -> None:
        cfg = self.cfg
        self.current_run = index
        run_dir = cfg.out / f"run-{index}"
        run_dir.mkdir(parents=True, exist_ok=True)
        address = [f"{aggregator_ip(0)}:{PORT}"]
        workers, metrics = start_workers(net, topo, self.topo_cfg, self.procs, run_dir, address,
                                         "ina", ["--deadline", str(cfg.deadline)])  # fmt: skip
        ranks = [RankLog(m) for m in metrics]
        aimed = cfg.last_bucket_every > 0 and index % cfg.last_bucket_every == 0
        next_kill = time.monotonic() + self.rnd.uniform(*cfg.restart_s)
        next_round = time.monotonic() + cfg.stranger_every
        next_sample = time.monotonic()
        progress, progress_at = -1, time.monotonic()
        last_restart = time.monotonic()
        pending: list[dict[str, Any]] = []
        members: list[str] = []
        forged = 0
        pre_read = False
        run: dict[str, Any] = {"run": index, "restarts": 0, "last_bucket_restart": None}
        while True:
            for r in ranks:
                r.poll()
            now = time.monotonic()
            codes = [w.poll() for w in workers]
            done = [r.steps if r.end is None else cfg.steps_per_run + 1 for r in ranks]
            for restart in list(pending):
                if all(d > s for d, s in zip(done, restart["steps_at_kill"], strict=True)):
                    restart["recovery_s"] = round(now - restart.pop("ready_s"), 3)
                    pending.remove(restart)
            if sum(done) != progress:
                progress, progress_at = sum(done), now
            bar.n = min(bar.total, round(now - self.began))
            bar.set_postfix(run=index, steps=min(r.steps for r in ranks),
                            restarts=len(self.restarts), hangs=len(self.hangs))  # fmt: skip
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                tail = aggproc.tail(run_dir / f"worker{r}.log", 8)
                if any(m in tail for m in DEADLINE_MESSAGES):  # the rank's deadline: a stall
                    self.hangs.append({"run": index, "kind": "worker deadline", "rank": r,
                                       "steps": [x.steps for x in ranks], "log": tail,
                                       "after_restart": [{k: v for k, v in p.items()
                                                          if k != "ready_s"}
                                                         for p in pending]})  # fmt: skip
                else:
                    self.failures.append(f"run {index}: rank {r} exited with status "
                                         f"{codes[r]}:\n{tail}")  # fmt: skip
                break
            if all(c == 0 for c in codes):
                break
            if now - progress_at > cfg.hang_s and not pending:
                self.hangs.append({"run": index, "kind": "stall", "steps": [r.steps for r in ranks],
                                   "stalled_s": round(now - progress_at, 1)})  # fmt: skip
                break
            if pending and now - progress_at > cfg.hang_s:
                self.hangs.append({"run": index, "kind": "stall after a restart",
                                   "steps": [r.steps for r in ranks],
                                   "stalled_s": round(now - progress_at, 1),
                                   "restart": {k: v for k, v in pending[0].items()
                                               if k != "ready_s"}})  # fmt: skip
                break
            if now >= next_sample:
                self.sample(workers, ranks, index)
                next_sample = now + cfg.sample_s
            last_step = ranks[0].steps >= cfg.steps_per_run - 1 and ranks[0].end is None
            # Near the end nothing may delay the aimed kill, and a forged result must still
            # meet a call that reads it.
            busy_ok = min(done) > 0 and max(done) < cfg.steps_per_run - END_MARGIN
            if aimed and not pre_read and max(done) >= cfg.steps_per_run - 3:
                self.read_stats()  # the aimed kill's counters, read before it must not wait
                pre_read = True
            if aimed and last_step and run["last_bucket_restart"] is None:
                restart = self.kill(net, topo, ranks, "last bucket", read_first=False)
                run["last_bucket_restart"] = restart
                pending.append(restart)
                last_restart = time.monotonic()
            elif now >= next_kill and busy_ok:
                pending.append(self.kill(net, topo, ranks, "random"))
                next_kill = time.monotonic() + self.rnd.uniform(*cfg.restart_s)
                last_restart = time.monotonic()
            elif (cfg.stranger_every > 0 and now >= next_round
                  and now - last_restart > QUIET_AFTER_RESTART and busy_ok):
                members = members or self.member_sockets(net, topo, workers)
                round_ = self.stranger_round(net, members)
                forged += round_["forged"]
                next_round = time.monotonic() + cfg.stranger_every
            near_end = aimed and max(done) >= cfg.steps_per_run - END_MARGIN
            time.sleep(POLL_AT_THE_END if near_end else POLL)
        self.procs.stop(workers)
        for r in ranks:
            r.poll()
        run["restarts"] = sum(1 for r in self.restarts if r["run"] == index)
        if run["last_bucket_restart"] is not None:
            run["last_bucket_restart"]["landed_ranks"] = [
                r for r in range(cfg.workers)
                if restarted_in_last_step(run_dir / f"worker{r}.log", cfg.steps_per_run)]
        run["steps"] = [r.steps for r in ranks]
        run["digests"] = checkpoints(ranks)
        ends = [r.end for r in ranks]
        bad_tag = sum(e["fabric"].get("bad_tag", 0) for e in ends if e) if all(ends) else None
        run["forged_results"] = {"sent": forged, "counted_by_workers": bad_tag}
        run["retransmissions"] = sum(e["fabric"].get("retransmissions", 0) for e in ends if e)
        run["fabric_restarts"] = [e["fabric"].get("restarts") if e else None for e in ends]
        self.runs.append(run)

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        cfg = self.cfg
        check_backend(cfg.backend)
        net, topo = build_net(self.topo_cfg)
        stranger = f"{cfg.prefix}x0"
        topo.addHost(stranger, cls=InaHost, ip=f"{STRANGER_IP}/{PREFIX_LEN}")
        topo.addLink(stranger, topo.switch_name, cls=InaLink, txo=False, rxo=False, gro=False)
        previous = signal.signal(signal.SIGTERM, _interrupt)
        bar = tqdm(total=round(cfg.minutes * 60), desc="soak", unit="s", disable=None,
                   dynamic_ncols=True)  # fmt: skip
        try:
            net.start()
            exempt_stranger(net, stranger)
            end = self.began + cfg.minutes * 60
            index = 0
            while time.monotonic() < end:  # a failed run is reported, and the soak goes on
                # A fresh aggregator per run: the job's slots start anew with the run's ranks
                # (an aggregator restarts a job for a new hello only after --restart-idle).
                self.start_aggregator(net, topo)
                self.run_once(net, topo, index, bar)
                self.stop_aggregator()
                index += 1
        finally:
            bar.close()
            self.procs.stop_all()
            net.stop()
            signal.signal(signal.SIGTERM, previous)
        summary = self.summary()
        (cfg.out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
        return summary

    def summary(self) -> dict[str, Any]:
        recoveries = [r["recovery_s"] for r in self.restarts if r["recovery_s"] is not None]
        hostile = {kind: sum(r[kind] for r in self.hostile)
                   for kind in ("fuzzed", "hellos", "spoofed", "forged", "dropped", "answered",
                                "uncounted")}  # fmt: skip
        forged_counted = [r["forged_results"]["counted_by_workers"] for r in self.runs]
        # A run whose ranks did not all end has no final counts: its forged results unchecked.
        checked = [r["forged_results"] for r in self.runs
                   if r["forged_results"]["counted_by_workers"] is not None]  # fmt: skip
        hostile["forged_uncounted"] = sum(max(0, f["sent"] - f["counted_by_workers"])
                                          for f in checked)  # fmt: skip
        hostile["forged_unchecked"] = sum(r["forged_results"]["sent"] for r in self.runs) - sum(
            f["sent"] for f in checked)
        hostile["forged_counted_by_workers"] = sum(c or 0 for c in forged_counted)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.cfg).items()}
        summary = {
            "config": config,
            "seconds": round(time.monotonic() - self.began, 1),
            "runs": self.runs,
            "steps": sum(min(r["steps"]) for r in self.runs),
            "hangs": self.hangs,
            "failures": self.failures,
            "restarts": [{k: v for k, v in r.items() if k != "ready_s"} for r in self.restarts],
            "recovery_s": spread(recoveries),
            "unrecovered_restarts": sum(1 for r in self.restarts if r["recovery_s"] is None
                                        and not r["missed"]),
            "digests_equal": all(len(set(d)) == 1 for run in self.runs
                                 for d in run["digests"].values()),
            "drops": dict(sorted((k, v) for k, v in self.drops.items() if v)),
            "hostile": hostile,
            "rss": rss_summary(self.rss, self.cfg.warmup_s),
            "uncounted_rounds": [r for r in self.hostile if r["uncounted"]],
        }
        summary["targets_failed"] = judge(summary)
        return summary


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def exempt_stranger(net: Any, stranger: str) -> None:
    """Let the stranger's frames past every host's loss rules: the loss is the workers' links',
    and a hostile datagram lost on the way could not be told from one the aggregator missed."""
    mac = net.get(stranger).MAC()
    for host in net.hosts:
        if host.name != stranger:
            out = host.cmd(f"iptables -I INPUT 1 -m mac --mac-source {mac} -j ACCEPT 2>&1 "
                           "&& echo ok").strip()  # fmt: skip
            if not out.endswith("ok"):
                raise RuntimeError(f"{host.name}: cannot exempt the stranger from loss: {out}")


def spread(values: list[float]) -> dict[str, float | None]:
    """min, median, max (None when there are none)."""
    if not values:
        return {"min": None, "median": None, "max": None, "count": 0}
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "count": len(values)}  # fmt: skip
