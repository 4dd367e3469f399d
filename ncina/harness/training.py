"""Training runs on loopback with each compression method in its mode (``ncina bench
training``, the tests): a Python aggregator (INA mode for the methods whose payloads a switch can
add, server mode with the same spec for the others) and ranks of ``ncina train``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from ncina.aggregator import process as aggproc
from ncina.proto.compressors import create
from ncina.proto.job import job_args
from ncina.worker.client import check_mode

JOB = 1
K = 256
"""The job's elements per packet (the python aggregator's and the ranks')."""
NC8 = "nc8"
"""The row of ``ncina train`` without ``--compressor``: NC8 of the raw gradients (INA)."""
METHODS = [
    NC8,
    "natdither:s=8",
    "natdither:s=8,packed=1",
    "qsgd:s=16,bucket=256",
    "qsgd:s=2,bucket=1024,encoding=sparse",
    "terngrad",
    "ef+topk:ratio=0.01",
    "ef+topk:ratio=0.1",
    "randk:ratio=0.25",
    "signsgd",
    "onebit",
    "fft:theta=0.85,bits=10",
    "ef+fft:theta=0.85,bits=10",
    "3lc",
]


def mode_of(spec: str) -> str:
    """INA for the integer-summable methods, server mode for the others."""
    return "ina" if spec == NC8 or create(spec).ina else "server"


def train_one(
    spec: str, workdir: Path, *, workers: int, epochs: int, seed: int, timeout: float
) -> dict[str, Any]:
    """One training run of ``spec`` in its mode: a Python aggregator on loopback and
    ``workers`` ranks of ``ncina train`` for ``epochs`` epochs (seed ``seed``, at most
    ``timeout`` seconds); its figures from the ranks' metrics."""
    mode = mode_of(spec)
    if spec != NC8:
        check_mode(create(spec), mode)
    agg_args = ["--listen", "127.0.0.1:0", *job_args(job=JOB, workers=workers, k=K),
                "--seed", str(seed), "--stats", str(workdir / "stats.json")]
    agg_args += (["--mode", "server", "--compressor", spec] if mode == "server"
                 else ["--result", "nc8"])  # fmt: skip
    proc, (host, port) = aggproc.start(agg_args, workdir / "aggregator.log")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = s.getsockname()[1]
    metrics = [workdir / f"worker{rank}.jsonl" for rank in range(workers)]
    compressor = [] if spec == NC8 else ["--compressor", spec, "--mode", mode]
    workers = []
    try:
        for rank in range(workers):
            with (workdir / f"worker{rank}.log").open("wb") as log:
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "ncina.cli", "train", "--rank", str(rank),
                     "--workers", str(workers), "--master", f"127.0.0.1:{master}",
                     "--aggregator", f"{host}:{port}", *job_args(k=K), "--epochs", str(epochs),
                     "--seed", str(seed), "--log-every", "1000", "--metrics",
                     str(metrics[rank]),
                     *compressor],
                    stdout=log, stderr=subprocess.STDOUT,
                ))  # fmt: skip
        for rank, w in enumerate(workers):
            if w.wait(timeout=timeout) != 0:
                log = aggproc.tail(workdir / f"worker{rank}.log")
                raise RuntimeError(f"{spec}: worker {rank} failed:\n{log}")
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        aggproc.stop(proc)
    ends = [next(e for e in map(json.loads, m.read_text().splitlines()) if e["event"] == "end")
            for m in metrics]  # fmt: skip
    n = len(ends)
    return {
        "method": spec,
        "mode": mode,
        "steps": ends[0]["steps"],
        "accuracy": round(ends[0]["test_acc"], 2),
        "test_loss": round(ends[0]["test_loss"], 4),
        "mb_sent_per_worker": round(sum(e["fabric"]["bytes_sent"] for e in ends) / n / 1e6, 3),
        "mb_received_per_worker": round(
            sum(e["fabric"]["bytes_received"] for e in ends) / n / 1e6, 3
        ),
        "mb_first_sends_per_worker": round(
            sum(e["fabric"]["bytes_sent"] - e["fabric"]["bytes_retransmitted"] for e in ends)
            / n / 1e6, 3
        ),
        "retransmissions": sum(e["fabric"]["retransmissions"] for e in ends),
    }
