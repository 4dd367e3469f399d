"""Several jobs on one aggregator, added and removed through the jobs directory while others run
(the Python backend, and the C engine behind the socket and DPDK I/O layers).

Each job has its own members, K, pool and result format; a job's packets cannot touch another
job's slots (the job id routes them, configured members pin the addresses), and adding or
removing a job leaves the running ones exact.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.aggregator.backends import names
from ncina.aggregator.control import JobsDirectory
from ncina.aggregator.process import free_udp_port
from ncina.worker.client import AllreduceClient
from ncina_testlib import Worker, start_aggregator, uplink, window_e_min, worker_host

from ncina.harness.aggregators import RunningAggregator
from ncina.harness.reference import powers_of_two

BACKENDS = names(jobs_dir=True)

pytestmark = pytest.mark.timeout(120)

STATIC_JOB = 21


def write_job(directory: Path, job: dict[str, Any]) -> Path:
    """Write a job file atomically (a temporary name, then rename)."""
    target = directory / f"job-{job['job']}.json"
    temporary = directory / f".job-{job['job']}.tmp"
    temporary.write_text(json.dumps(job))
    os.replace(temporary, target)
    return target


def wait_for_log(running: RunningAggregator, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in running.log():
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{running.log()}"
        time.sleep(0.02)


def allreduce_job(address: tuple[str, int], job: int, workers: int, k: int, result: str,
                  n: int, seed: int, *, pool_size: int = 64, binds: list[int] | None = None,
                  host: str = "127.0.0.1") -> list[np.ndarray]:  # fmt: skip
    """Every rank of ``job`` as a thread (sockets on ``host``); returns their sums, checked
    exact for int results."""
    inputs = [powers_of_two(n, seed + r, lowest=-8) for r in range(workers)]

    def rank(r: int) -> np.ndarray:
        bind = (host, binds[r] if binds else 0)
        with AllreduceClient(address, job=job, rank=r, workers=workers, k=k, seed=r,
                             pool_size=pool_size, result_format=result, bind=bind,
                             deadline=20.0) as client:  # fmt: skip
            return client.allreduce(inputs[r], op="sum")

    with ThreadPoolExecutor(workers) as pool:
        outputs = list(pool.map(rank, range(workers)))
    exact = np.sum(inputs, axis=0, dtype=np.float64).astype(np.float32)
    for out in outputs:
        if result == "int":
            np.testing.assert_array_equal(out, exact)
    return outputs


def test_jobs_directory_reports_additions_changes_removals_and_errors(tmp_path: Path) -> None:
    jobs = JobsDirectory(tmp_path)
    file = write_job(tmp_path, {"job": 5, "workers": 2, "k": 64, "result_format": "int"})
    (tmp_path / "bad.json").write_text('{"job": 6, "workers": 2}')
    (tmp_path / "clash.json").write_text(json.dumps({"job": 1, "workers": 2, "k": 8,
                                                     "result_format": "nc8"}))  # fmt: skip
    changes = list(jobs.changes({1}))
    assert [(a, getattr(w, "job", None)) for a, w in changes if a == "add"] == [("add", 5)]
    errors = sorted(w for a, w in changes if a == "error")
    assert len(errors) == 2 and "bad.json" in errors[0] and "already installed" in errors[1]
    assert list(jobs.changes({1, 5})) == []  # nothing new, errors are not repeated
    time.sleep(0.01)
    write_job(tmp_path, {"job": 5, "workers": 4, "k": 64, "result_format": "int"})
    changed = list(jobs.changes({1, 5}))
    assert [a for a, _ in changed] == ["remove", "add"] and changed[1][1].workers == 4
    file.unlink()
    assert list(jobs.changes({1, 5})) == [("remove", 5)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_four_jobs_at_once_added_and_removed_while_one_runs(backend: str, tmp_path: Path) -> None:
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    running = start_aggregator(backend, tmp_path, job=STATIC_JOB, workers=4, k=128,
                               result="int", extra=["--jobs-dir", str(jobs_dir)])  # fmt: skip
    host = worker_host(backend)
    try:
        address = running.address
        background = ThreadPoolExecutor(1)
        static = background.submit(allreduce_job, address, STATIC_JOB, 4, 128, "int", 400_000, 1,
                                   host=host)  # fmt: skip
        specs = [
            {"job": 22, "workers": 2, "k": 64, "result_format": "int", "pool_size": 16},
            {"job": 23, "workers": 3, "k": 256, "result_format": "nc8", "pool_size": 8},
            {"job": 24, "workers": 2, "k": 100, "result_format": "int", "pool_size": 4},
        ]
        files = [write_job(jobs_dir, spec) for spec in specs]
        for spec in specs:
            wait_for_log(running, f"added job {spec['job']}:")
        with ThreadPoolExecutor(len(specs)) as pool:
            list(pool.map(lambda s: allreduce_job(address, s["job"], s["workers"], s["k"],
                                                  s["result_format"], 50_000, s["job"],
                                                  pool_size=s["pool_size"], host=host), specs))
        for file in files:
            file.unlink()
        for spec in specs:
            wait_for_log(running, f"removed job {spec['job']}\n")
        static.result()  # exact, or the assertion inside fails here
        background.shutdown()
        stats = running.stats()
        assert list(stats["jobs"]) == [str(STATIC_JOB)]
        assert stats["jobs"][str(STATIC_JOB)]["slots_completed"] == -(-400_000 // 128) + 1
        # A removed job's packets are now foreign.
        worker = Worker(address)
        worker.send(uplink(job=22, rank=0, slot=0, offset=0, codes=[1], emin=window_e_min(2)))
        worker.close()
        deadline = time.monotonic() + 5
        while running.stats()["global"]["drops"]["unknown_job"] < 1:
            assert time.monotonic() < deadline
    finally:
        running.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_job_with_members_drops_other_addresses_and_stays_exact(
    backend: str, tmp_path: Path
) -> None:
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    running = start_aggregator(backend, tmp_path, job=STATIC_JOB, workers=2, k=64,
                               result="int", extra=["--jobs-dir", str(jobs_dir)])  # fmt: skip
    host = worker_host(backend)
    try:
        ports = [free_udp_port() for _ in range(2)]
        write_job(jobs_dir, {"job": 30, "workers": 2, "k": 64, "result_format": "int",
                             "members": {str(r): f"{host}:{p}" for r, p in enumerate(ports)}})
        wait_for_log(running, "added job 30:")
        spoofer = Worker(running.address)
        for slot in range(8):  # a stranger claims both ranks of job 30, and the static job's
            for rank in range(2):
                spoofer.send(uplink(job=30, rank=rank, slot=slot, offset=slot * 64,
                                    codes=[0x7F & 40] * 64, emin=window_e_min(2)))  # fmt: skip
        spoofer.close()
        allreduce_job(running.address, 30, 2, 64, "int", 20_000, 7, binds=ports, host=host)
        job = running.stats()["jobs"]["30"]
        assert job["drops"]["non_member"] == 16
        assert job["slots_completed"] == -(-20_000 // 64) + 1  # +1: the agreement
    finally:
        running.stop()


def test_a_job_file_replaced_with_the_same_time_and_size_is_seen(tmp_path: Path) -> None:
    """A rename over the file (same name, size and modification time, another job inside) is a
    change: the inode tells it apart."""
    jobs = JobsDirectory(tmp_path)
    first = write_job(tmp_path, {"job": 5, "workers": 2, "k": 64, "result_format": "int"})
    assert [(kind, c.job) for kind, c in jobs.changes(set())] == [("add", 5)]  # type: ignore[union-attr]
    stamp = first.stat()
    other = tmp_path / ".other.tmp"
    other.write_text(json.dumps({"job": 6, "workers": 2, "k": 64, "result_format": "int"}))
    os.utime(other, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    os.replace(other, first)
    again = first.stat()
    assert (again.st_size, again.st_mtime_ns) == (stamp.st_size, stamp.st_mtime_ns)
    changes = [(kind, c if isinstance(c, int) else c.job) for kind, c in jobs.changes({5})]  # type: ignore[union-attr]
    assert changes == [("remove", 5), ("add", 6)]
