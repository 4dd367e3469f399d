"""The worker side of server mode against a real ``ncina aggregator --mode server`` process.

Every worker's ``AllreduceClient(compressor=SPEC, mode="server")`` result must be what the
protocol says, computed here without the network: each worker compresses each chunk of each
tensor once with its own state (random stream shared by the client, error-feedback memory per
chunk), the server averages the decompressed payloads in float32 and compresses the mean with
its own per-chunk state (seeded by ``--seed``, offset and length), and every worker decompresses
that. Only the float32 order of the server's sum (arrival order) can differ from the reference,
so results are compared to within float32 rounding, and all ranks must get identical bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from ncina.proto.compressors import State, create
from ncina.proto.compressors.base import largest_fitting
from ncina.proto.wire import IPV4_UDP_HEADERS
from ncina.worker.client import AllreduceClient
from ncina_testlib import assert_sent_once_plus_retransmissions, start_aggregator

from ncina.harness.training import METHODS, mode_of

JOB = 4
WORKERS = 3
K = 256
SERVER_SEED = 1
KEY = bytes(range(32))
# (tensor name, elements, op): two tensors, each twice (error feedback carries over), then a sum.
CALLS: list[tuple[Hashable, int, str]] = [
    ("a", 1000, "mean"), ("b", 300, "mean"), ("a", 1000, "mean"), ("b", 300, "mean"),
    ("c", 77, "sum"),
]  # fmt: skip


def inputs() -> list[list[np.ndarray]]:
    """Per call, every rank's tensor (fixed seed)."""
    rng = np.random.default_rng(11)
    return [[rng.standard_normal(n).astype(np.float32) for _ in range(WORKERS)]
            for _, n, _ in CALLS]  # fmt: skip


def reference(spec: str, xs: list[list[np.ndarray]], chunk: int) -> list[np.ndarray]:
    """The protocol's result of every call, as every worker must see it (see the module doc)."""
    comp = create(spec)
    rngs = [np.random.default_rng(rank) for rank in range(WORKERS)]  # the clients' seeds
    worker_states: list[dict[int, State]] = [{} for _ in range(WORKERS)]
    server_states: dict[tuple[int, int], State] = {}
    ranges: dict[tuple[Hashable, int], int] = {}
    results = []
    for (name, n, op), per_rank in zip(CALLS, xs, strict=True):
        if (name, n) not in ranges:
            ranges[name, n] = sum(size for _, size in ranges)
        base = ranges[name, n]
        starts = range(0, n, chunk)
        payloads = [
            [comp.compress(x[s : s + chunk],
                           worker_states[r].setdefault(base + s, State(rng=rngs[r])))
             for s in starts]
            for r, x in enumerate(per_rank)
        ]  # fmt: skip
        out = np.empty(n, dtype=np.float32)
        for j, s in enumerate(starts):
            count = min(chunk, n - s)
            total = comp.decompress(payloads[0][j])
            for r in range(1, WORKERS):
                total += comp.decompress(payloads[r][j])
            key = (base + s, count)
            if key not in server_states:
                server_states[key] = State(rng=np.random.default_rng((SERVER_SEED, *key)))
            mean = total / np.float32(WORKERS)
            out[s : s + count] = comp.decompress(comp.compress(mean, server_states[key]))
        results.append(out * np.float32(WORKERS) if op == "sum" else out)
    return results


