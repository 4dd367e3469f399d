"""The socket backend: the C slot engine behind one kernel UDP socket, on loopback, no root.

- wire parity with the Python reference (``ncina_parity``): the same datagrams to every rank
  (results and notices, byte for byte) and the same counters, int and nc8 results, untagged and
  keyed, with packets of an earlier generation;
- bound to 0.0.0.0, every reply comes from the address the worker sent to (IP_PKTINFO);
- real ``AllreduceClient`` workers all-reduce through it with exact results, also with 5 % of
  the datagrams lost both ways (iptables on loopback, root only);
- what it refuses (``--jobs-dir``), the socket section of its stats, a prompt stop when idle,
  every thread's stack on SIGUSR2 (what ``aggproc.stop`` asks for before a SIGKILL).

The scenario suite and the fuzz test run on socket through test_aggregator_packets.py and
test_fuzz.py.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.aggregator import process as aggproc
from ncina.worker.client import AllreduceClient
from ncina_parity import assert_wire_parity
from ncina_testlib import (
    Worker,
    aggregator_command,
    dissect,
    launch_aggregator,
    start_aggregator,
    uplink,
    window_e_min,
)
from test_jobs import wait_for_log

from ncina.harness.aggregators import wait_ready
from ncina.harness.reference import powers_of_two

JOB = 3


@pytest.mark.parametrize("keyed", [False, True], ids=["untagged", "keyed"])
@pytest.mark.parametrize("result", ["int", "nc8"])
def test_wire_parity_with_the_python_backend(tmp_path: Path, result: str, keyed: bool) -> None:
    assert_wire_parity("socket", tmp_path, result, keyed)


@pytest.mark.parametrize("keyed", [False, True], ids=["untagged", "keyed"])
@pytest.mark.parametrize("result", ["int", "nc8"])
def test_spine_wire_parity_with_the_python_backend(
    tmp_path: Path, result: str, keyed: bool
) -> None:
    """A spine (--uplink int): its leaves' int partial sums, bounded, added and re-compressed
    as the python spine does (docs/protocol.md, "Hierarchical aggregation")."""
    assert_wire_parity("socket", tmp_path, result, keyed, spine=True)


def test_bound_to_any_address_replies_come_from_the_address_sent_to(tmp_path: Path) -> None:
    agg = start_aggregator("socket", tmp_path, job=JOB, workers=2, k=4, result="int",
                           listen="0.0.0.0:0")  # fmt: skip
    try:
        port = agg.address[1]
        # Two loopback addresses the socket serves: each worker must hear from the one it used.
        workers = [Worker((host, port)) for host in ("127.0.0.1", "127.0.0.2")]
        for rank, worker in enumerate(workers):
            worker.send(uplink(job=JOB, rank=rank, slot=0, offset=0, codes=[1, 2, 3, 0x81],
                               emin=window_e_min(2)))  # fmt: skip
        for worker in workers:
            fields, payload = dissect(worker.receive())  # asserts the source address and port
            assert fields["flags"] & 1 and payload == b"".join(
                v.to_bytes(8, "big", signed=True) for v in (2, 4, 8, -2)
            )
            worker.close()
    finally:
        assert agg.stop() == 0, agg.log()
    assert "Traceback" not in agg.log()


def test_it_serves_as_an_unprivileged_user() -> None:
    """No root, no capability: the C engine behind a UDP socket runs as nobody (building its
    extension into a cache of nobody's own, in a directory nobody can reach: pytest's are
    root's alone). A checkout under a directory nobody cannot search (root's home, mode 700) is
    shown to nobody through a mount namespace of its own (``nobody_view``)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("switching to an unprivileged user needs root and setpriv")
    with tempfile.TemporaryDirectory(prefix="ncina-nobody-") as where:
        home = Path(where)
        home.chmod(0o777)
        run_as_nobody(home)


