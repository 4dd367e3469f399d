"""``ncina soak``, short: training over Mininet on the socket backend while the aggregator is
SIGKILLed and restarted (once aimed at a run's last step), the links lose 2 % each way and a
stranger host sends fuzzed datagrams, unkeyed hellos, spoofed retransmissions and forged
results; the summary's targets are checked field by field.

Needs root (skipped with the reason otherwise). ``NCINA_SOAK_MINUTES`` sets the length (default
1: the issue's 3 minutes would add two to a suite that must stay under about 20 on two cores;
one minute already holds two runs, several restarts and a dozen stranger rounds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ncina.topo.config import SoakConfig

from ncina.harness.soak_checks import RSS_TOLERANCE

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="Mininet needs root"),
]

MINUTES = float(os.environ.get("NCINA_SOAK_MINUTES", "1"))
STEPS = 120  # per run: a minute holds about two


def test_a_short_soak_meets_every_target(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    # Through its console script (python -m from the repository would find mininet/ before
    # Debian's Mininet); its nodes are named after its own process id, so unique.
    done = subprocess.run(
        [str(Path(sys.executable).with_name("ncina")), "soak", "--minutes", str(MINUTES),
         "--backend", "socket", "--loss", "2.0", "--steps-per-run", str(STEPS),
         "--restart-s", "6", "12", "--last-bucket-every", "1", "--generations", "distinct",
         "--stranger-every", "4", "--seed", "3", "--workdir", str(out)],
        capture_output=True, text=True, timeout=MINUTES * 60 + 300,
    )  # fmt: skip
    assert (out / "soak.json").exists(), done.stderr[-4000:]
    summary = json.loads((out / "soak.json").read_text())
    assert summary["targets_failed"] == [], summary["targets_failed"]
    assert done.returncode == 0, done.stderr[-4000:]
    cfg = SoakConfig(out=out)  # the command's defaults: workers, deadline
    assert summary["hangs"] == [] and summary["failures"] == []
    runs = summary["runs"]
    assert runs and all(run["steps"] == [STEPS] * cfg.workers for run in runs)
    assert summary["steps"] == STEPS * len(runs)
    # Digests at every epoch and at the end, equal across the ranks at each checkpoint.
    for run in runs:
        assert "end" in run["digests"] and "epoch 1" in run["digests"]
        assert all(len(set(d)) == 1 and len(d) == cfg.workers for d in run["digests"].values())
        assert run["retransmissions"] > 0  # the 2 % loss happened and was repaired
    # Restarts happened and each one that met a call was recovered from, timed.
    assert len(summary["restarts"]) >= 2 and summary["unrecovered_restarts"] == 0
    assert summary["recovery_s"]["count"] >= 1
    assert 0 <= summary["recovery_s"]["min"] <= summary["recovery_s"]["median"]
    assert summary["recovery_s"]["median"] <= summary["recovery_s"]["max"] < cfg.deadline
    assert any(r["why"] == "last bucket" for r in summary["restarts"])
    # Every hostile datagram counted: each fuzzed or spoofed one a drop, each unkeyed hello a
    # handshake answer (NOT_AUTHENTIC), each forged result a bad_tag at a worker.
    hostile = summary["hostile"]
    assert hostile["fuzzed"] > 0 and hostile["spoofed"] > 0 and hostile["hellos"] > 0
    assert hostile["forged"] > 0
    assert hostile["dropped"] == hostile["fuzzed"] + hostile["spoofed"]
    # Every stranger's hello was answered; the aggregator's count also holds the members' own
    # hellos of a round (a rank that waits between calls asks whether the aggregator restarted:
    # docs/reliability.md, "A rank that waits between calls"), so it may exceed the stranger's.
    assert hostile["answered"] >= hostile["hellos"] and hostile["uncounted"] == 0
    assert hostile["uncounted"] == 0 and hostile["forged_uncounted"] == 0
    assert hostile["forged_counted_by_workers"] == hostile["forged"]
    assert summary["drops"]["bad_tag"] >= hostile["spoofed"]
    # The workers' memory was judged (they live a whole run) and stayed flat.
    judged = {n: p["growth"] for n, p in summary["rss"].items() if p["growth"] is not None}
    assert any(n.startswith("run-") for n in judged)
    assert all(g <= RSS_TOLERANCE for g in judged.values())
