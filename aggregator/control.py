"""The aggregator's control interface: a directory of job files, watched while it serves.

Each ``*.json`` file in the directory (``ncina aggregator --jobs-dir DIR``) is one job, with the
keys of ``JobConfig.create``: ``job``, ``workers``, ``k``, ``result_format`` and optionally
``pool_size``, ``window_max``, ``members`` (``{"RANK": "HOST:PORT"}``), ``seed`` and ``key`` (the
authentication tag's secret as hex, docs/protocol.md). Writing a
file adds its job, deleting it removes the job, while the other jobs keep running; a file whose
content changes is the removal of the old job and the addition of the new one. Write a file
atomically (to a temporary name not ending in ``.json``, then rename) so that a half-written one
is never read. A file that does not describe a valid job, or names a job id that another file
already holds, is reported once on the log and otherwise ignored until it changes. Each job
holds memory (its slots), so at most ``max_jobs`` jobs run at once (``--max-jobs``): a file past
that is refused (reported once, counted) and read again when a job goes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, KeysView
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ncina.aggregator.jobs import JobConfig, parse_member
from ncina.aggregator.stats import LimitStats
from ncina.proto.wire import DEFAULT_MTU

SUFFIX = ".json"
DEFAULT_MAX_JOBS = 64  # installed jobs, the one of the command line included


def job_from_json(document: dict[str, Any]) -> JobConfig:
    """A ``JobConfig`` from one job file's content; ``ValueError`` with a readable message."""
    if not isinstance(document, dict):
        raise ValueError("a job file holds one JSON object")
    options = dict(document)
    members = options.pop("members", {})
    if not isinstance(members, dict):
        raise ValueError('"members" maps a rank to "HOST:PORT"')
    try:
        return JobConfig.create(
            members=[parse_member(f"{rank}={where}") for rank, where in members.items()],
            **options,
        )
    except TypeError as exc:  # unknown or missing keys
        raise ValueError(str(exc).replace("create() ", "")) from None


@dataclass
class JobsDirectory:
    """The job files of ``path`` as last seen: file name -> (stamp, job id). The stamp is the
    file's inode, modification time (ns) and size: a job file replaced by a rename (the atomic way
    to write one) is a new inode even when the time and the size come out the same."""

    path: Path
    mtu: int = DEFAULT_MTU
    max_jobs: int = DEFAULT_MAX_JOBS
    seen: dict[str, tuple[tuple[int, int, int], int | None]] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)  # files refused for max_jobs, as seen

    def changes(self, installed: set[int]) -> Iterator[tuple[str, JobConfig | int | str]]:
        """What changed since the last call, as ``("add", config)``, ``("remove", job id)``,
        ``("error", message)`` and ``("refused", message)`` (a valid job past ``max_jobs``);
        ``installed`` are the job ids running now (an added job's id must not be among them once
        the removals before it are applied)."""
        current = {}
        for file in sorted(self.path.glob(f"*{SUFFIX}")):
            try:
                status = file.stat()
            except FileNotFoundError:  # deleted meanwhile
                continue
            current[file.name] = (status.st_ino, status.st_mtime_ns, status.st_size)
        for name in list(self.seen):
            stamp, job = self.seen[name]
            if current.get(name) != stamp:
                del self.seen[name]
                self.refused.discard(name)
                if job is not None:
                    installed.discard(job)
                    yield "remove", job
        for name, stamp in current.items():
            if name in self.refused and len(installed) < self.max_jobs:
                self.refused.discard(name)  # room again: read it anew
                self.seen.pop(name, None)
            if name in self.seen:
                continue
            job_or_error = self._read(self.path / name, installed)
            if isinstance(job_or_error, JobConfig) and len(installed) >= self.max_jobs:
                self.seen[name] = (stamp, None)
                self.refused.add(name)
                yield "refused", (f"{self.path / name}: job {job_or_error.job}, "
                                  f"{self.max_jobs} jobs are installed (--max-jobs)")  # fmt: skip
            elif isinstance(job_or_error, JobConfig):
                self.seen[name] = (stamp, job_or_error.job)
                installed.add(job_or_error.job)
                yield "add", job_or_error
            else:
                self.seen[name] = (stamp, None)
                yield "error", f"{self.path / name}: {job_or_error}"

    def _read(self, file: Path, installed: set[int]) -> JobConfig | str:
        try:
            config = job_from_json(json.loads(file.read_text()))
            config.check_mtu(self.mtu)
        except (OSError, ValueError) as exc:
            return str(exc)
        if config.job in installed:
            return f"job {config.job} is already installed"
        return config


def jobs_directory(args: Any) -> JobsDirectory | None:
    """The control interface ``ncina aggregator``'s options ask for: ``--jobs-dir`` (with the
    job's ``--mtu`` and ``--max-jobs``), or none."""
    if not args.jobs_dir:
        return None
    return JobsDirectory(args.jobs_dir, mtu=args.mtu, max_jobs=args.max_jobs)


def apply_changes(
    directory: JobsDirectory,
    installed: KeysView[int],
    add: Callable[[JobConfig], object],
    remove: Callable[[int], object],
    log: TextIO,
    limits: LimitStats | None = None,
) -> None:
    """Add and remove a backend's jobs as ``directory`` says, and log each change on ``log``;
    a file refused for ``max_jobs`` is counted in ``limits.jobs_refused``.

    ``installed`` is a live view of the job ids the backend runs; ``add`` installs a job (a
    ``ValueError`` or ``RuntimeError`` from it, a job the backend cannot serve, is logged as
    ignored, like an invalid file), ``remove`` uninstalls one.
    """
    for action, what in directory.changes(set(installed)):
        if action == "add":
            assert isinstance(what, JobConfig)
            try:
                add(what)
                message = f"added {what.describe()}"
            except (ValueError, RuntimeError) as exc:
                message = f"ignored job {what.job}: {exc}"
        elif action == "remove":
            assert isinstance(what, int)
            if what not in installed:  # its addition was refused
                continue
            remove(what)
            message = f"removed job {what}"
        elif action == "refused":
            if limits is not None:
                limits.jobs_refused += 1
            message = f"refused {what}"
        else:
            message = f"ignored {what}"
        print(f"ncina aggregator: {message}", file=log, flush=True)