def nobody_view(home: Path) -> list[str]:
    """The command prefix that lets nobody run this interpreter and this checkout (they must
    be readable by others, as ``git clone`` and ``make venv`` leave them): nothing when every
    directory above them is searchable by others; else ``unshare`` into a private mount
    namespace where a tmpfs covers the highest directory nobody cannot search and the checkout
    is bound back at its own path (the editable install and the venv hold absolute paths). The
    test is skipped, saying why, when that cannot be arranged."""
    checkout = Path(__file__).resolve().parents[1]
    prefix = Path(sys.prefix).resolve()
    if not prefix.is_relative_to(checkout):  # a venv elsewhere: two trees to show, not done
        blocked = [d for d in (checkout, prefix) if _closed_ancestor(d)]
        if blocked:
            pytest.skip(f"nobody cannot reach {blocked[0]} (a directory above it is not "
                        "searchable by others) and the venv is outside the checkout")
        return []
    closed = _closed_ancestor(checkout)
    if closed is None:
        return []
    if shutil.which("unshare") is None:
        pytest.skip(f"nobody cannot search {closed} (above the checkout) and unshare is missing")
    stash = home / "checkout"
    stash.mkdir()
    script = (
        "set -e; umask 022; mount --rbind \"$1\" \"$2\"; "
        "mount -t tmpfs -o mode=0755 ncina-nobody \"$3\"; mkdir -p \"$1\"; "
        "mount --rbind \"$2\" \"$1\"; shift 3; exec \"$@\""
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            str(checkout), str(stash), str(closed)]  # fmt: skip


def _closed_ancestor(path: Path) -> Path | None:
    """The highest directory above ``path`` (``path`` excluded) that others cannot search."""
    for parent in reversed(path.parents):
        if not parent.stat().st_mode & 0o001:
            return parent
    return None


def run_as_nobody(home: Path) -> None:
    """Start a socket aggregator as nobody with ``home`` as its home, aggregate one datagram."""
    log_path = home / "aggregator.log"
    argv = aggregator_command("socket", ["--listen", "127.0.0.1:0", "--job", str(JOB),
                                         "--workers", "1", "--k", "4", "--result", "int"])
    command = [*nobody_view(home), "setpriv", "--reuid=65534", "--regid=65534",
               "--clear-groups", "env", f"HOME={home}", f"NCINA_CACHE={home / 'cache'}", *argv]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        address = aggproc.wait_ready(proc, log_path, 120.0)
        assert os.stat(f"/proc/{proc.pid}").st_uid == 65534  # unshare, sh, setpriv, env exec'd
        worker = Worker(address)
        worker.send(uplink(job=JOB, rank=0, slot=0, offset=0, codes=[3], emin=window_e_min(1)))
        _, payload = dissect(worker.receive())
        worker.close()
    finally:
        assert aggproc.stop(proc) == 0, log_path.read_text()
    assert payload == (4).to_bytes(8, "big")
    assert "Traceback" not in log_path.read_text()


def test_socket_section_of_the_stats_and_a_prompt_idle_stop(tmp_path: Path) -> None:
    agg = start_aggregator("socket", tmp_path, job=JOB, workers=1, k=4, result="int")
    try:
        worker = Worker(agg.address)
        worker.send(uplink(job=JOB, rank=0, slot=0, offset=0, codes=[1], emin=window_e_min(1)))
        worker.receive()
        worker.close()
        stats = agg.stats()
    finally:
        # Idle, the loop sleeps in poll(): SIGTERM must still end it (stop() waits 10 s at
        # most before SIGKILL, which would give -9).
        assert agg.stop() == 0, agg.log()
    assert stats["backend"] == "socket"
    section = stats["socket"]
    assert section["rx_datagrams"] == 1 and section["tx_datagrams"] == 1
    assert section["send_errors"] == 0
    assert stats["jobs"][str(JOB)]["slots_completed"] == 1


def test_sigusr2_prints_where_every_thread_is_and_serving_goes_on(tmp_path: Path) -> None:
    """What ``aggproc.stop`` asks for before a SIGKILL: every thread's Python stack on the log,
    the main thread in its poll and the C loop's thread in its call; the aggregator serves on."""
    agg = start_aggregator("socket", tmp_path, job=JOB, workers=1, k=4, result="int")
    try:
        agg.process.send_signal(signal.SIGUSR2)
        wait_for_log(agg, "in _loop")
        worker = Worker(agg.address)
        worker.send(uplink(job=JOB, rank=0, slot=0, offset=0, codes=[1], emin=window_e_min(1)))
        _, payload = dissect(worker.receive())
        worker.close()
    finally:
        assert agg.stop() == 0, agg.log()
    stacks = agg.log()
    assert "in _poll" in stacks and "in _loop" in stacks, stacks
    assert payload == (1).to_bytes(8, "big")  # code 1: one unit of the window