def run_workers(
    address: tuple[str, int], spec: str, xs: list[list[np.ndarray]], **options: object
) -> tuple[list[list[np.ndarray]], list[dict[str, float]], int]:
    """Every rank in its own thread makes ``CALLS``; returns results per rank, stats, chunk."""
    clients = [
        AllreduceClient(address, job=JOB, rank=r, workers=WORKERS, k=K, seed=r, compressor=spec,
                        mode="server", deadline=20.0, **options)  # type: ignore[arg-type]
        for r in range(WORKERS)
    ]  # fmt: skip
    results: list[list[np.ndarray]] = [[] for _ in range(WORKERS)]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            for (name, _, op), per_rank in zip(CALLS, xs, strict=True):
                results[rank].append(clients[rank].allreduce(per_rank[rank], op, name))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(WORKERS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in clients:
            c.close()
    assert not errors, errors
    return results, [c.stats for c in clients], clients[0].chunk


@pytest.mark.parametrize(
    ("spec", "options", "faults"),
    [
        ("ef+topk:ratio=0.1", {}, []),
        ("3lc", {}, []),  # error feedback by default
        ("terngrad", {}, []),  # random on both sides
        ("qsgd:s=8,bucket=64", {}, []),
        ("topk:ratio=1", {"mtu": 600}, []),  # chunks cut below K to fit the MTU
        # The fixed pattern makes every worker lose its 7th datagram each way (a chunk and a
        # result: each sends 13 chunks and gets 13 results), whatever the random loss does.
        ("ef+topk:ratio=0.1", {}, ["--drop-up", "0.15", "--drop-down", "0.15",
                                   "--drop-every", "7"]),
        ("ef+topk:ratio=0.1", {"key": KEY}, []),  # tagged both ways
    ],
    ids=["ef+topk", "3lc", "terngrad", "qsgd", "topk-mtu600", "ef+topk-lossy", "ef+topk-keyed"],
)
def test_results_are_the_protocols_compressed_mean(
    tmp_path: Path, spec: str, options: dict[str, object], faults: list[str]
) -> None:
    xs = inputs()
    keyed = []
    if "key" in options:
        (tmp_path / "key").write_text(KEY.hex() + "\n")
        keyed = ["--key-file", str(tmp_path / "key")]
    aggregator = start_aggregator(
        "python", tmp_path, job=JOB, workers=WORKERS, k=K, result=None,
        extra=["--mode", "server", "--compressor", spec, "--seed", str(SERVER_SEED),
               "--fault-seed", "3", *faults, *keyed],
    )  # fmt: skip
    try:
        results, stats, chunk = run_workers(aggregator.address, spec, xs, **options)
        job = aggregator.stats()["jobs"][str(JOB)]
    except BaseException:
        print(aggregator.log())
        raise
    finally:
        assert aggregator.stop() == 0, aggregator.log()
    expected = reference(spec, xs, chunk)
    chunks = sum(-(-n // chunk) for _, n, _ in CALLS)
    assert job["slots_completed"] == chunks
    assert job["contributions"] == WORKERS * chunks  # each chunk of each rank added once
    assert job["drops"]["bad_payload"] == 0
    for rank in range(WORKERS):
        for got, mine, want in zip(results[0], results[rank], expected, strict=True):
            assert np.array_equal(got, mine)  # one stored result for everyone
            scale = float(np.abs(want).max())
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    if "mtu" in options:
        assert chunk < K
    if faults:  # the losses were repaired, and the result is the same as without them
        assert sum(s["retransmissions"] for s in stats) > 0
        assert job["results_resent"] > 0 and job["retx_seen"] > 0
    else:  # each chunk sent once, plus what a timer outrun by a busy scheduler re-sent
        for s in stats:
            assert_sent_once_plus_retransmissions(s, chunks)


def test_server_mode_compresses_the_mean_not_the_sum(tmp_path: Path) -> None:
    """Sanity on the semantics, independent of the reference: with top-k keeping everything
    (exact float payloads) the result is the mean of the inputs to float32 rounding."""
    spec = "topk:ratio=1"
    xs = inputs()
    aggregator = start_aggregator(
        "python", tmp_path, job=JOB, workers=WORKERS, k=K, result=None,
        extra=["--mode", "server", "--compressor", spec],
    )  # fmt: skip
    try:
        results, _, _ = run_workers(aggregator.address, spec, xs)
    finally:
        assert aggregator.stop() == 0
    for (_, _, op), per_rank, got in zip(CALLS, xs, results[1], strict=True):
        want = np.sum(per_rank, axis=0) / (1 if op == "sum" else WORKERS)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", [None, bytes(range(16))])
def test_chunks_are_the_largest_whose_payload_fits_the_mtu(key: bytes | None) -> None:
    comp = create("topk:ratio=1")
    with AllreduceClient(("127.0.0.1", 9), job=1, rank=0, workers=2, k=1024, key=key,
                         compressor="topk:ratio=1", mode="server", mtu=600) as client:  # fmt: skip
        room = 600 - IPV4_UDP_HEADERS - 16 - (8 if key else 0)
        assert comp.max_payload_size(client.chunk) <= room < comp.max_payload_size(client.chunk + 1)
        assert client.chunk == largest_fitting(comp, room, 1024)


def test_ina_mode_refuses_methods_a_switch_cannot_add() -> None:
    with pytest.raises(ValueError, match=r"topk payloads cannot be summed .*: use --mode server"):
        AllreduceClient(("127.0.0.1", 9), job=1, rank=0, workers=2, compressor="topk")


def test_ina_mode_sends_an_ina_methods_values_as_nc8_codes(tmp_path: Path) -> None:
    """Natural dithering in INA mode through an INA aggregator with exact (int) results: the
    mean is exactly the average of every worker's dithered values (powers of two of the
    window, which NC8 carries without rounding)."""
    spec = "natdither:s=8,workers=3"
    xs = [np.random.default_rng(20 + r).standard_normal(700).astype(np.float32)
          for r in range(WORKERS)]  # fmt: skip
    k = 128  # int results: 8 bytes per element
    aggregator = start_aggregator("python", tmp_path, job=JOB, workers=WORKERS, k=k,
                                  result="int")  # fmt: skip
    clients = [AllreduceClient(aggregator.address, job=JOB, rank=r, workers=WORKERS, k=k,
                               result_format="int", seed=r, compressor=spec)
               for r in range(WORKERS)]  # fmt: skip
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            results = list(pool.map(lambda r: clients[r].allreduce(xs[r], tensor="w"),
                                    range(WORKERS)))  # fmt: skip
    finally:
        for c in clients:
            c.close()
        assert aggregator.stop() == 0
    comp = create(spec)
    dithered = [comp.decompress(comp.compress(x, State(rng=np.random.default_rng(r))))
                for r, x in enumerate(xs)]  # fmt: skip
    assert all(np.all(np.abs(d[d != 0]) == 2.0 ** np.round(np.log2(np.abs(d[d != 0]))))
               for d in dithered)  # fmt: skip
    expected = (np.sum(dithered, axis=0, dtype=np.float64) / WORKERS).astype(np.float32)
    for got in results:
        np.testing.assert_array_equal(got, expected)


def test_bench_training_runs_each_method_in_its_mode() -> None:
    """``ncina bench training`` (the docs' training table): INA for NC8 and the integer-summable
    methods, server mode for every other one, and every default spec is valid."""
    modes = {spec: mode_of(spec) for spec in METHODS}
    assert [s for s, m in modes.items() if m == "ina"] == ["nc8", "natdither:s=8"]
    assert len(modes) == len(METHODS) == 14
