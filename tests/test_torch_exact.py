"""Issue 38: the ``ncina`` backend never returns a wrong number, and behaves as gloo does.

Two ranks join ``init_process_group("ncina")`` with a job sharded over two socket aggregators
(nc8 results) and a plain gloo group, and run the issue's cases (``rank_main``); each case
records what it saw, the tests below judge it. One run serves every test (a module fixture),
so the suite pays for one start of two ranks and two aggregators. Each case names the issue's
case it reproduces (the "Why" list); every one failed on the code before the fix:

- 1: one rank's inf (and NaN, and inf on every rank) gives gloo's sum on every rank, and the
  calls after it stay paired (no desynchronisation);
- 2: values far above the job's ``2**window_max`` (1e6, 2**16-scaled gradients) are not
  clipped, a small tensor (a metric) is exact;
- 6: ``barrier()`` returns after the INA work before it completed;
- 7: ``wait(timeout)`` raises at its timeout, and the result still lands;
- 9: a shaped tensor is shared by both aggregators, a 0-dim one is reduced;
- 10: a sparse tensor is reduced by gloo;
- 11: ``_functional_collectives.all_reduce`` and ``Work.result()`` work;
- GradScaler (CPU autocast bfloat16) skips the steps gloo skips, with the same scale;
- a seeded random sequence of calls (sizes on both sides of the threshold, three dtypes,
  infinities and NaNs on random ranks, async calls and barriers) on ``ncina`` and gloo side by
  side, through three aggregator restarts: bit-equal on the exact path, within NC8's
  deterministic bound on the lossy one, the same bits on both ranks, and every rank's client
  of the restarted aggregator counted each restart.

The restarts (``RESTARTS``) are the parent's: rank 0 asks for one with a file in a control
folder, the parent SIGKILLs that aggregator and starts another on its address with a new
``--generation``, and acknowledges with another file (``restart_aggregators``). Two come during
an INA call, rank 1 held back before its fabric call until the acknowledgement, so that rank
0's half of the call is in flight in the killed aggregator (the parent waits until its stats show
it); one comes between two calls while both ranks wait in a gloo barrier. Nothing waits on a
guessed sleep. With ``restart_retries=0`` in the clients the property case fails: rank 0's
call raises ``AggregatorRestartedError``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from ncina_testlib import start_aggregator

from ncina.harness.aggregators import RunningAggregator

WORLD = 2
K = 64
POOL = 16
EXACT_BELOW = 512  # the job's threshold here: small enough that the lossy cases stay small
PROPERTY_CALLS = 40
# The property test's aggregator restarts: (call, in flight, aggregator). In flight: during
# the first INA call from that one on; else between that call and the next, while the ranks
# wait in a gloo barrier. Fixed points, spread over the sequence, on both aggregators.
RESTARTS = ((6, True, 0), (17, False, 1), (29, True, 1))


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the two ranks once, restarting an aggregator whenever rank 0 asks
    (``restart_aggregators``); return what the ranks saw, the restarts made (aggregator and
    new generation, in order) and each aggregator's completed slots over all its starts."""
    tmp_path = tmp_path_factory.mktemp("exact")
    control = tmp_path / "control"
    control.mkdir()
    aggs = [_aggregator(tmp_path / f"agg{i}", i + 1) for i in range(2)]
    completed = [0, 0]
    restarts: list[tuple[int, int]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
               "NCINA_AGGREGATOR": ",".join("{}:{}".format(*a.address) for a in aggs),
               "NCINA_JOB": "1", "NCINA_K": str(K), "NCINA_POOL_SIZE": str(POOL),
               "NCINA_RESULT": "nc8", "NCINA_DEADLINE": "20",
               "NCINA_EXACT_BELOW": str(EXACT_BELOW)}  # fmt: skip
        for rank in range(WORLD):
            spec = {"rank": rank, "rendezvous": str(tmp_path / "rendezvous"),
                    "out": str(tmp_path / f"{rank}.json"), "control": str(control)}  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(spec)], env=env))
        restart_aggregators(procs, aggs, control, completed, restarts, tmp_path)
        for proc in procs:
            assert proc.wait(timeout=240) == 0
        for i, agg in enumerate(aggs):
            completed[i] += agg.stats()["jobs"]["1"]["slots_completed"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for agg in aggs:
            agg.stop()
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    return {"ranks": ranks, "restarts": restarts, "slots_completed": completed}


def _aggregator(workdir: Path, generation: int, listen: str = "127.0.0.1:0") -> RunningAggregator:
    """A socket aggregator of the job, of ``generation``, listening on ``listen``."""
    return start_aggregator("socket", workdir, job=1, workers=WORLD, k=K, result="nc8",
                            listen=listen, extra=["--pool-size", str(POOL), "--seed", "1",
                                                  "--generation", str(generation)])  # fmt: skip


def restart_aggregators(
    procs: list[subprocess.Popen[bytes]],
    aggs: list[RunningAggregator],
    control: Path,
    completed: list[int],
    restarts: list[tuple[int, int]],
    tmp_path: Path,
) -> None:
    """Until the ranks exit: serve rank 0's restart requests (``request-N.json`` in
    ``control``, ``_ask_restart``) in order. Each SIGKILLs the aggregator it names and starts
    a new one on the same address with the next generation, then acknowledges (``ack-N``).
    For a request ``in_flight`` it first waits until that aggregator holds a slot that only
    some ranks contributed to (the call rank 0 started is in flight there, rank 1 held back):
    the kill loses it. ``completed`` adds the completed slots of each start killed."""
    deadline = time.monotonic() + 240
    while any(proc.poll() is None for proc in procs):
        assert time.monotonic() < deadline, "the ranks did not finish"
        request = control / f"request-{len(restarts)}.json"
        if not request.exists():
            time.sleep(0.005)  # polling the ranks' files; nothing waits on this period
            continue
        asked = json.loads(request.read_text())
        index, old = asked["aggregator"], aggs[asked["aggregator"]]
        stats = old.stats()["jobs"]["1"]
        while asked["in_flight"] and stats["contributions"] <= WORLD * stats["slots_completed"]:
            assert time.monotonic() < deadline, "rank 0's call never reached the aggregator"
            stats = old.stats()["jobs"]["1"]
        completed[index] += stats["slots_completed"]
        old.process.kill()
        old.process.wait()
        generation = 3 + len(restarts)  # 1 and 2 are the first starts'; up to MAX_GENERATION
        host, port = old.address
        aggs[index] = _aggregator(tmp_path / f"agg{index}-{generation}", generation,
                                  f"{host}:{port}")  # fmt: skip
        restarts.append((index, generation))
        _write(control / f"ack-{len(restarts) - 1}", "")


def _write(path: Path, text: str) -> None:
    """Write ``path`` whole at once (a rename), so that a reader polling for it never reads
    it half-written."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.replace(path)


def cases(seen: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Case ``name`` as each rank saw it; fails on a case that raised."""
    found = [r["cases"][name] for r in seen["ranks"]]
    for rank, case in enumerate(found):
        assert case.get("error") is None, f"rank {rank}: {case['error']}"
    return found


def test_one_ranks_inf_gives_glooss_sum_on_every_rank_and_no_desync(seen: dict[str, Any]) -> None:
    for case in cases(seen, "nonfinite"):
        assert case["ncina"] == case["gloo"]  # inf, nan, -inf + inf = nan: gloo's (as strings)
        assert case["after"] == case["after_gloo"]  # the calls after it are paired as before
    assert cases(seen, "nonfinite")[0] == cases(seen, "nonfinite")[1]


def test_large_values_are_not_clipped_and_small_tensors_are_exact(seen: dict[str, Any]) -> None:
    for case in cases(seen, "range"):
        assert case["small"] == case["small_gloo"]  # a metric-sized call: bit for bit
        # NC8 rounds each contribution and the sum to a neighbouring power of two: within 4x.
        for got, want in zip(case["large"], case["large_gloo"], strict=True):
            assert want / 4 <= got <= want * 4, (got, want)
        assert case["saturated"] == 0
        assert case["paths"] == {"allreduce/ina": 1, "allreduce/exact": 1}


def test_barrier_waits_for_outstanding_ina_work(seen: dict[str, Any]) -> None:
    for case in cases(seen, "barrier"):
        assert case["completed_after_barrier"]
        assert case["ncina"] == case["gloo"]


def test_wait_honours_its_timeout(seen: dict[str, Any]) -> None:
    waiter = cases(seen, "wait_timeout")[0]  # rank 1 joins the call 4 s late
    assert waiter["raised"].startswith("DistBackendError: ncina all_reduce: not complete")
    assert waiter["raised_after_s"] < 3.0, waiter  # 0.5 s asked; the old wait() took 4 s
    assert waiter["then"] == 2.0 * 4096  # the call went on and its result landed


def test_shaped_and_0_dim_tensors_shard_over_both_aggregators(seen: dict[str, Any]) -> None:
    for case in cases(seen, "shaped"):
        assert case["scalar"] == case["scalar_gloo"]  # below the threshold: exact
        assert case["shaped_ok"]
        assert case["shares"] == [32000, 32000]  # 1000 chunks, 500 each (all on one before)
    assert all(completed > 500 for completed in seen["slots_completed"])


def test_sparse_tensors_go_to_gloo(seen: dict[str, Any]) -> None:
    for case in cases(seen, "sparse"):
        assert case["ncina"] == case["gloo"] and case["path"] == "allreduce/gloo"


def test_functional_all_reduce_and_work_result(seen: dict[str, Any]) -> None:
    for case in cases(seen, "api"):
        assert case["functional"] == case["functional_gloo"]  # exact: below the threshold
        assert case["result"] == [2.0] * 2048 and case["result_is_tensor"]


def test_grad_scaler_skips_the_steps_gloo_skips(seen: dict[str, Any]) -> None:
    ranks = cases(seen, "grad_scaler")
    for case in ranks:
        assert case["scales"] == case["scales_gloo"]  # the same steps skipped, the same scale
        assert case["scales"] == [2.0**15, 2.0**14, 2.0**13] + [2.0**13] * 3
        assert case["finite"]
    assert ranks[0]["parameters"] == ranks[1]["parameters"]  # in step on both ranks


def test_random_call_sequences_match_gloo(seen: dict[str, Any]) -> None:
    ranks = cases(seen, "property")
    assert ranks[0]["results"] == ranks[1]["results"]  # never desynchronised: the same bits
    # Every restart was made, and every rank's client of that aggregator recovered from it.
    assert [index for index, _ in seen["restarts"]] == [a for _, _, a in RESTARTS]
    for case in ranks:
        assert case["restarts"] == [[a for _, _, a in RESTARTS].count(i) for i in range(2)]
        assert case["generations"] == [max(g for a, g in seen["restarts"] if a == i)
                                       for i in range(2)]  # fmt: skip
    assert [c["kind"] for c in ranks[0]["calls"] if c["restart"]] == ["lossy", "lossy"]
    kinds = {c["kind"] for c in ranks[0]["calls"]}
    assert kinds == {"exact", "lossy", "nonfinite"}, kinds
    for call in ranks[0]["calls"]:
        if call["kind"] == "lossy":
            assert call["worst_ratio"] <= 1.0, call
        else:
            assert call["equal"], call


def test_the_agreed_plan_scales_into_the_window_or_goes_exact() -> None:
    """The hook's per-call plan from the agreed flags (no processes): the largest magnitude
    lands in the window's top power, non-finite values and sums past float32 go exact, a
    compressor's fabric is not scaled."""
    from types import SimpleNamespace

    from ncina.proto import nc8
    from ncina.worker.torch_hook import InaHookState

    window = nc8.Window.for_job(2, e_max=10)
    plain = SimpleNamespace(window=window, compressor=None, mode="ina")
    state = InaHookState(SimpleNamespace(clients=[plain]))  # type: ignore[arg-type]
    shift = state._plan(False, 1e6, 2)  # 2**19 <= 1e6 < 2**20
    assert shift == 10 - 1 - 19 and 2.0**19 * 2.0**shift == 2.0 ** (window.e_max - 1)
    assert state._plan(False, 2.0**-140, 2) == 10 - 1 + 140  # a subnormal peak, scaled up
    assert state._plan(False, 0.0, 2) == 0
    assert state._plan(False, 2.0**125, 2) is not None  # 2 * 2**126 is still finite
    assert state._plan(False, 2.0**126, 2) is None  # 2 * 2**127 may not be
    assert state._plan(True, 0.0, 2) is None
    assert state.exact_calls == {"range": 1, "nonfinite": 1}
    compressed = SimpleNamespace(window=window, compressor=object(), mode="ina")
    assert InaHookState(SimpleNamespace(clients=[compressed]))._plan(False, 1e6, 2) == 0  # type: ignore[arg-type]
    state.close()


def test_exact_switches_from_the_environment() -> None:
    from ncina.worker.torch_backend import DEFAULT_EXACT_BELOW, NcinaOptions

    assert NcinaOptions.from_env({}).exact_below == DEFAULT_EXACT_BELOW
    options = NcinaOptions.from_env({"NCINA_EXACT": "1", "NCINA_EXACT_BELOW": "0"})
    assert options.exact and options.exact_below == 0
    with pytest.raises(ValueError, match=r"\$NCINA_EXACT='maybe'.*1 or 0"):
        NcinaOptions.from_env({"NCINA_EXACT": "maybe"})


# ---- the rank process ----


def rank_main(spec: dict[str, Any]) -> None:
    """One rank: every case in turn, each recording what it saw (or the error it raised)."""
    import torch
    import torch.distributed as dist

    rank = spec["rank"]
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)  # a desynchronised gloo call fails instead of hanging
    dist.init_process_group("ncina", init_method=f"file://{spec['rendezvous']}", rank=rank,
                            world_size=WORLD, timeout=timeout)  # fmt: skip
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    seen: dict[str, Any] = {}
    only = os.environ.get("TORCH_EXACT_CASES")  # a comma-separated few (to try the old code)
    runs = {**CASES, "property": functools.partial(case_property, control=Path(spec["control"]))}
    for name, case in runs.items():
        if only and name not in only.split(","):
            continue
        try:
            seen[name] = case(rank, gloo)
        except Exception as exc:
            seen[name] = {"error": f"{type(exc).__name__}: {exc}"}
    Path(spec["out"]).write_text(json.dumps({"cases": seen}))
    dist.destroy_process_group()


