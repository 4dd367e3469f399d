"""``ncina soak``'s parts that need no network: the stranger's spoofed packets, the metrics
reader, the judgement of memory and of each target, the hostile count (no root)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ncina.cli import main
from ncina.harness.soak_checks import (
    RankLog,
    changed,
    checkpoints,
    drawn_generation,
    hostile_counted,
    judge,
    restarted_in_last_step,
    rss_summary,
)
from ncina.harness.stranger import frame_destination, udp_frame


def test_a_spoofed_frame_is_the_ipv4_and_udp_packet_asked_for() -> None:
    from scapy.layers.inet import IP, UDP

    payload = bytes(range(40))
    frame = udp_frame(("10.0.0.3", 40001), ("10.0.1.1", 47000), payload)
    packet = IP(frame)
    assert (packet.version, packet.ihl, packet.ttl, packet.len) == (4, 5, 64, 20 + 8 + 40)
    assert (packet.src, packet.dst) == ("10.0.0.3", "10.0.1.1")
    assert (packet[UDP].sport, packet[UDP].dport, packet[UDP].len) == (40001, 47000, 48)
    assert bytes(packet[UDP].payload) == payload and packet[UDP].chksum == 0
    assert frame_destination(frame) == "10.0.1.1"


def _event(kind: str, **fields: Any) -> str:
    return json.dumps({"event": kind, **fields}) + "\n"


def test_the_rank_log_reads_whole_lines_as_they_come(tmp_path: Path) -> None:
    path = tmp_path / "worker0.jsonl"
    log = RankLog(path)
    log.poll()  # no file yet
    assert log.steps == 0
    text = _event("step", step=1) + _event("step", step=2)
    path.write_text(text + '{"event": "ep')  # a line half written
    log.poll()
    assert (log.steps, log.digests) == (2, {})
    path.write_text(text + _event("epoch", epoch=1, parameters_sha256="aa") +
                    _event("end", steps=2, parameters_sha256="bb"))  # fmt: skip
    log.poll()
    assert log.digests == {"epoch 1": "aa", "end": "bb"} and log.end is not None
    other = RankLog(path)
    other.poll()
    other.digests["epoch 1"] = "ab"
    assert checkpoints([log, other]) == {"epoch 1": ["aa", "ab"], "end": ["bb", "bb"]}


def test_a_restart_counts_as_landed_only_after_the_last_but_one_step(tmp_path: Path) -> None:
    log = tmp_path / "worker1.log"
    restart = "job 1 rank 1: aggregator 10.0.1.1:47000 restarted; recovering\n"
    steps = "".join(f"rank 1 epoch 1 step {s} loss 0.5 tx 10 B t 1.00 s\n" for s in (8, 9))
    log.write_text(restart + steps)
    assert not restarted_in_last_step(log, 10)
    log.write_text(steps + restart)
    assert restarted_in_last_step(log, 10)
    assert not restarted_in_last_step(log, 11)  # step 10 never logged


def test_memory_is_judged_after_warm_up_from_the_first_judged_sample() -> None:
    samples = [(3.0, 100), (8.0, 150), (13.0, 200), (15.0, 212), (20.0, 206)]
    out = rss_summary({"p": samples, "short": samples[:3]}, warmup_s=10.0)
    assert out["p"]["growth"] == pytest.approx(0.06)  # 212 / 200 - 1: the warm-up's 100 left out
    assert out["short"]["growth"] is None  # one sample after warm-up: nothing to judge


def _summary(**changes: Any) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "hangs": [], "failures": [], "digests_equal": True, "unrecovered_restarts": 0,
        "rss": {"p": {"growth": 0.05}, "q": {"growth": None}},
        "hostile": {"uncounted": 0, "forged_uncounted": 0},
    }  # fmt: skip
    summary.update(changes)
    return summary


def test_each_failed_target_is_named() -> None:
    assert judge(_summary()) == []  # 5 % growth is within the tolerance
    assert "hang" in judge(_summary(hangs=[{"run": 0}]))[0]
    assert "digests differ" in judge(_summary(digests_equal=False))[0]
    assert "never recovered" in judge(_summary(unrecovered_restarts=1))[0]
    assert "'p': 0.06" in judge(_summary(rss={"p": {"growth": 0.06}}))[0]
    hostile = judge(_summary(hostile={"uncounted": 2, "forged_uncounted": 1}))
    assert hostile == ["hostile datagrams not counted: 2 at the aggregator, 1 forged results "
                       "at the workers"]  # fmt: skip
    assert judge(_summary(failures=["run 1: rank 2 exited"])) == ["failure: run 1: rank 2 exited"]


def test_an_honest_workers_drops_are_not_counted_as_hostile() -> None:
    document = {"global": {"drops": {"truncated": 3, "unknown_job": 1}},
                "jobs": {"1": {"drops": {"bad_tag": 5, "late": 7, "stale_generation": 11,
                                         "resend_limit": 13}}}}  # fmt: skip
    assert hostile_counted(document) == 3 + 1 + 5


def test_a_rounds_uncounted_datagrams_are_traced_to_every_count_that_grew() -> None:
    """An uncounted round's ``counters``: each count that grew, in every section (the bmv2
    backend's transport section included), the document's time and flags left out."""
    before = {"time": 1.0, "global": {"packets_in": 4, "drops": {"truncated": 3}},
              "jobs": {"1": {"results_resent": 2, "drops": {"bad_tag": 5}}},
              "bmv2": {"ignored": 1, "fragments": 0}}  # fmt: skip
    after = {"time": 2.0, "global": {"packets_in": 6, "drops": {"truncated": 3}},
             "jobs": {"1": {"results_resent": 9, "drops": {"bad_tag": 6}}},
             "bmv2": {"ignored": 4, "fragments": 0}}  # fmt: skip
    assert changed(before, after) == {"global.packets_in": 2, "jobs.1.results_resent": 7,
                                      "jobs.1.drops.bad_tag": 1, "bmv2.ignored": 3}  # fmt: skip


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the refusal a non-root user gets")
def test_the_soak_without_root_says_root_is_needed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["soak", "--minutes", "1"]) == 1
    assert "ncina soak needs root" in capsys.readouterr().err


def test_the_generation_a_start_drew_is_read_from_its_readiness_line(tmp_path: Path) -> None:
    log = tmp_path / "aggregator0.log"
    log.write_text("ncina aggregator: listening on 10.0.1.1:47000 (udp), backend socket, pid "
                   "27958, aggregator, generation 3, UDP GRO on, UDP GSO on, job 1: 4 workers\n")
    assert drawn_generation(log) == 3
    log.write_text("ncina aggregator: listening on 10.0.1.1:47000 (udp), backend python\n")
    assert drawn_generation(log) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusals come after the root check")
def test_the_soak_refuses_what_cannot_pass_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A twin soak whose generations may repeat (the design detects no repeat: it ended in a
    worker deadline), and a workdir holding a previous soak (whose metrics files were read as
    this one's: a false stall 60 s into the first run)."""
    from ncina.proto.profiles import LACKS

    twin = ["soak", "--backend", "bmv2", "--profile", "tofino", "--workdir", str(tmp_path / "a")]
    assert main([*twin, "--generations", "random"]) == 1
    assert LACKS["joined"] in capsys.readouterr().err
    used = tmp_path / "used"
    (used / "run-0").mkdir(parents=True)
    assert main(["soak", "--workdir", str(used)]) == 1
    assert f"--workdir {used} is not empty" in capsys.readouterr().err
