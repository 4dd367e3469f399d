"""The job as a worker's client takes it: the fields of a ``JobSpec`` (``ncina.proto.job``, where
a job's defaults, default K and validation live) as ``AllreduceClient``'s keyword arguments."""

from __future__ import annotations

from typing import Any

from ncina.proto.job import JobSpec


def client_job(spec: JobSpec) -> dict[str, Any]:
    """``AllreduceClient``'s keyword arguments that carry ``spec``: the job, its workers (and the
    tree's total), K, pool, window, result format, key, MTU and profile; the rank, the address
    and the client's own settings (timeouts, data path, seed) are the caller's."""
    return {
        "job": spec.job, "workers": spec.workers, "total_workers": spec.total_workers,
        "k": spec.k, "pool_size": spec.pool_size, "window_max": spec.window_max,
        "result_format": spec.result.name.lower(), "key": spec.key, "mtu": spec.mtu,
        "profile": spec.profile,
    }  # fmt: skip
