"""The job handshake (docs/protocol.md, "Job handshake") on the Python, socket and DPDK backends.

A worker whose job differs from the aggregator's in any parameter fails its first call with
``JobMismatchError`` naming the parameter and both values, before anything of the tensor is
sent (and so long before the call's deadline, which every client here sets to an hour: the
handshake, not a timeout, must end the call). The aggregator's answers are checked byte for
byte against ``ncina.proto.descriptor``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ncina.proto import descriptor as desc
from ncina.proto.compressors import create
from ncina.proto.header import Format, pack
from ncina.worker.client import AllreduceClient
from ncina_testlib import Worker, source_address, start_aggregator

from ncina.harness.aggregators import LOCAL_BACKENDS, RunningAggregator

JOB = 7
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
GENERATION = 5
HOUR = 3600.0
RESTART_IDLE = 0.3  # seconds a job must be quiet before a new set of workers restarts it
# The aggregator's job: 2 workers, k 64, pool 16, window e_max 10, nc8 results.
JOB_OPTIONS = dict(job=JOB, workers=2, k=64, pool_size=16, window_max=10, result_format="nc8")

MISMATCHES = [
    ({"pool_size": 8}, "pool size: worker 8, aggregator 16"),
    ({"k": 32}, "k (elements per packet): worker 32, aggregator 64"),
    ({"result_format": "int"}, "result format: worker int, aggregator nc8"),
    # an int32 job's window is narrower (its e_min higher): only the format is named
    ({"result_format": "int32"}, "result format: worker int32, aggregator nc8"),
    ({"window_max": 12}, "window e_max: worker 12, aggregator 10"),
    ({"workers": 4}, "workers: worker 4, aggregator 2"),
    ({"key": KEY}, "key: worker keyed, aggregator no key"),
    ({"mode": "server", "compressor": "topk:ratio=0.5"},
     "mode: worker server, aggregator ina (nc8 results)"),
    ({"pool_size": 8, "k": 32, "window_max": 11},
     "pool size: worker 8, aggregator 16; k (elements per packet): worker 32, aggregator 64; "
     "window e_max: worker 11, aggregator 10"),
]  # fmt: skip


def _start(backend: str, workdir: Path, extra: tuple[str, ...] = ()) -> RunningAggregator:
    return start_aggregator(
        backend, workdir, job=JOB, workers=2, k=64, result="nc8",
        extra=["--pool-size", "16", "--window-max", "10", "--generation", str(GENERATION),
               "--restart-idle", str(RESTART_IDLE), *extra],
    )  # fmt: skip


@pytest.fixture(scope="module", params=["python", "socket", "dpdk", "bmv2"])
def aggregator(
    request: pytest.FixtureRequest, tmp_path_factory: Any
) -> Iterator[RunningAggregator]:
    """One aggregator per backend for the module (the dpdk one skips without root or DPDK, the
    bmv2 one without root or the P4 toolchain)."""
    agg = _start(request.param, tmp_path_factory.mktemp(f"handshake-{request.param}"))
    try:
        yield agg
    finally:
        agg.stop()


def _client(address: tuple[str, int], **options: Any) -> AllreduceClient:
    settings: dict[str, Any] = dict(JOB_OPTIONS, rank=0, deadline=HOUR, seed=1,
                                    bind=(source_address(address), 0))  # fmt: skip
    settings.update(options)
    return AllreduceClient(address, **settings)


def _mismatch(address: tuple[str, int], **options: Any) -> tuple[str, dict[str, float]]:
    """The message of the JobMismatchError the first call of a client with ``options`` raises,
    and the client's counters after it."""
    with _client(address, **options) as client:
        with pytest.raises(desc.JobMismatchError) as error:
            client.allreduce(np.ones(200, dtype=np.float32))
        return str(error.value), client.stats


@pytest.mark.parametrize(("options", "message"), MISMATCHES)
def test_a_mismatch_fails_the_first_call_naming_the_parameter_and_both_values(
    aggregator: RunningAggregator, options: dict[str, Any], message: str
) -> None:
    before = aggregator.stats()["jobs"][str(JOB)]
    text, stats = _mismatch(aggregator.address, **options)
    host, port = aggregator.address
    assert text == f"{message} (job {JOB} at {host}:{port})"
    assert stats["packets_sent"] == 0 and stats["handshakes"] >= 1
    after = aggregator.stats()["jobs"][str(JOB)]
    assert after["contributions"] == before["contributions"]
    assert after["handshakes"] - before["handshakes"] == stats["handshakes"]


def test_a_job_the_aggregator_does_not_have_is_named(aggregator: RunningAggregator) -> None:
    text, stats = _mismatch(aggregator.address, job=JOB + 1, handshake_timeout=0.3)
    host, port = aggregator.address
    assert text == f"job id: worker {JOB + 1}, aggregator has no such job (job {JOB + 1} at " \
        f"{host}:{port})"
    assert stats["packets_sent"] == 0