@pytest.mark.timeout(30)
def test_a_stop_signal_handled_inside_the_polls_wait_ends_the_run() -> None:
    """Stop 47's CI: a C-engine aggregator that never ended after SIGTERM. Its handler ran in
    the main thread just after the poll's ``Event.wait`` had re-taken its lock on a timeout,
    and set that Event, which waited on the lock for good. Here the signal is sent at exactly
    that point (a trace function on the lock's re-take within ``_poll``); ``run`` must end."""
    from ncina.aggregator.backends.socket.driver import SocketBackend
    from ncina.aggregator.jobs import JobConfig

    config = JobConfig.create(job=JOB, workers=1, k=4, result_format="int", seed=1)
    backend = SocketBackend([config], ("127.0.0.1", 0), log=io.StringIO())
    sent: list[bool] = []

    def in_poll(frame: Any) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "_poll":
                return True
            frame = frame.f_back
        return False

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_name == "_acquire_restore" and in_poll(frame):
            return on_return
        return None

    def on_return(frame: Any, event: str, arg: Any) -> Any:
        if event == "return" and not sent:  # the wait's lock is held again
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return on_return

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        status = backend.run()
    finally:
        sys.settrace(previous)
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert sent and status == 0


def test_a_stop_that_outlives_its_grace_gets_the_stacks_then_sigkill(tmp_path: Path) -> None:
    """A process that ignores SIGTERM (as a stuck aggregator does): ``stop`` sends SIGUSR2,
    gives it ``STACKS_WAIT`` to print, then kills it."""
    log_path = tmp_path / "stuck.log"
    script = ("import faulthandler, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "faulthandler.register(signal.SIGUSR2, all_threads=True)\n"
              "print('ready', flush=True)\n"
              "def stuck_here():\n    time.sleep(60)\n"
              "stuck_here()\n")  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while "ready" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert aggproc.stop(proc, grace=0.2) == -signal.SIGKILL
    assert "in stuck_here" in log_path.read_text()


@pytest.mark.parametrize(
    ("mtu", "result", "keyed", "k"),
    [(1500, "nc8", False, 1456), (1500, "int", False, 182), (1500, "nc8", True, 1448),
     (9000, "nc8", False, 8956), (9216, "nc8", False, 9172)],
)  # fmt: skip
def test_k_defaults_to_the_largest_that_fits_the_mtu(
    tmp_path: Path, mtu: int, result: str, keyed: bool, k: int
) -> None:
    extra = ["--mtu", str(mtu)]
    if keyed:
        (tmp_path / "job.key").write_text(bytes(range(16)).hex())
        extra += ["--key-file", str(tmp_path / "job.key")]
    agg = launch_aggregator("socket", tmp_path, job=JOB, workers=2, k=None, result=result,
                            extra=extra)  # fmt: skip
    try:
        wait_ready(agg)
        assert f"k={k}," in agg.log()
        if mtu != 9000:
            return
        # A jumbo chunk goes through the C engine (loopback's MTU is 65536).
        workers = [Worker(agg.address) for _ in range(2)]
        codes = bytes(i % 60 + 1 for i in range(k))
        for rank, worker in enumerate(workers):
            worker.send(uplink(job=JOB, rank=rank, slot=0, offset=0, codes=codes,
                               emin=window_e_min(2)))  # fmt: skip
        for worker in workers:
            fields, payload = dissect(worker.receive())
            # Two equal powers of two add up to the next one: code c + 1, exactly.
            assert fields["count"] == k and payload == bytes(c + 1 for c in codes)
            worker.close()
    finally:
        assert agg.stop() == 0, agg.log()


