"""The ``ncina`` process-group backend against gloo, with two real ranks and loopback aggregators.

Each test starts an aggregator (python or socket) and two rank processes running this file as a
script (``python tests/test_torch_backend.py SPEC``). Every rank joins ``init_process_group(
"ncina")`` (the job from ``NCINA_*`` variables) and a plain gloo group, runs the same collectives
on both, and writes what it saw as JSON:

- ``int`` results on powers of two (NC8 encodes them exactly, the aggregator sums them exactly):
  ``all_reduce`` SUM and AVG of float32, float16 and bfloat16 tensors of 0, 1 and several
  chunks' elements, contiguous or not, equal gloo's bit for bit, in place (same storage),
  also with ``async_op=True`` (the future's value is the tensor);
- ``nc8`` results on Gaussian values: every element within NC's deterministic bound;
- MAX, an integer tensor, broadcast, all_gather, reduce_scatter, all_to_all, barrier and
  send/recv give gloo's results, and the path counters say each went to gloo, the float
  all-reduces to INA (the aggregator's completed slots agree);
- errors: no aggregator, or a job that differs, fail ``init_process_group`` with
  ``DistBackendError`` naming the cause.

``test_unmodified_ddp_script_under_torchrun`` runs tests/ddp_script.py, a plain DDP training
script without a comm hook nor an import of ncina, under torchrun with ``--backend ncina``: it
trains, every rank ends with bit-identical parameters, and the aggregator carried the gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ncina_testlib import start_aggregator

WORLD = 2
K = 64
POOL = 16
SIZES = (0, 1, 3 * K + 5)
DTYPES = ("float32", "float16", "bfloat16")
SCRIPT = Path(__file__).with_name("ddp_script.py")


def job_env(address: tuple[str, int], **extra: str) -> dict[str, str]:
    """The environment of a rank of the test job at ``address``."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "NCINA_AGGREGATOR": "{}:{}".format(*address),
            "NCINA_JOB": "1", "NCINA_K": str(K), "NCINA_POOL_SIZE": str(POOL),
            "NCINA_DEADLINE": "20", "NCINA_EXACT_BELOW": "0", **extra}  # fmt: skip


