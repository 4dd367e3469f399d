"""The aggregator's memory caps on what a jobs directory adds: at most ``--max-jobs`` jobs
at once, the files past them refused, logged once and counted (``limits.jobs_refused``), and
taken when a job goes. Server mode's cap on error-feedback memory: tests/test_server_mode.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from ncina.aggregator.control import JobsDirectory
from ncina_testlib import start_aggregator
from test_jobs import wait_for_log, write_job

pytestmark = pytest.mark.timeout(120)


def spec(job: int) -> dict[str, object]:
    return {"job": job, "workers": 2, "k": 64, "result_format": "int", "pool_size": 4}


def test_files_past_max_jobs_are_refused_once_and_taken_when_room_appears(
    tmp_path: Path,
) -> None:
    jobs = JobsDirectory(tmp_path, max_jobs=2)
    files = [write_job(tmp_path, spec(job)) for job in (5, 6, 7)]
    changes = list(jobs.changes({1}))  # job 1: the command line's
    assert [(a, w.job) for a, w in changes if a == "add"] == [("add", 5)]  # type: ignore[union-attr]
    refused = [w for a, w in changes if a == "refused"]
    assert len(refused) == 2 and "job 6, 2 jobs are installed (--max-jobs)" in refused[0]
    assert list(jobs.changes({1, 5})) == []  # not reported again while full
    files[0].unlink()
    changes = list(jobs.changes({1, 5}))
    assert [(a, getattr(w, "job", w)) for a, w in changes] == [("remove", 5), ("add", 6)]
    assert list(jobs.changes({1, 6})) == []  # job 7 still waits, silently


@pytest.mark.parametrize("backend", ["python", "socket"])
def test_aggregator_serves_at_most_max_jobs_and_counts_the_refused(
    tmp_path: Path, backend: str
) -> None:
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    running = start_aggregator(backend, tmp_path, job=21, workers=2, k=64, result="int",
                               extra=["--jobs-dir", str(jobs_dir), "--max-jobs", "3"])  # fmt: skip
    try:
        for job in range(22, 32):  # ten files for two free places
            write_job(jobs_dir, spec(job))
        wait_for_log(running, "added job 23:")
        for job in range(24, 32):
            wait_for_log(running, f"job {job}, 3 jobs are installed (--max-jobs)")
        stats = running.stats()
        assert sorted(stats["jobs"]) == ["21", "22", "23"]  # memory: three jobs' slots
        assert stats["limits"] == {"jobs_refused": 8, "residuals_unkept": 0}
        assert "refused " in running.log()
    finally:
        assert running.stop() == 0, running.log()