def test_jobs_dir_on_bmv2_is_refused_in_one_line(tmp_path: Path) -> None:
    """The socket backend takes --jobs-dir (tests/test_jobs.py); BMv2's control plane cannot
    add jobs at run time, and says so before it starts anything."""
    argv = [sys.executable, "-m", "ncina.cli", "aggregator", "--backend", "bmv2", "--listen",
            "127.0.0.1:0", "--job", "1", "--workers", "2", "--k", "8", "--result", "nc8",
            "--iface", "none", "--jobs-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "--jobs-dir is not available on bmv2" in proc.stderr


WORKERS = 4
ELEMENTS = 100_000


def allreduce_through(address: tuple[str, int], k: int, calls: int) -> list[list[np.ndarray]]:
    """``calls`` all-reduces (sum) of per-rank powers of two by one AllreduceClient per rank,
    each in its own thread; returns the results, per rank, per call."""
    inputs = [powers_of_two(ELEMENTS, seed=rank) for rank in range(WORKERS)]

    def worker(rank: int) -> list[np.ndarray]:
        with AllreduceClient(address, job=JOB, rank=rank, workers=WORKERS, k=k,
                             result_format="int", seed=rank, deadline=60.0) as client:  # fmt: skip
            return [client.allreduce(inputs[rank], op="sum") for _ in range(calls)]

    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(worker, range(WORKERS)))


def exact_sum() -> np.ndarray:
    """The exact element-wise sum of the workers' inputs (powers of two: float64 is exact)."""
    inputs = [powers_of_two(ELEMENTS, seed=rank) for rank in range(WORKERS)]
    return np.sum(np.stack(inputs).astype(np.float64), axis=0).astype(np.float32)


@contextmanager
def lossy_loopback(port: int, probability: float) -> Iterator[None]:
    """Drop datagrams to and from UDP ``port`` on arrival with ``probability`` (iptables INPUT
    rules, removed afterwards; the senders see no error)."""
    rules = [["INPUT", "-i", "lo", "-p", "udp", direction, str(port), "-m", "statistic",
              "--mode", "random", "--probability", str(probability), "-m", "comment",
              "--comment", f"ncina-test-{os.getpid()}", "-j", "DROP"]
             for direction in ("--dport", "--sport")]  # fmt: skip
    added = []
    try:
        for rule in rules:
            subprocess.run(["iptables", "-w", "-I", *rule], check=True, capture_output=True)
            added.append(rule)
        yield
    finally:
        for rule in added:
            subprocess.run(["iptables", "-w", "-D", *rule], check=False, capture_output=True)


@pytest.mark.parametrize("loss", [0.0, 0.05], ids=["lossless", "loss5pct"])
def test_allreduce_clients_get_exact_sums(tmp_path: Path, loss: float) -> None:
    if loss and (os.geteuid() != 0 or shutil.which("iptables") is None):
        pytest.skip("emulated loss needs root and iptables")
    k = 181  # the largest int K at MTU 1500
    agg = start_aggregator("socket", tmp_path, job=JOB, workers=WORKERS, k=k, result="int",
                           extra=["--seed", "2"])  # fmt: skip
    try:
        if loss:
            with lossy_loopback(agg.address[1], loss):
                results = allreduce_through(agg.address, k, calls=2)
        else:
            results = allreduce_through(agg.address, k, calls=2)
        stats = agg.stats()
    finally:
        assert agg.stop() == 0, agg.log()
    exact = exact_sum()
    for per_call in results:
        for got in per_call:
            np.testing.assert_array_equal(got, exact)
    job = stats["jobs"][str(JOB)]
    chunks = -(-ELEMENTS // k)
    assert job["slots_completed"] == 2 * chunks + 1  # +1: the agreement
    assert job["contributions"] == (2 * chunks + 1) * WORKERS
    if loss:  # lost results came back on retransmission
        assert job["retx_seen"] > 0 and job["results_resent"] > 0
    else:  # nothing dropped; a loaded machine's spurious retransmissions are each answered
        assert not any(job["drops"].values())
        assert job["results_resent"] + job["duplicates"] <= job["retx_seen"]
