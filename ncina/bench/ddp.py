"""``ncina bench ddp``: data-parallel training with INA+NC8 and with gloo fp32 on one fabric.

Each repeat brings up the ``ncina topo`` star (Mininet, root: ``--workers`` hosts on ``--bw``
Mbit/s links, the aggregator of ``--backend``) and trains ``--model`` for ``--steps`` steps
twice on it: through the aggregator (the asynchronous DDP hook) and with gloo's fp32 ring
all-reduce. Reported, as medians over ``--repeat`` (each repeat's values too):
``ina_samples_per_s``, ``gloo_samples_per_s``, ``speedup`` (= ina / gloo), and the INA run's
``comm_total_s`` (time inside the hook's all-reduces, per rank on average),
``exposed_comm_s`` (over the steps, how long the exchange went on after the slowest rank's
compute: the communication the backward pass did not hide) and ``exposed_comm_fraction``
(exposed / total). With ``--torch-backend`` a third run on the same fabric trains through the
``ncina`` process-group backend (DDP with no hook, docs/pytorch.md), between the two:
``backend_samples_per_s``, ``backend_accuracy`` and ``backend_over_hook`` (= backend / ina
samples/s; ``ina_accuracy`` beside it).

Whether the model learnt: ``initial_test_loss`` (both runs start from the same parameters),
``ina_test_loss``, ``gloo_test_loss``, ``ina_accuracy``, ``gloo_accuracy`` (after the last
step) and ``loss_fell`` (both runs' test loss below the initial one in every repeat). What it
cost: ``cpu_s`` and ``gloo_cpu_s``, the CPU-seconds of each run's training (the ranks'
processes, every thread, compute included; the aggregator's; the machine's softirq time:
``ncina.common.cpu``), ``cpu_vs_gloo`` and ``cpu_ns_per_element`` (per gradient element a
rank all-reduced: workers x parameters x steps). ``retx_fraction`` is the INA run's
retransmissions over its packets sent, all workers together. ``speedup``,
``exposed_comm_fraction`` and ``cpu_vs_gloo`` come with ``<ratio>_spread``: the minimum, lower
median and maximum of the repeats' own.

``--mtu`` sets every link's MTU (K follows it), and the pool and DDP's bucket size follow
``--bw`` unless ``--pool-size`` and ``--bucket-cap-mb`` are given (``ncina.worker.tuning``).
The model trains with its recipe (``ncina.worker.models``). The runs' directories (logs,
results.json, plot.png) stay under ``--workdir``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ncina.common.options import deprecated_alias
from ncina.common.progress import progress
from ncina.common.ratios import spread
from ncina.harness.ddp_figures import ddp_figures
from ncina.proto.job import JobSpec

FIELDS = ("ina_samples_per_s", "gloo_samples_per_s", "speedup", "comm_total_s",
          "exposed_comm_s", "exposed_comm_fraction", "initial_test_loss", "ina_test_loss",
          "gloo_test_loss", "ina_accuracy", "gloo_accuracy", "cpu_s", "gloo_cpu_s",
          "cpu_vs_gloo", "cpu_ns_per_element", "gloo_cpu_ns_per_element",
          "backend_samples_per_s", "backend_accuracy", "backend_over_hook",
          "retx_fraction", "packets", "cpu_ns_per_packet")  # fmt: skip
SPREADS = ("speedup", "exposed_comm_fraction", "cpu_vs_gloo")
"""The ratios quoted with the minimum, median and maximum of the runs' own values."""
EPOCHS = 1000  # enough for any --steps: the run stops at max_steps


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ncina bench ddp``."""
    p = subparsers.add_parser(
        "ddp",
        help="DDP training with INA+NC8 and with gloo over one Mininet fabric (root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="vgg11",
                   help="a model of ncina train --model (default: %(default)s)")  # fmt: skip
    JobSpec.add_arguments(p, "workers", workers=4)
    p.add_argument("--bw", type=float, default=100.0,
                   help="worker link bandwidth in Mbit/s (default: %(default)s)")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="training steps per run "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default: %(default)s)")
    JobSpec.add_arguments(p, "pool_size", "mtu", pool_size=None, rules={
        "pool_size": "from --bw and K, as ncina topo: 34 at 100 Mbit/s and MTU 1500"})
    p.add_argument("--bucket-cap-mb", type=float,
                   help="DDP gradient bucket size in MB (default: from --bw, "
                   "ncina.worker.tuning.bucket_cap_mb: 4 at 100 Mbit/s)")
    p.add_argument("--backend", default="socket",
                   help="the aggregator's backend (ncina aggregator --backend; default: "
                   "%(default)s)")  # fmt: skip
    JobSpec.add_arguments(p, "k", rules={"k": "as ncina topo, the largest that fits --mtu"})
    p.add_argument("--torch-backend", action="store_true",
                   help="also train through the ncina process-group backend (DDP with no "
                   "hook) on the same fabric, beside the hook (docs/pytorch.md)")
    p.add_argument("--repeat", type=int, default=1, help="runs; medians are reported "
                   "(default: %(default)s)")  # fmt: skip
    workdir = p.add_argument("--workdir", type=Path, default=Path("runs/bench/ddp"),
                             help="where each run's directory goes (default: %(default)s)")
    deprecated_alias(p, "--out", workdir)
    # every field not placed above; a run under the Tofino profile is ncina topo's --profile
    JobSpec.add_arguments(p, role="run", lacks=("profile",))
    return p


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field, the median over the runs (None when a run lacks it); per ratio of
    ``SPREADS``, ``<ratio>_spread``: the minimum, lower median and maximum of the runs' own."""
    out: dict[str, Any] = {}
    for field in FIELDS:
        values = [run[field] for run in runs]
        out[field] = None if any(v is None for v in values) else statistics.median(values)
    for field in SPREADS:
        values = [run[field] for run in runs]
        out[f"{field}_spread"] = None if any(v is None for v in values) else spread(values)
    errors = [run["exposed_comm_error"] for run in runs if "exposed_comm_error" in run]
    if errors:
        out["exposed_comm_error"] = errors
    out["loss_fell"] = all(run["ina_test_loss"] < run["initial_test_loss"]  # type: ignore[operator]
                           and run["gloo_test_loss"] < run["initial_test_loss"]  # type: ignore[operator]
                           for run in runs)  # fmt: skip
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the repeats; return the medians and each run's figures."""
    if os.geteuid() != 0:
        raise PermissionError("ncina bench ddp needs root: Mininet builds the fabric")
    if args.steps < 1 or args.repeat < 1 or args.workers < 2:
        raise ValueError("--steps and --repeat must be at least 1, --workers at least 2")
    from ncina.topo.cli import topo_k, topo_pool_size
    from ncina.topo.config import JOB, TopoConfig
    from ncina.topo.runner import run_topology
    from ncina.worker import tuning

    k = args.k or topo_k(args.backend, "ina", args.result, tagged=False, mtu=args.mtu)
    pool_size = args.pool_size or topo_pool_size(args.backend, k, args.bw)
    bucket_cap_mb = args.bucket_cap_mb or tuning.bucket_cap_mb(args.bw)
    job = JobSpec.from_args(args, job=JOB, k=k, pool_size=pool_size)  # every field of the flags

    runs = []
    for i in progress(range(args.repeat), desc="bench ddp", unit="run"):
        out = args.workdir / f"{time.strftime('%Y%m%d-%H%M%S')}-{i}"
        cfg = TopoConfig(out=out, workers=args.workers, backend=args.backend, bw=args.bw,
                         model=args.model, epochs=EPOCHS, max_steps=args.steps,
                         batch_size=args.batch_size,
                         bucket_cap_mb=bucket_cap_mb, torch_backend=args.torch_backend,
                         job=job)  # fmt: skip
        runs.append({**ddp_figures(run_topology(cfg)), "out": str(out)})
    return {
        "model": args.model, "workers": args.workers, "bw_mbit": args.bw, "steps": args.steps,
        "batch_size": args.batch_size,
        "bucket_cap_mb": bucket_cap_mb, "mtu": args.mtu,
        "pool_size": pool_size, "backend": args.backend, "k": k,
        "torch_backend": args.torch_backend, "repeat": args.repeat, **medians(runs),
        "runs": runs,
    }  # fmt: skip