def _values(t: Any) -> list[str]:
    """A tensor's values as exact strings (hex floats; nan and inf by name)."""
    return [float(v).hex() for v in t.double().flatten().tolist()]


def _both(t: Any, gloo: Any, run: Any) -> tuple[list[str], list[str]]:
    """``run(tensor, group)`` on a copy through ``ncina`` (group None) and one through gloo."""
    mine, theirs = t.clone(), t.clone()
    run(mine, None)
    run(theirs, gloo)
    return _values(mine), _values(theirs)


def _sum(t: Any, group: Any) -> None:
    import torch.distributed as dist

    dist.all_reduce(t, group=group)


def case_range(rank: int, gloo: Any) -> dict[str, Any]:
    """Issue case 2: ``[5000, 1e6, 3, 1e-9]`` (and 2**16-scaled values) summed over 2 ranks."""
    import torch
    from ncina.worker import torch_backend

    small = torch.tensor([5000.0, 1e6, 3.0, 1e-9, 0.25 * 2**16])
    large = small.repeat(EXACT_BELOW)  # above the threshold: the lossy path
    got, want = _both(large, gloo, _sum)
    small_mine, small_gloo = _both(small, gloo, _sum)
    fabric = torch.distributed.distributed_c10d._get_default_group().state.fabric
    return {"small": small_mine, "small_gloo": small_gloo,
            "large": [float.fromhex(v) for v in got],
            "large_gloo": [float.fromhex(v) for v in want],
            "saturated": fabric.stats["saturated"], "paths": torch_backend.paths()}  # fmt: skip


