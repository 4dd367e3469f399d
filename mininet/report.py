"""Results of a topology run: per-run summaries, ``results.json``, the final table, the plot.

A run's summary is built from the JSON events ``ncina train`` wrote per worker (see
:mod:`ncina.worker.train`) and the aggregators' stats files. ``results.json`` holds::

    config       the run's TopoConfig
    runs         {"ina": summary, "gloo": summary}  (gloo absent with --no-baseline): the first
                 repeat's, which the plot shows
    repeats      {"ina": [summary, ...], ...}: every repeat (--repeat), in order
    statistics   {"ina": {field: {"median", "min", "max"}}, ...} over the repeats, for the fields
                 of STATISTICS
    comparison   bytes_ratio, time_ratio (ina / gloo train_s), accuracy_delta (ina - gloo,
                 points), speedup (ina / gloo samples_per_s: the same window as time_ratio, so
                 speedup = 1 / time_ratio when both ran the same steps); with the ncina
                 backend's run (``ncina``: DDP with no hook, ``ncina train --backend ncina``),
                 backend_over_hook (its samples_per_s / ina's) and backend_accuracy_delta.
                 Each is the median over the repeats (repeat i of INA against repeat i of
                 gloo), with ``<name>_spread`` (min, median, max); a ratio whose baseline ran
                 no time or moved no samples is None with ``<name>_refused``: why
    comparisons  each repeat's own comparison, in order

and each summary::

    mode, label, epochs, steps, time_s, time_per_epoch_s,
    bytes_per_worker, packets_per_worker, rx_bytes_per_worker   (link counters, mean of ranks)
    final_accuracy, final_test_loss                              (rank 0, percent / nats)
    samples_per_s   the run's training samples per second (all ranks; rank 0's end event)
    step_s, compute_step_s, comm_total_s
                    mean of the ranks' (docs/topo.md, "What a step costs"); comm_total_s None
                    for gloo
    exposed_comm_s, exposed_comm_fraction
                    the exchange no rank's compute hid (exposed_comm), over comm_total_s; not
                    capped: above 1 the two clocks disagree, and exposed_comm_error says so
    train_s         rank 0's training time up to and including the final barrier: the window
                    of samples_per_s, and of time_ratio
    parameters      the model's
    cpu_s           CPU-seconds the run's training cost (evaluation excluded): rank_cpu_s (the
                    ranks' processes, every thread: compute and communication), aggregator_cpu_s
                    (the aggregators' processes while the ranks ran; 0 for gloo but on BMv2)
                    and unattributed_s (the CPU time no process was charged over rank 0's
                    training: the kernel's packet work on idle CPUs and in ksoftirqd;
                    ncina.common.cpu, each CPU-second once; machine-wide: an upper bound on a
                    shared machine); None when a rank did not report its CPU time
    workers      per rank: rank, tx_bytes, rx_bytes, tx_packets, rx_packets, fabric (client stats)
    fabric       client stats summed over the workers ({} for gloo)
    aggregators  the aggregators' stats files ([] for gloo)
    verify       with --verify: buckets checked, max_abs_error, worst_ratio, variance_ratio (max)
    curve        rank 0: steps [[time_s, tx_bytes, loss]], epochs [[time_s, tx_bytes, acc, loss]]

Time is training time (evaluation excluded); bytes are what a worker's link transmitted during
training, all protocols included: its HTB class's count, every GSO or TSO segment with its
headers (``ncina.common.htb.LinkCounters``; received bytes, and an unshaped link's, are the
interface's counters).
"""

from __future__ import annotations

import json
import statistics as statistics_module
from pathlib import Path
from typing import Any

from ncina.common.ratios import put_ratio, refusal, spread

