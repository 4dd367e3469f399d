"""``ncina aggregator --metrics-port``: the endpoint serves the counters of the stats document.

An aggregator of each backend runs with ``--stats`` and ``--metrics-port``; two clients
all-reduce through it while the test scrapes the endpoint (over HTTP, parsed with
prometheus_client's own parser; the dpdk and bmv2 aggregators serve it in their namespace,
where the scrape runs too). Each scrape during the run is a published document, so its
counters never run ahead of the ones published after it; once traffic stops and the next
periodic write is on disk, every counter of the stats file (job counters, each drop reason,
global and limits sections) equals its metric, labelled with the job and the reason.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.worker.client import AllreduceClient
from ncina_testlib import AGGREGATOR_BACKENDS, TWIN, start_aggregator
from prometheus_client.parser import text_string_to_metric_families

INTERVAL = 0.2
K = 12  # within every backend's limits (the P4 program's compile is shared with other tests)
FETCH = ("import sys, urllib.request; "
         "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, namespace: list[str]) -> dict[tuple[str, str, str], float]:
    """``{(family, job, reason): value}`` of the endpoint's counters, and ``("time", "", "")``:
    its document's time (``ncina_stats_time_seconds``); ``namespace``: the command prefix that
    enters the aggregator's network namespace (empty: this one)."""
    url = f"http://127.0.0.1:{port}/metrics"
    if namespace:
        text = subprocess.run([*namespace, sys.executable, "-c", FETCH, url], capture_output=True,
                              text=True, check=True, timeout=20).stdout  # fmt: skip
    else:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                values[(sample.name, sample.labels["job"], sample.labels["reason"])] = sample.value
            elif sample.name == "ncina_stats_time_seconds":
                values[("time", "", "")] = sample.value
    return values


def expected(document: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """The metrics a stats document must give (the module doc of ncina.aggregator.metrics)."""
    out = {}

    def section(prefix: str, job: str, counters: dict[str, Any]) -> None:
        for name, value in counters.items():
            if name == "drops":
                for reason, count in value.items():
                    out[(f"ncina_{prefix}drops_total", job, reason)] = float(count)
            elif not isinstance(value, bool | list):  # (dpdk's per-strand counters: their sums are)
                out[(f"ncina_{prefix}{name}_total", job, "")] = float(value)

    out[("time", "", "")] = document["time"]
    section("", "global", document["global"])
    for job, counters in document["jobs"].items():
        section("", job, counters)
    section("", "global", document.get("limits", {}))  # (bmv2 has no limits section)
    if document["backend"] in document:
        section(f"{document['backend']}_", "global", document[document["backend"]])
    return out


@pytest.mark.parametrize("backend", [b for b in AGGREGATOR_BACKENDS if b != TWIN])
def test_scrape_matches_stats_file(tmp_path: Path, backend: str) -> None:
    port = free_port()
    agg = start_aggregator(backend, tmp_path, job=3, workers=2, k=K, result="int",
                           extra=["--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                                  "--stats-interval", str(INTERVAL)])  # fmt: skip
    command = list(agg.process.args)
    namespace = command[:4] if command[:3] == ["ip", "netns", "exec"] else []
    try:
        clients = [AllreduceClient(agg.address, job=3, rank=r, workers=2, k=K,
                                   result_format="int", seed=r) for r in range(2)]  # fmt: skip
        rounds = 20

        def work(client: AllreduceClient) -> None:
            for _ in range(rounds):
                client.allreduce(np.ones(4 * K, dtype=np.float32))  # 4 slots

        threads = [threading.Thread(target=work, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        during = [scrape(port, namespace)]
        while any(t.is_alive() for t in threads):
            during.append(scrape(port, namespace))
            time.sleep(INTERVAL / 2)
        for t in threads:
            t.join()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # one counted drop
            s.sendto(b"\x00" * 3, agg.address)
        # The document on disk once it counts everything (the drop included), then a scrape
        # after the same periodic write: the two must agree.
        deadline = time.monotonic() + 10
        while True:
            document = json.loads(agg.stats_path.read_text())
            done = document["jobs"]["3"]["slots_completed"] == rounds * 4 + 1  # + the agreement
            if done and document["global"]["drops"]["truncated"] == 1:
                break
            assert time.monotonic() < deadline, document
            time.sleep(INTERVAL)
        # A scrape and the file of one periodic write (the gauge names the document): the
        # backend's own I/O counters may still move between writes (the dpdk loop's polls, a
        # frame the kernel sends on the veth), so two writes' counts can differ.
        while True:
            final = scrape(port, namespace)
            document = json.loads(agg.stats_path.read_text())
            if final[("time", "", "")] == document["time"]:
                break
            assert time.monotonic() < deadline + 10, "no scrape of the document on disk"
            time.sleep(INTERVAL / 4)
        for c in clients:
            c.close()
    finally:
        agg.stop()
    want = expected(document)
    assert final == want
    assert final[("ncina_slots_completed_total", "3", "")] == rounds * 4 + 1
    assert final[("ncina_drops_total", "global", "truncated")] == 1
    assert final[("ncina_drops_total", "3", "late")] == want[("ncina_drops_total", "3", "late")]
    # During the run every scrape is an earlier document: no counter above the final one.
    key = ("ncina_contributions_total", "3", "")
    seen = [s.get(key, 0.0) for s in during]
    assert seen == sorted(seen) and seen[-1] <= final[key]