def case_barrier(rank: int, gloo: Any) -> dict[str, Any]:
    """Issue case 6: an async all-reduce, then ``barrier()``: the work is complete after it."""
    import time

    import torch
    import torch.distributed as dist

    t = torch.full((1 << 16,), 0.5)  # a power of two: NC8 carries it exactly
    if rank == 1:
        time.sleep(0.5)
    work = dist.all_reduce(t, async_op=True)
    dist.barrier()
    completed = work.is_completed()
    work.wait()
    return {"completed_after_barrier": completed, "ncina": _values(t[:4]),
            "gloo": _values(torch.full((4,), 1.0))}  # fmt: skip


def case_wait_timeout(rank: int, gloo: Any) -> dict[str, Any]:
    """Issue case 7: rank 1 joins 4 s late; rank 0's ``wait(timeout=0.5 s)`` raises at once."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t = torch.full((4096,), 1.0)
    if rank == 1:
        time.sleep(4.0)
    work = dist.all_reduce(t, async_op=True)
    raised, after = None, 0.0
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=0.5))
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    after = time.monotonic() - start
    work.wait()
    return {"raised": raised, "raised_after_s": after, "then": float(t.sum())}


def case_shaped(rank: int, gloo: Any) -> dict[str, Any]:
    """Issue case 9: a 64x1000 tensor and a 0-dim one through two aggregators."""
    import torch
    import torch.distributed as dist

    clients = dist.distributed_c10d._get_default_group().state.fabric.clients
    before = [c.stats["elements"] for c in clients]
    shaped = torch.full((64, 1000), 0.5 * (rank + 1))
    dist.all_reduce(shaped)
    shares = [c.stats["elements"] - b for c, b in zip(clients, before, strict=True)]
    scalar, scalar_gloo = _both(torch.tensor(0.75 + rank), gloo, _sum)
    return {"shaped_ok": bool(((shaped == 1.0) | (shaped == 2.0)).all()),  # NC8 of 1.5
            "shares": shares, "scalar": scalar, "scalar_gloo": scalar_gloo}  # fmt: skip


def case_sparse(rank: int, gloo: Any) -> dict[str, Any]:
    """Issue case 10: a sparse float tensor goes to gloo."""
    import torch
    from ncina.worker import torch_backend

    before = torch_backend.paths().get("allreduce/gloo", 0)
    t = torch.sparse_coo_tensor([[0, 2 + rank]], [1.5, 2.0], (8,))

    def run(x: Any, group: Any) -> None:
        import torch.distributed as dist

        dist.all_reduce(x, group=group)
        x.copy_(x.coalesce())

    mine, theirs = t.clone(), t.clone()
    run(mine, None)
    run(theirs, gloo)
    path = "allreduce/gloo" if torch_backend.paths().get("allreduce/gloo", 0) == before + 1 else "?"
    return {"ncina": _values(mine.to_dense()), "gloo": _values(theirs.to_dense()), "path": path}


def case_api(rank: int, gloo: Any) -> dict[str, Any]:
    """Issue case 11: ``_functional_collectives.all_reduce`` and ``Work.result()``."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional

    x = torch.tensor([0.1, 3.0, 1e6]) * (rank + 1)
    got = functional.all_reduce(x, "sum", dist.group.WORLD).wait()
    want = x.clone()
    dist.all_reduce(want, group=gloo)
    t = torch.ones(2048)
    work = dist.all_reduce(t, async_op=True)
    result = work.result()
    return {"functional": _values(got), "functional_gloo": _values(want),
            "result": result[0].tolist(), "result_is_tensor": result[0] is t}  # fmt: skip