LABELS = {"ina": "INA+NC8", "ncina": "ncina backend", "gloo": "gloo fp32", "tofino": "INA tofino"}
RESULTS = "results.json"
PLOT = "plot.png"


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of one worker's metrics file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(
    mode: str, metrics: list[Path], stats: list[Path], label: str | None = None,
    aggregator_cpu_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """Summary of one training run from its workers' metrics files (rank order) and stats;
    ``label`` names it in tables and plots (default: the mode's, :data:`LABELS`);
    ``aggregator_cpu_s``: the aggregators' CPU time while the ranks ran."""
    events = [read_events(p) for p in metrics]
    ends = [next(e for e in evs if e["event"] == "end") for evs in events]
    # Wire figures at the end of the last epoch (before the final barrier), per rank.
    lasts = [[e for e in evs if e["event"] == "epoch"][-1] for evs in events]
    rank0 = events[0]
    start = next(e for e in rank0 if e["event"] == "start")
    epochs = [e for e in rank0 if e["event"] == "epoch"]
    checks = [e for evs in events for e in evs if e["event"] == "verify"]
    n = len(metrics)
    time_s = max(e["time"] for e in lasts)
    timing = {key: _mean([end.get(key) for end in ends]) for key in TIMING}
    exposed = exposed_comm(events)
    if exposed is not None:
        timing |= exposure(exposed, timing["comm_total_s"])
    return {
        "mode": mode,
        "label": label or LABELS[mode],
        "epochs": len(epochs),
        "steps": ends[0]["steps"],
        "time_s": time_s,
        "time_per_epoch_s": time_s / len(epochs),
        "train_s": ends[0]["time"],
        "bytes_per_worker": sum(e["tx_bytes"] for e in lasts) / n,
        "packets_per_worker": sum(e["tx_packets"] for e in lasts) / n,
        "packets_per_s": sum(e["tx_packets"] for e in lasts) / n / time_s,
        "rx_bytes_per_worker": sum(e["rx_bytes"] for e in lasts) / n,
        "final_accuracy": epochs[-1]["test_acc"],
        "final_test_loss": epochs[-1]["test_loss"],
        "samples_per_s": ends[0].get("samples_per_s"),
        **timing,
        "parameters": start["parameters"],
        **cpu_figures(ends, aggregator_cpu_s),
        "workers": [
            {"rank": r, **{k: last[k] for k in ("tx_bytes", "rx_bytes", "tx_packets",
                                                 "rx_packets")}, "fabric": end["fabric"]}
            for r, (last, end) in enumerate(zip(lasts, ends, strict=True))
        ],
        "fabric": {
            k: sum(end["fabric"][k] for end in ends) for k in ends[0]["fabric"]
        },
        "aggregators": [json.loads(p.read_text()) for p in stats],
        "verify": {
            "buckets": len(checks),
            **{k: max(c[k] for c in checks)
               for k in ("max_abs_error", "worst_ratio", "variance_ratio")},
        } if checks else None,
        "curve": {
            "steps": [[e["time"], e["tx_bytes"], e["loss"]] for e in rank0 if e["event"] == "step"],
            "epochs": [[0.0, 0, start["test_acc"], start["test_loss"]]]
            + [[e["time"], e["tx_bytes"], e["test_acc"], e["test_loss"]] for e in epochs],
        },
    }


def exposure(exposed: float, comm: float | None) -> dict[str, Any]:
    """``exposed_comm_s``, and its fraction of ``comm`` (the communication it is part of), not
    capped: a fraction above 1 is a measurement error, which ``exposed_comm_error`` names."""
    figures: dict[str, Any] = {"exposed_comm_s": exposed,
                               "exposed_comm_fraction": exposed / comm if comm else None}
    if comm and exposed > comm:
        figures["exposed_comm_error"] = (
            f"measurement error: exposed communication {exposed:.3f} s exceeds the "
            f"communication it is part of ({comm:.3f} s)")  # fmt: skip
    return figures


def cpu_figures(ends: list[dict[str, Any]], aggregator_cpu_s: float) -> dict[str, float | None]:
    """``cpu_s`` and its parts (see the module doc) from the ranks' end events."""
    ranks = _mean([end.get("cpu_s") for end in ends])
    kernel = ends[0].get("unattributed_s")
    if ranks is None or kernel is None:
        return {"cpu_s": None, "rank_cpu_s": None, "aggregator_cpu_s": aggregator_cpu_s,
                "unattributed_s": None}  # fmt: skip
    ranks *= len(ends)
    return {"cpu_s": ranks + aggregator_cpu_s + kernel, "rank_cpu_s": ranks,
            "aggregator_cpu_s": aggregator_cpu_s, "unattributed_s": kernel}  # fmt: skip