def _reduce(clients: list[AllreduceClient], x: np.ndarray) -> list[np.ndarray]:
    """Every client's all-reduce of ``x``, run at once (one thread each); raises what a call
    raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(clients)) as pool:
        calls = [pool.submit(client.allreduce, x) for client in clients]
        return [call.result() for call in calls]


def test_matching_workers_reduce_and_learn_the_generation(aggregator: RunningAggregator) -> None:
    x = np.ldexp(1.0, np.arange(-20, 8)).astype(np.float32)
    clients = [_client(aggregator.address, rank=r) for r in range(2)]
    try:
        out = _reduce(clients, x)
        assert [c.generation for c in clients] == [GENERATION, GENERATION]
    finally:
        for c in clients:
            c.close()
    for result in out:
        np.testing.assert_array_equal(result, x)


def test_a_new_set_of_workers_on_an_idle_job_starts_afresh(aggregator: RunningAggregator) -> None:
    """Workers that start again count their offsets from 0, which the slot rules take for late
    packets of the last set's rounds; the hellos of the new set find the job idle and quiet for
    --restart-idle and restart its slots, so every set gets its sums (without the restart the
    second set timed out)."""
    x = np.ldexp(1.0, np.arange(-20, 80) % 28 - 20).astype(np.float32)  # 2 chunks of 64
    for _ in range(3):
        time.sleep(RESTART_IDLE + 0.1)  # the last set (or test) is done: the job is quiet
        clients = [_client(aggregator.address, rank=r, deadline=10.0) for r in range(2)]
        try:
            out = _reduce(clients, x)
        finally:
            for c in clients:
                c.close()
        for result in out:
            np.testing.assert_array_equal(result, x)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_a_hello_to_a_job_in_use_restarts_nothing(backend: str, tmp_path: Path) -> None:
    """A job whose last slot completed less than --restart-idle ago is in use (between two
    training steps, or a rank still asks for a lost result): a stranger's hellos from another
    host are answered but restart nothing, so its ranks stay the first set's (issue 27,
    finding 4: a stranger's hello restarted an idle job and took a rank over). A new client on
    the rank's own host starts a new set at once (issue 38, case 8: test_reinit.py). A second
    host needs a loopback aggregator: the C engine's check of the host is test_engine.py's,
    offline (DPDK runs the same engine); p4/'s is admission.p4's same_host."""
    agg = _start(backend, tmp_path / "agg", ("--restart-idle", "3600"))
    x = np.ldexp(1.0, np.arange(-20, 80) % 28 - 20).astype(np.float32)
    try:
        first = [_client(agg.address, rank=r, deadline=10.0) for r in range(2)]
        try:
            _reduce(first, x)
        finally:
            for c in first:
                c.close()
        before = agg.stats()["jobs"][str(JOB)]
        with _client(agg.address, rank=0, deadline=1.0, bind=("127.0.0.2", 0)) as stranger, \
                pytest.raises(TimeoutError):  # fmt: skip
            stranger.allreduce(x)
        after = agg.stats()["jobs"][str(JOB)]
    finally:
        agg.stop()
    assert after["handshakes"] > before["handshakes"]  # its hellos were answered
    assert after["drops"]["non_member"] > before["drops"]["non_member"]  # rank 0 is not its
    assert after["contributions"] == before["contributions"]


def _hello(**fields: Any) -> bytes:
    mine = desc.Descriptor(mode=0, workers=2, pool_size=16, k=64, e_max=10, e_min=-51,
                           keyed=False, compressor=0)  # fmt: skip
    return desc.pack_job_datagram(mine, job=fields.pop("job", JOB), rank=1, **fields)


def test_answers_are_the_descriptors_byte_for_byte(aggregator: RunningAggregator) -> None:
    worker = Worker(aggregator.address, timeout=5.0)
    try:
        worker.send(_hello())
        theirs = desc.Descriptor(mode=0, workers=2, pool_size=16, k=64, e_max=10, e_min=-51,
                                 keyed=False, compressor=0)  # fmt: skip
        assert worker.receive() == desc.pack_job_datagram(
            theirs, job=JOB, rank=1, answer=True, generation=GENERATION
        )
        worker.send(_hello(job=99))
        assert worker.receive() == desc.pack_job_datagram(
            desc.NOWHERE, job=99, rank=1, status=desc.NO_SUCH_JOB, answer=True,
            generation=GENERATION,
        )
        worker.send(_hello(key=KEY))  # a tag for an unkeyed job
        assert worker.receive() == desc.pack_job_datagram(
            theirs, job=JOB, rank=1, status=desc.NOT_AUTHENTIC, answer=True,
            generation=GENERATION,
        )
        before = aggregator.stats()
        worker.send(_hello()[:-1])  # short
        worker.send(_hello()[:1] + b"\x01" + _hello()[2:])  # RESULT set by a worker
        worker.send(_hello(job=99) + b"\x00")  # long, no such job
        worker.send(pack(job=JOB, rank=1, slot=0, offset=0, count=1, emin=-51,
                         fmt=Format.JOB, payload=bytes(desc.DESCRIPTOR_SIZE)))  # well-formed
        # Answered (status 0, the job's descriptor): everything before it was handled.
        answer = worker.receive()
        assert answer[2] == Format.JOB and answer[16] == desc.OK
        after = aggregator.stats()
        job_before, job_after = before["jobs"][str(JOB)], after["jobs"][str(JOB)]
        assert job_after["drops"]["bad_length"] - job_before["drops"]["bad_length"] == 1
        assert job_after["drops"]["bad_flags"] - job_before["drops"]["bad_flags"] == 1
        drops = after["global"]["drops"]["bad_length"] - before["global"]["drops"]["bad_length"]
        assert drops == 1
    finally:
        worker.close()


@pytest.mark.parametrize("backend", ["python", "socket", "dpdk"])
def test_keyed_jobs_verify_the_hello_and_tag_the_answer(backend: str, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY.hex())
    agg = _start(backend, tmp_path / "agg", ("--key-file", str(key_file)))
    try:
        host, port = agg.address
        text, _ = _mismatch(agg.address, key=OTHER_KEY)
        assert text == ("key: worker keyed, aggregator keyed with another key (the worker's "
                        f"tag does not verify) (job {JOB} at {host}:{port})")  # fmt: skip
        text, _ = _mismatch(agg.address)
        assert text == f"key: worker no key, aggregator keyed (job {JOB} at {host}:{port})"
        text, _ = _mismatch(agg.address, key=KEY, pool_size=4)
        assert text == f"pool size: worker 4, aggregator 16 (job {JOB} at {host}:{port})"
        worker = Worker(agg.address, timeout=5.0)
        try:
            worker.send(_hello(key=KEY))
            theirs = desc.Descriptor(mode=0, workers=2, pool_size=16, k=64, e_max=10, e_min=-51,
                                     keyed=True, compressor=0)  # fmt: skip
            assert worker.receive() == desc.pack_job_datagram(
                theirs, job=JOB, rank=1, answer=True, generation=GENERATION, key=KEY
            )
        finally:
            worker.close()
    finally:
        agg.stop()


def test_server_mode_compares_the_compressor_with_the_jobs_window(tmp_path: Path) -> None:
    agg = start_aggregator(
        "python", tmp_path, job=JOB, workers=2, k=64, result=None,
        extra=["--pool-size", "16", "--mode", "server", "--compressor", "nc"],
    )  # fmt: skip
    try:
        host, port = agg.address
        server = dict(mode="server", handshake_timeout=2.0)
        ours = desc.compressor_hash(create("natdither", workers=2, e_max=10))
        theirs = desc.compressor_hash(create("nc", workers=2, e_max=10))
        text, _ = _mismatch(agg.address, compressor="natdither", **server)
        assert text == (f"compressor: worker natdither (hash 0x{ours:08x}), aggregator hash "
                        f"0x{theirs:08x} (job {JOB} at {host}:{port})")  # fmt: skip
        # "nc" is the job's window on both sides (workers 2, e_max 10), whatever its defaults.
        with _client(agg.address, rank=0, compressor="nc", **server) as client:
            client._path.handshake()
            assert client.generation != 0
    finally:
        agg.stop()


def test_a_compressor_window_other_than_the_jobs_is_refused() -> None:
    with pytest.raises(ValueError, match=r"compressor nc: workers=4 in the spec, but the job's "
                       r"workers is 2"):  # fmt: skip
        create("nc:workers=4", workers=2, e_max=10)
    assert create("nc", workers=2, e_max=12) == create("nc:workers=2,e_max=12")


def test_silence_fails_the_handshake_within_its_timeout() -> None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        host, port = silent.getsockname()
        with _client((host, port), handshake_timeout=0.3) as client:
            with pytest.raises(TimeoutError) as error:
                client.allreduce(np.ones(10, dtype=np.float32))
            assert str(error.value).startswith(
                f"no answer to the job handshake from aggregator {host}:{port} within 0.3 s "
                f"(job {JOB}, rank 0)"
            )
            assert client.stats["packets_sent"] == 0 and client.stats["handshakes"] >= 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"workers": 65}, "workers must be in 1..64"),
        ({"k": 9173}, "k (elements per packet) must be in 1..9172"),
        ({"pool_size": 0}, "pool size must be in 1..65535"),
        ({"job": 65536}, "job id must be in 0..65535"),
        ({"rank": 2}, "rank must be in 0..1"),
    ],
)
def test_the_client_takes_the_aggregators_limits(options: dict[str, Any], message: str) -> None:
    """The client validates with JobConfig's validator (``descriptor.check_job``)."""
    from ncina.aggregator.jobs import JobConfig

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _client(("127.0.0.1", 9), **options)
    if "rank" not in options:
        config = dict(job=JOB, workers=2, k=64, pool_size=16, result_format="nc8")
        config.update(options)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            JobConfig.create(**config)  # type: ignore[arg-type]