def case_grad_scaler(rank: int, gloo: Any) -> dict[str, Any]:
    """GradScaler with CPU autocast (bfloat16): rank 0's loss overflows in its first three
    steps, so its gradients are inf or NaN there and rank 1's are not; through ``ncina`` as
    through gloo, every rank skips those steps and halves the scale (the gradient bucket is
    above the threshold: the lossy path)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    def train(group: Any) -> tuple[list[float], Any]:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(64, 16), process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler("cpu", growth_interval=1000)  # 2**16 at first
        generator = torch.Generator().manual_seed(rank)
        scales = []
        for step in range(6):
            inputs = torch.randn(4, 64, generator=generator) * (1e30 if rank + step < 3 else 1.0)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(inputs).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, model.module

    scales, module = train(None)
    scales_gloo, _ = train(gloo)
    parameters = [_values(p.detach()) for p in module.parameters()]
    return {"scales": scales, "scales_gloo": scales_gloo, "parameters": parameters,
            "finite": all(bool(p.isfinite().all()) for p in module.parameters())}  # fmt: skip


def case_property(rank: int, gloo: Any, control: Path) -> dict[str, Any]:
    """A seeded random sequence of calls (the same on both ranks, each rank its own values):
    sizes on both sides of the threshold, three dtypes, infinities and NaNs on random ranks,
    SUM and AVG, async calls waited late, barriers; each on ``ncina`` and on gloo. At fixed
    points (``RESTARTS``) rank 0 has the parent restart an aggregator (``_ask_restart``):
    during the next INA call (rank 1 held back before its fabric call until the restart is
    done, so rank 0's call is in flight there) or after a call while rank 1 waits in a gloo
    barrier. Returns the calls, their results, and each client's restarts and generation."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from ncina.proto.nc_bounds import bounds_from_sums

    plan = np.random.default_rng(38)  # the sequence: the same on every rank
    values = torch.Generator().manual_seed(1000 + rank)
    state = dist.distributed_c10d._get_default_group().state
    window = state.fabric.clients[0].window
    held = _hold_fabric(state.fabric, control) if rank == 1 else None
    schedule = list(RESTARTS)  # (before call, in flight, aggregator), in call order
    calls, results, pending = [], [], []
    for index in range(PROPERTY_CALLS):
        n = int(plan.choice([1, 7, EXACT_BELOW - 1, EXACT_BELOW, 3 * K + 5, 2000]))
        dtype = [torch.float32, torch.float16, torch.bfloat16][int(plan.integers(3))]
        average = bool(plan.integers(2))
        low, high = (-8, 20) if dtype == torch.float16 else (-30, 40)  # no float16 subnormals
        scale = 2.0 ** int(plan.integers(low, high))
        x = (torch.randn(n, generator=values) * scale).to(dtype)
        poison = int(plan.integers(-4, WORLD))  # negative: no non-finite value in this call
        if poison == rank:
            x[int(plan.integers(n))] = [math.inf, -math.inf, math.nan][int(plan.integers(3))]
        elif poison >= 0:
            plan.integers(n), plan.integers(3)  # keep the plan in step with the poisoned rank
        mine, theirs = x.clone(), x.clone()
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        # An INA call (lossy: above the threshold, finite everywhere) takes a due restart in
        # flight: its 512 or 2000 elements are 4 or 16 chunks an aggregator, all sent at once
        # (K, POOL); the parent kills the aggregator once the first has reached it.
        in_flight = bool(schedule) and schedule[0][1] and schedule[0][0] <= index \
            and n >= EXACT_BELOW and poison < 0  # fmt: skip
        restart = schedule.pop(0) if in_flight else None
        if held is not None and restart is not None:
            held.append(len(RESTARTS) - len(schedule) - 1)  # wait for its ack, then the call
        asynchronous = plan.integers(3) == 0  # waited after the next call or barrier
        if asynchronous or (restart is not None and rank == 0):
            pending.append((dist.all_reduce(mine, op, async_op=True), mine))
            if restart is not None and rank == 0:
                _ask_restart(control, len(RESTARTS) - len(schedule) - 1, restart[2], True)
        else:
            dist.all_reduce(mine, op)
        if plan.integers(4) == 0:
            dist.barrier()
            assert all(work.is_completed() for work, _ in pending), "barrier left INA work"
        for work, _ in pending:
            work.wait()
        pending.clear()
        shift_before = state.last_shift  # the scale of this call (torch_hook)
        dist.all_reduce(theirs, group=gloo)
        if average:
            theirs /= WORLD
        flags = torch.tensor([float(not x.isfinite().all())])
        dist.all_reduce(flags, group=gloo)
        kind = "nonfinite" if flags.item() else "exact" if n < EXACT_BELOW else "lossy"
        record: dict[str, Any] = {"kind": kind, "n": n, "dtype": str(dtype), "avg": average,
                                  "restart": restart is not None}  # fmt: skip
        if kind == "lossy":  # NC8's deterministic bound for this call's window
            x64 = x.double()
            moments = torch.stack([x64, x64.abs(), x64**2])
            dist.all_reduce(moments, group=gloo)
            total, abs_sum, sq_sum = moments.numpy()
            e_min = window.e_min - shift_before
            bounds = bounds_from_sums(abs_sum, sq_sum, total, WORLD, e_min, "nc8")
            got_mean = mine.double().numpy() / (1 if average else WORLD)
            slack = (2.0**-7 if dtype != torch.float32 else 2.0**-20) * np.abs(got_mean)
            record["worst_ratio"] = float(
                (np.abs(got_mean - total / WORLD) / (bounds.max_error + slack)).max())
        else:
            record["equal"] = _values(mine) == _values(theirs)
        calls.append(record)
        results.append(_values(mine))
        if schedule and schedule[0][:2] == (index, False):  # between this call and the next
            number = len(RESTARTS) - len(schedule)
            if rank == 0:
                _ask_restart(control, number, schedule[0][2], False)
                _wait_for(control / f"ack-{number}")
            dist.barrier(group=gloo)  # rank 1 waits here, in gloo, through the restart
            schedule.pop(0)
    assert not schedule, f"restarts never made: {schedule}"
    clients = state.fabric.clients
    return {"calls": calls, "results": results,
            "restarts": [c.stats["restarts"] for c in clients],
            "generations": [c.generation for c in clients]}  # fmt: skip


def _ask_restart(control: Path, number: int, aggregator: int, in_flight: bool) -> None:
    """Rank 0 asks the parent for restart ``number`` of ``aggregator`` (``restart_aggregators``;
    ``in_flight``: during the call rank 0 has just started); the parent acknowledges with
    ``ack-NUMBER`` (``_wait_for``)."""
    _write(control / f"request-{number}.json",
           json.dumps({"aggregator": aggregator, "in_flight": in_flight}))  # fmt: skip


def _wait_for(path: Path) -> None:
    """Return once ``path`` exists (the parent's acknowledgement; it writes it whole)."""
    while not path.exists():
        time.sleep(0.001)


def _hold_fabric(fabric: Any, control: Path) -> list[int]:
    """Hold rank 1's next fabric call (after the call's agreement, on the communication
    thread) until the parent acknowledges restart ``N``, for each ``N`` appended to the
    returned list: rank 0's half of that call is then in flight when the aggregator dies."""
    holds: list[int] = []
    allreduce = fabric.allreduce

    def held_allreduce(*args: Any, **kwargs: Any) -> Any:
        if holds:
            _wait_for(control / f"ack-{holds.pop(0)}")
        return allreduce(*args, **kwargs)

    fabric.allreduce = held_allreduce
    return holds


def case_nonfinite(rank: int, gloo: Any) -> dict[str, Any]:
    """Issue case 1: rank 0 all-reduces ``[inf, 1]`` (and NaN, and both ranks inf) where rank 1
    has ``[2, 1]``; then the issue's next calls, ``[10, 1]`` and ``[300, 1]``-like, must be
    paired as on gloo. Last: on the old code it left the ranks out of step."""
    import torch

    n = EXACT_BELOW  # the lossy path's size
    inf, nan = math.inf, math.nan
    rows = [[inf, 1.0], [nan, 1.0], [inf, inf], [-inf, 1.0]] if rank == 0 else \
        [[2.0, 1.0], [2.0, 1.0], [inf, 2.0], [inf, 1.0]]  # fmt: skip
    mine, theirs = [], []
    for row in rows:
        got, want = _both(torch.tensor(row).repeat(n // 2), gloo, _sum)
        mine.append(got[:2])
        theirs.append(want[:2])
    after, after_gloo = [], []
    for value in (10.0, 300.0 if rank == 0 else 0.0):
        got, want = _both(torch.tensor([value, 1.0]).repeat(4), gloo, _sum)  # exact: small
        after.append(got[:2])
        after_gloo.append(want[:2])
    return {"ncina": mine, "gloo": theirs, "after": after, "after_gloo": after_gloo}


CASES = {"range": case_range, "barrier": case_barrier, "wait_timeout": case_wait_timeout,
         "shaped": case_shaped, "sparse": case_sparse, "api": case_api,
         "grad_scaler": case_grad_scaler, "property": case_property,
         "nonfinite": case_nonfinite}  # fmt: skip


if __name__ == "__main__":
    rank_main(json.loads(sys.argv[1]))