def exposed_comm(events: list[list[dict[str, Any]]]) -> float | None:
    """Seconds, over all steps, that the exchange went on after the slowest rank's compute:
    per step, the last rank's ``comm_done`` minus the last rank's ``grads_ready`` (when its
    last bucket was handed over). A rank's own figure also counts its wait for slower ranks;
    this one is the communication no rank's compute hid. None without the timestamps."""
    per_step: dict[int, list[tuple[float, float]]] = {}
    for rank_events in events:
        for e in rank_events:
            if e["event"] == "step" and "grads_ready" in e:
                per_step.setdefault(e["step"], []).append((e["grads_ready"], e["comm_done"]))
    if not per_step:
        return None
    return sum(
        max(0.0, max(done for _, done in times) - max(ready for ready, _ in times))
        for times in per_step.values()
    )


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values, or None when any is None (a field a run does not have)."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


TIMING = ("step_s", "compute_step_s", "comm_total_s", "exposed_comm_s", "exposed_comm_fraction")
STATISTICS = ("time_s", "samples_per_s", "bytes_per_worker", "final_accuracy",
              "final_test_loss", "exposed_comm_s")  # fmt: skip


def statistics(repeats: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode and field of ``STATISTICS``: median, min and max over the repeats (fields a
    mode has not, such as gloo's hook timing, are left out)."""
    out: dict[str, dict[str, Any]] = {}
    for mode, summaries in repeats.items():
        out[mode] = {}
        for field in STATISTICS:
            values = [s[field] for s in summaries if s.get(field) is not None]
            if len(values) == len(summaries):
                ordered = sorted(values)
                middle = len(ordered) // 2
                median = (ordered[middle] if len(ordered) % 2
                          else (ordered[middle - 1] + ordered[middle]) / 2)  # fmt: skip
                out[mode][field] = {"median": median, "min": ordered[0], "max": ordered[-1]}
    return out


RATIOS = ("bytes_ratio", "time_ratio", "speedup", "accuracy_delta", "backend_over_hook",
          "backend_accuracy_delta", "tofino_bytes_ratio", "tofino_speedup",
          "tofino_accuracy_delta")  # fmt: skip
"""The comparison's figures, in order."""


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One repeat's INA against its baseline: ratios of bytes and time (``train_s``, the window
    of ``samples_per_s``), difference of accuracy, and the speedup in samples per second; a
    ratio of a baseline that moved nothing is None with ``<name>_refused``. A run of the
    ``tofino`` profile (``make topo PROFILE=tofino``) gets its own against the same baseline,
    ``tofino_*``; without a default-profile run (the twin on BMv2) it is the INA run."""
    if "gloo" not in runs:
        return {}
    gloo = runs["gloo"]
    comparison: dict[str, Any] = {}
    tofino = runs.get("tofino")
    if tofino is not None:
        put_ratio(comparison, "tofino_bytes_ratio", tofino["bytes_per_worker"],
                  gloo["bytes_per_worker"], refusal(gloo["bytes_per_worker"]))  # fmt: skip
        gloo_rate = gloo.get("samples_per_s") or 0.0
        put_ratio(comparison, "tofino_speedup", tofino.get("samples_per_s") or 0.0, gloo_rate,
                  refusal(gloo_rate))  # fmt: skip
        comparison["tofino_accuracy_delta"] = tofino["final_accuracy"] - gloo["final_accuracy"]
    if "ina" not in runs:
        return comparison
    ina = runs["ina"]
    put_ratio(comparison, "bytes_ratio", ina["bytes_per_worker"], gloo["bytes_per_worker"],
              refusal(gloo["bytes_per_worker"]))  # fmt: skip
    put_ratio(comparison, "time_ratio", ina["train_s"], gloo["train_s"], refusal(gloo["train_s"]))
    gloo_rate = gloo.get("samples_per_s") or 0.0
    put_ratio(comparison, "speedup", ina.get("samples_per_s") or 0.0, gloo_rate,
              refusal(gloo_rate))  # fmt: skip
    comparison["accuracy_delta"] = ina["final_accuracy"] - gloo["final_accuracy"]
    backend = runs.get("ncina")
    if backend is not None:  # the ncina process-group backend beside the hook
        comparison["backend_accuracy_delta"] = (backend["final_accuracy"]
                                                - ina["final_accuracy"])  # fmt: skip
        hook_rate = ina.get("samples_per_s") or 0.0
        put_ratio(comparison, "backend_over_hook", backend.get("samples_per_s") or 0.0,
                  hook_rate, refusal(hook_rate))  # fmt: skip
    return comparison


def compare_repeats(repeats: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """:func:`compare` of every repeat: repeat i of each mode against repeat i of the others
    (as many as every mode has)."""
    count = min(len(summaries) for summaries in repeats.values())
    return [compare({mode: summaries[i] for mode, summaries in repeats.items()})
            for i in range(count)]  # fmt: skip


def summarize_comparisons(comparisons: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure of ``RATIOS`` the repeats have: the median over the repeats that have a
    value, its ``<name>_spread``; refused in every repeat: None and the first reason."""
    out: dict[str, Any] = {}
    for name in RATIOS:
        if not any(name in c for c in comparisons):
            continue
        values = [c[name] for c in comparisons if c.get(name) is not None]
        out[name] = statistics_module.median(values) if values else None
        out[f"{name}_spread"] = spread(values)
        if not values:
            out[f"{name}_refused"] = next(c[f"{name}_refused"] for c in comparisons
                                          if f"{name}_refused" in c)  # fmt: skip
    return out


def table(runs: dict[str, dict[str, Any]], stats: dict[str, dict[str, Any]] | None = None) -> str:
    """The final table: one line per run; with ``stats`` of several repeats, a line per run of
    medians and [min, max] of time, samples/s and accuracy follows."""
    head = f"{'run':<10} {'time s':>8} {'s/epoch':>8} {'MB/worker':>10} {'pkts/worker':>12} "
    head += f"{'retx':>6} {'accuracy':>9} {'samples/s':>10} {'pkts/s':>8}"
    lines = [head]
    for run in runs.values():
        lines.append(
            f"{run['label']:<10} {run['time_s']:>8.2f} {run['time_per_epoch_s']:>8.3f} "
            f"{run['bytes_per_worker'] / 1e6:>10.3f} {run['packets_per_worker']:>12.0f} "
            f"{run['fabric'].get('retransmissions', 0):>6} {run['final_accuracy']:>8.2f}% "
            f"{run.get('samples_per_s') or 0:>10.1f} {run.get('packets_per_s') or 0:>8.0f}"
        )
    for mode, fields in (stats or {}).items():
        parts = [f"{name} {fields[key]['median']:.{digits}f} "
                 f"[{fields[key]['min']:.{digits}f}, {fields[key]['max']:.{digits}f}]"
                 for key, name, digits in (("time_s", "time s", 2),
                                           ("samples_per_s", "samples/s", 1),
                                           ("final_accuracy", "accuracy %", 2))
                 if key in fields]  # fmt: skip
        lines.append(f"{runs[mode]['label']:<10} median [min, max]: " + ", ".join(parts))
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Loss and test accuracy against training time and against bytes sent per worker (rank 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for run in runs.values():
        steps, epochs = run["curve"]["steps"], run["curve"]["epochs"]
        for col, scale in ((0, 1.0), (1, 1e-6)):  # column 0: time (s); 1: bytes (MB)
            axes[0][col].plot([s[col] * scale for s in steps], [s[2] for s in steps],
                              label=run["label"], linewidth=0.8)
            axes[1][col].plot([e[col] * scale for e in epochs], [e[2] for e in epochs],
                              marker="o", label=run["label"])
    for col, xlabel in enumerate(("training time (s)", "bytes sent per worker (MB)")):
        axes[0][col].set(xlabel=xlabel, ylabel="training loss (rank 0)")
        axes[1][col].set(xlabel=xlabel, ylabel="test accuracy (%)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(
    out: Path, config: dict[str, Any], repeats: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Write ``results.json`` and ``plot.png`` into ``out`` from every mode's repeats (the first
    repeat is ``runs``); print the table; return the results."""
    runs = {mode: summaries[0] for mode, summaries in repeats.items()}
    stats = statistics(repeats)
    comparisons = compare_repeats(repeats)
    results = {"config": config, "runs": runs, "comparison": summarize_comparisons(comparisons),
               "comparisons": comparisons, "repeats": repeats, "statistics": stats}  # fmt: skip
    (out / RESULTS).write_text(json.dumps(results, indent=1) + "\n")
    plot(runs, out / PLOT)
    several = any(len(summaries) > 1 for summaries in repeats.values())
    print(table(runs, stats if several else None))
    for key, value in results["comparison"].items():
        if isinstance(value, float):
            print(f"{key}: {value:.4f}")
        elif isinstance(value, dict):
            print(f"{key}: " + ", ".join(f"{k} {v:.4f}" for k, v in value.items()))
        elif value is not None or not key.endswith("_spread"):
            print(f"{key}: {value}")
    print(f"results: {out / RESULTS}, plot: {out / PLOT}")
    return results