def run_ranks(
    tmp_path: Path, backend: str, result: str, world: int = WORLD, reinit: bool = False,
    **env: str,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start the aggregator (a job of ``WORLD`` workers) and ``world`` ranks; return what each
    rank wrote and the aggregator's job stats. ``reinit``: the ranks run ``reinit`` instead of
    the collectives."""
    agg = start_aggregator(backend, tmp_path / "agg", job=1, workers=WORLD, k=K, result=result,
                           extra=["--pool-size", str(POOL), "--seed", "1"])  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            spec = {"rank": rank, "world": world, "result": result,
                    "rendezvous": str(tmp_path / "rendezvous"),
                    "out": str(tmp_path / f"{rank}.json"), "reinit": reinit}  # fmt: skip
            environ = job_env(agg.address, NCINA_RESULT=result, **env)
            procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(spec)],
                                          env=environ))  # fmt: skip
        for proc in procs:
            assert proc.wait(timeout=180) == 0
        stats = agg.stats()["jobs"]["1"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        agg.stop()
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)], stats


@pytest.mark.parametrize("backend", ["python", "socket"])
def test_collectives_match_gloo(tmp_path: Path, backend: str) -> None:
    ranks, stats = run_ranks(tmp_path, backend, "int")
    for seen in ranks:
        assert seen["error"] is None
        for case in seen["cases"]:
            assert case["ncina"] == case["gloo"], case["name"]
            assert case["in_place"], case["name"]
        ina = [c for c in seen["cases"] if c["path"] == "ina"]
        assert len(ina) == 2 * len(DTYPES) * len(SIZES) * 2 + 1  # op, dtype, size, layout; async
        # Every float all-reduce went through INA; the rest of the calls through gloo.
        paths = seen["paths"]
        assert paths.pop("allreduce/ina") == len(ina)
        assert paths == {"allreduce/gloo": 2, "broadcast/gloo": 1, "allgather/gloo": 1,
                         "reduce_scatter_single/gloo": 1, "all_to_all_single/gloo": 1,
                         "barrier/gloo": 1, "send/gloo" if seen["rank"] == 0 else "recv/gloo": 1}
    same = ("ina", "max", "int64 sum", "broadcast", "all_gather")  # one result for all ranks
    assert [c for c in ranks[0]["cases"] if c["path"] in same or c["name"] in same] == [
        c for c in ranks[1]["cases"] if c["path"] in same or c["name"] in same]
    # The aggregator completed one slot per chunk of every INA all-reduce, the handshake's, and
    # the agreement's that the clients make after their handshake.
    chunks = sum(-(-c["elements"] // K) for c in ranks[0]["cases"] if c["path"] == "ina")
    assert stats["slots_completed"] == chunks + 2


def test_nc8_results_within_nc_bounds(tmp_path: Path) -> None:
    ranks, _ = run_ranks(tmp_path, "python", "nc8")
    for seen in ranks:
        assert seen["error"] is None
        assert seen["nc8_max_error"] > 0 and seen["nc8_worst_ratio"] <= 1.0


def test_reinitialising_at_once_gives_the_exact_sum(tmp_path: Path) -> None:
    """Issue 38, case 8: ``init, all_reduce, destroy, init, all_reduce`` at once. The second
    group's clients are a new set of workers (new nonces in their hellos): the aggregator starts
    the job afresh for them, so their sums are exact (before, the second all_reduce timed out:
    the job restarted only after --restart-idle, 10 s)."""
    ranks, stats = run_ranks(tmp_path, "socket", "int", reinit=True)
    import torch

    n = torch.arange(3 * K + 5) % 20 - 10
    want = (torch.ldexp(torch.ones(n.numel()), n) * 3).tolist()  # 2^n (rank 0) + 2^(n+1)
    for seen in ranks:
        assert seen["error"] is None and seen["sums"] == [want, want]
    # Per group: the agreement its clients make after their handshake, its init call, 4 chunks.
    assert stats["slots_completed"] == 2 * (1 + 1 + 4)


def test_no_aggregator_fails_init(tmp_path: Path) -> None:
    spec = {"rank": 0, "world": 1, "result": "int", "rendezvous": str(tmp_path / "r"),
            "out": str(tmp_path / "0.json")}  # fmt: skip
    env = job_env(("127.0.0.1", 9))  # discard: nothing answers
    subprocess.run([sys.executable, __file__, json.dumps(spec)], env=env, check=True, timeout=60)
    error = json.loads((tmp_path / "0.json").read_text())["error"]
    assert error.startswith("DistBackendError: ncina: no answer to the job handshake"), error


def test_mismatched_job_fails_init(tmp_path: Path) -> None:
    ranks, _ = run_ranks(tmp_path, "socket", "int", world=1)
    error = ranks[0]["error"]
    assert error.startswith("DistBackendError: ncina:") and "workers" in error, error


def test_unmodified_ddp_script_under_torchrun(tmp_path: Path) -> None:
    agg = start_aggregator("socket", tmp_path / "agg", job=1, workers=WORLD, k=K, result="nc8",
                           extra=["--pool-size", str(POOL)])  # fmt: skip
    try:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                    str(WORLD), "--standalone", str(SCRIPT), "ncina", str(tmp_path)]
        subprocess.run(torchrun, env=job_env(agg.address, OMP_NUM_THREADS="1", NCINA_RESULT="nc8"),
                       check=True,
                       timeout=300)  # fmt: skip
        stats = agg.stats()["jobs"]["1"]
    finally:
        agg.stop()
    finals = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert finals[0]["parameters"] == finals[1]["parameters"]  # bit-identical (hex floats)
    assert finals[0]["parameters"] != finals[0]["initial"]  # it trained
    assert finals[0]["last_loss"] < finals[0]["first_loss"]
    assert stats["slots_completed"] > 0 and stats["contributions"] == WORLD * stats[
        "slots_completed"]


def test_options_from_the_environment(tmp_path: Path) -> None:
    from ncina.worker.torch_backend import NcinaOptions

    key = tmp_path / "job.key"
    key.write_text("00" * 16 + "\n")
    options = NcinaOptions.from_env({
        "NCINA_AGGREGATOR": "10.0.0.1:47000,10.0.0.2:47001", "NCINA_JOB": "7",
        "NCINA_RESULT": "int", "NCINA_KEY_FILE": str(key), "NCINA_K": "128",
        "NCINA_POOL_SIZE": "8", "NCINA_WINDOW_MAX": "12", "NCINA_MTU": "9000",
        "NCINA_DEADLINE": "5", "NCINA_SEED": "3", "NCINA_PROFILE": "tofino"})  # fmt: skip
    assert options == NcinaOptions(
        aggregators=[("10.0.0.1", 47000), ("10.0.0.2", 47001)], job=7, result_format="int",
        key=bytes(16), k=128, pool_size=8, window_max=12, mtu=9000, deadline=5.0, seed=3,
        profile="tofino")  # fmt: skip
    with pytest.raises(ValueError, match=r"\$NCINA_JOB='one'"):
        NcinaOptions.from_env({"NCINA_JOB": "one"})
    with pytest.raises(ValueError, match=r"\$NCINA_K='0': k \(elements per packet\) must be"):
        NcinaOptions.from_env({"NCINA_K": "0"})  # parsed as --k is
    with pytest.raises(ValueError, match="NCINA_AGGREGATOR"):
        NcinaOptions.from_env({}).check()
    with pytest.raises(ValueError, match="result format"):
        NcinaOptions(aggregators=[("h", 1)], result_format="fp32").check()


def test_every_job_field_is_an_option_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's job is ``JobSpec``'s fields but the workers (the world), each read from
    ``NCINA_<its option in capitals>`` as its option parses it, and taken whole from a
    ``JobSpec`` (``ncina train --backend ncina``): a field added to ``OPTIONS`` alone reaches
    the group."""
    from ncina.proto.job import OPTIONS, JobSpec, Option
    from ncina.worker.torch_backend import NcinaOptions, job_fields

    job = JobSpec(job=3, workers=2, k=12, pool_size=9, window_max=8, result="int32", mtu=9000,
                  profile="tofino")  # fmt: skip
    options = NcinaOptions.for_job([("h", 1)], job, seed=4)
    assert options.job == {name: value for name, value in job.record().items()
                           if name in job_fields() and value is not None}  # fmt: skip
    assert (options.job["k"], options.job["result"], options.job["profile"]) == (
        12, "int32", "tofino")
    assert set(job_fields()) == set(OPTIONS) - {"workers", "total_workers", "uplink"}
    monkeypatch.setitem(OPTIONS, "foo", Option("--foo-bar", "foo", "a new field", 7,
                                               kwargs={"type": int}))  # fmt: skip
    assert NcinaOptions.from_env({"NCINA_FOO_BAR": "5"}).job == {"job": 1, "foo": 5}
    with pytest.raises(TypeError, match="uplink is no field of the job it carries"):
        NcinaOptions(uplink="int")


# ---- the rank process ----


def rank_main(spec: dict[str, Any]) -> None:
    """One rank: join ``ncina`` and a gloo group, run the collectives, write what it saw."""
    import torch
    import torch.distributed as dist

    rank, world = spec["rank"], spec["world"]
    torch.set_num_threads(1)
    seen: dict[str, Any] = {"rank": rank, "error": None}
    try:
        dist.init_process_group("ncina", init_method=f"file://{spec['rendezvous']}",
                                rank=rank, world_size=world)  # fmt: skip
    except dist.DistBackendError as exc:
        seen["error"] = f"DistBackendError: {exc}"
        Path(spec["out"]).write_text(json.dumps(seen))
        return
    from ncina.worker import torch_backend

    if spec.get("reinit"):
        seen["sums"] = reinit(spec, rank, world)
        Path(spec["out"]).write_text(json.dumps(seen))
        return
    gloo = dist.new_group(backend="gloo")
    if spec["result"] == "nc8":
        seen.update(nc8_bounds(rank, world, gloo))
    else:
        seen["cases"] = exact_cases(rank, world, gloo)
        seen["paths"] = torch_backend.paths()
    Path(spec["out"]).write_text(json.dumps(seen))
    dist.destroy_process_group()


def reinit(spec: dict[str, Any], rank: int, world: int) -> list[list[float]]:
    """``all_reduce``, ``destroy_process_group``, ``init_process_group`` and ``all_reduce`` again
    at once (the group already joined by ``rank_main``): both sums as lists."""
    import torch
    import torch.distributed as dist

    sums = []
    for again in (False, True):
        if again:
            dist.init_process_group("ncina", init_method=f"file://{spec['rendezvous']}-again",
                                    rank=rank, world_size=world)  # fmt: skip
        tensor = torch.ldexp(torch.ones(3 * K + 5), torch.arange(3 * K + 5) % 20 - 10 + rank)
        dist.all_reduce(tensor)
        sums.append(tensor.tolist())
        dist.destroy_process_group()
    return sums


def exact_cases(rank: int, world: int, gloo: Any) -> list[dict[str, Any]]:
    """Each collective on ``ncina`` and on ``gloo``: the results as lists, and whether the
    result landed in the tensor given (its storage unchanged)."""
    import torch
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(7 + rank)
    cases = []

    def case(name: str, path: str, tensor: torch.Tensor, run: Any) -> None:
        mine, theirs = tensor.clone(), tensor.clone()
        pointer = mine.data_ptr()
        run(mine, None)
        run(theirs, gloo)
        cases.append({"name": name, "path": path, "elements": tensor.numel(),
                      "ncina": mine.float().tolist(), "gloo": theirs.float().tolist(),
                      "in_place": mine.data_ptr() == pointer})  # fmt: skip

    def powers(n: int, dtype: str) -> torch.Tensor:
        exponents = torch.randint(-6, 6, (n,), generator=generator).float()
        signs = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
        return (signs * 2.0**exponents).to(getattr(torch, dtype))

    def reduce_with(op: Any) -> Any:
        def run(t: torch.Tensor, group: Any) -> None:
            if op == dist.ReduceOp.AVG and group is not None:  # gloo has no AVG: SUM / world
                dist.all_reduce(t, dist.ReduceOp.SUM, group=group)
                t /= world
            else:
                dist.all_reduce(t, op, group=group)
        return run

    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        for dtype in DTYPES:
            for n in SIZES:
                case(f"{op} {dtype} {n}", "ina", powers(n, dtype), reduce_with(op))
                strided = powers(2 * n, dtype).view(2, n).t()  # not contiguous
                case(f"{op} {dtype} {n} strided", "ina", strided, reduce_with(op))

    def asynchronous(t: torch.Tensor, group: Any) -> None:
        work = dist.all_reduce(t, group=group, async_op=True)
        value = work.get_future().wait()
        assert value[0] is t or value[0].data_ptr() == t.data_ptr()
        work.wait()

    case("async", "ina", powers(2 * K, "float32"), asynchronous)
    case("max", "gloo", powers(10, "float32"), lambda t, g: dist.all_reduce(
        t, dist.ReduceOp.MAX, group=g))  # fmt: skip
    case("int64 sum", "gloo", torch.arange(5) + rank, lambda t, g: dist.all_reduce(t, group=g))
    case("broadcast", "gloo", torch.full((4,), float(rank)), lambda t, g: dist.broadcast(
        t, 1, group=g))  # fmt: skip

    def gather(t: torch.Tensor, group: Any) -> None:
        parts = [torch.empty(3) for _ in range(world)]
        dist.all_gather(parts, t[:3].clone(), group=group)
        t.copy_(torch.cat(parts))

    case("all_gather", "gloo", torch.arange(3.0 * world) + rank, gather)

    def reduce_scatter(t: torch.Tensor, group: Any) -> None:
        out = torch.empty(2)
        dist.reduce_scatter_single(out, t, group=group)
        t[:2] = out

    case("reduce_scatter", "gloo", torch.arange(2.0 * world) * (rank + 1), reduce_scatter)

    def all_to_all(t: torch.Tensor, group: Any) -> None:
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=group)
        t.copy_(out)

    case("all_to_all", "gloo", torch.arange(2.0 * world) + 10 * rank, all_to_all)
    dist.barrier()

    def send_recv(t: torch.Tensor, group: Any) -> None:
        peer = 1 - rank
        if rank == 0:
            dist.send(t, peer, group=group)
        else:
            dist.recv(t, peer, group=group)

    case("send_recv", "gloo", torch.full((3,), float(rank + 1)), send_recv)
    return cases


def nc8_bounds(rank: int, world: int, gloo: Any) -> dict[str, float]:
    """The AVG of Gaussian vectors through ``ncina`` (nc8 results) against the exact mean (from
    gloo's float64 sums): the largest error, and the largest over NC's deterministic bound."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from ncina.proto import nc8
    from ncina.proto.nc_bounds import bounds_from_sums

    x = torch.from_numpy(np.random.default_rng(rank).normal(size=5 * K).astype(np.float32))
    moments = torch.stack([x.double(), x.double().abs(), x.double() ** 2])
    dist.all_reduce(moments, group=gloo)
    got = x.clone()
    dist.all_reduce(got, dist.ReduceOp.AVG)
    total, abs_sum, sq_sum = moments.numpy()
    window = nc8.Window.for_job(world, e_max=10)
    bounds = bounds_from_sums(abs_sum, sq_sum, total, world, window.e_min, "nc8")
    error = np.abs(got.double().numpy() - total / world)
    slack = 2.0**-20 * np.abs(total / world)
    return {"nc8_max_error": float(error.max()),
            "nc8_worst_ratio": float((error / (bounds.max_error + slack)).max())}  # fmt: skip


if __name__ == "__main__":
    rank_main(json.loads(sys.argv[1]))
