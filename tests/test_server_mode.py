"""Server mode in the aggregator's logic, without sockets: BLOB contributions averaged in float,
the mean re-compressed (with server-side error feedback when the compressor has it), the stored
result re-sent on retransmission, malformed blobs dropped, and DoubleSqueeze's convergence."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.backends.python.slots import ServerSlots
from ncina.aggregator.jobs import JobConfig
from ncina.proto.compressors import State, create
from ncina.proto.header import BAD_LENGTH, ProtocolError, flags_for, pack, parse
from ncina_testlib import aggregator_command, dissect, start_aggregator

JOB = 3
K = 32


def address(rank: int) -> tuple[str, int]:
    return (f"10.0.0.{rank + 1}", 6000 + rank)


def server(workers: int, spec: str, *, pool_size: int = 4) -> tuple[Aggregator, ServerSlots]:
    config = JobConfig.create(
        job=JOB, workers=workers, k=K, result_format="nc8", pool_size=pool_size, seed=5
    )
    aggregator = Aggregator()
    slots = aggregator.add_job(config, create(spec))
    assert isinstance(slots, ServerSlots)
    return aggregator, slots


def blob(
    slots: ServerSlots, rank: int, payload: bytes, *, slot: int, offset: int, count: int,
    pool: int = 0, retx: bool = False,
) -> bytes:  # fmt: skip
    return pack(
        job=JOB, rank=rank, slot=slot, offset=offset, count=count,
        emin=slots.config.window.e_min, flags=flags_for(pool, retx=retx), fmt=2, payload=payload,
    )  # fmt: skip


def test_blob_parse_rule() -> None:
    """A blob's length is its own business; only an empty one is malformed."""
    hdr, payload = parse(pack(job=1, rank=0, slot=0, offset=0, count=100, emin=0, fmt=2,
                              payload=b"\x01\x02"))  # fmt: skip
    assert (hdr.format, hdr.count, bytes(payload)) == (2, 100, b"\x01\x02")
    with pytest.raises(ProtocolError) as exc:
        parse(pack(job=1, rank=0, slot=0, offset=0, count=100, emin=0, fmt=2))
    assert exc.value.reason == BAD_LENGTH


def test_mean_is_recompressed_and_stored_result_resent() -> None:
    """Three workers' top-k payloads: the result is top-k of their float mean, sent to all; a
    retransmission after completion gets the same bytes, a duplicate before it nothing."""
    aggregator, slots = server(3, "topk:ratio=0.25")
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((3, 20)).astype(np.float32)
    compressor = slots.compressor
    payloads = [compressor.compress(x, State()) for x in xs]
    out = aggregator.handle(blob(slots, 0, payloads[0], slot=1, offset=40, count=20), address(0))
    assert out == ()
    dup = blob(slots, 0, payloads[0], slot=1, offset=40, count=20, retx=True)
    assert aggregator.handle(dup, address(0)) == ()
    assert aggregator.handle(blob(slots, 1, payloads[1], slot=1, offset=40, count=20),
                             address(1)) == ()  # fmt: skip
    out = aggregator.handle(blob(slots, 2, payloads[2], slot=1, offset=40, count=20), address(2))
    assert [dest for _, dest in out] == [address(r) for r in range(3)]
    mean = np.mean([compressor.decompress(p) for p in payloads], axis=0, dtype=np.float32)
    expected = compressor.compress(mean, State())
    for datagram, _ in out:
        fields, payload = dissect(datagram)
        assert (fields["format"], fields["count"], fields["offset"], fields["slot"]) == (
            2, 20, 40, 1)  # fmt: skip
        assert payload == expected
    again = aggregator.handle(dup, address(0))
    assert again == [(out[0][0], address(0))]
    stats = slots.stats
    assert (stats.duplicates, stats.results_resent, stats.slots_completed) == (1, 1, 1)


@pytest.mark.parametrize(
    ("payload", "count"), [(b"\xff\x00", 20), (None, 19)], ids=["undecodable", "wrong_count"]
)
def test_malformed_blob_dropped_and_counted(payload: bytes | None, count: int) -> None:
    """A blob that does not decode to exactly ``count`` elements is dropped as ``bad_payload`` and
    leaves the slot untouched; an NC8 packet is the wrong format for a server-mode job."""
    aggregator, slots = server(2, "topk:ratio=0.25")
    good = slots.compressor.compress(np.ones(20, np.float32), State())
    bad = blob(slots, 0, good if payload is None else payload, slot=0, offset=0, count=count)
    assert aggregator.handle(bad, address(0)) == ()
    nc8 = pack(job=JOB, rank=0, slot=0, offset=0, count=1, emin=slots.config.window.e_min,
               payload=b"\x00")  # fmt: skip
    assert aggregator.handle(nc8, address(0)) == ()
    assert slots.stats.drops["bad_payload"] == 1 and slots.stats.drops["bad_format"] == 1
    assert slots.stats.drops["bad_code"] == 0
    assert aggregator.handle(blob(slots, 0, good, slot=0, offset=0, count=20), address(0)) == ()
    assert len(aggregator.handle(blob(slots, 1, good, slot=0, offset=0, count=20),
                                 address(1))) == 2  # fmt: skip


def test_forged_element_count_is_dropped_before_decompressing() -> None:
    """A blob claiming 2**32 - 1 elements for a 20-element chunk is dropped as bad_payload without
    being decompressed (which would allocate gigabytes)."""
    import struct
    import tracemalloc

    aggregator, slots = server(2, "topk:ratio=0.25")
    forged = struct.pack("!BI", create("topk").tag, 2**32 - 1) + bytes(4)
    tracemalloc.start()
    try:
        out = aggregator.handle(blob(slots, 0, forged, slot=0, offset=0, count=20), address(0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out == ()
    assert slots.stats.drops["bad_payload"] == 1
    assert peak < 1 << 20


def test_error_feedback_memory_is_per_chunk_length() -> None:
    """Chunks of different lengths at the same offset (two tensors' last chunks) each complete,
    with their own server-side error-feedback memory."""
    aggregator, slots = server(2, "ef+topk:ratio=0.25")
    plain = create("topk:ratio=0.25")
    for slot, n in enumerate((32, 20)):
        for rank in range(2):
            x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
            payload = plain.compress(x, State(np.random.default_rng(0)))
            out = aggregator.handle(blob(slots, rank, payload, slot=slot, offset=0, count=n),
                                    address(rank))  # fmt: skip
        assert len(out) == 2
        assert plain.decompress(dissect(out[0][0])[1]).size == n
    assert aggregator.stats.drops["internal_error"] == 0


def least_squares_loss(spec: str, *, steps: int = 300, lr: float = 0.1) -> float:
    """Distributed gradient descent on a least-squares problem, 4 workers, every gradient
    exchanged through a server-mode job with compressor ``spec`` on workers and server (one
    compressor state per worker and chunk: worker-side error feedback when ``spec`` has it).
    Returns the final loss over all workers' data minus the optimum's."""
    workers, dim, rows = 4, 64, 48
    rng = np.random.default_rng(42)
    a = rng.standard_normal((workers, rows, dim)).astype(np.float32)
    b = rng.standard_normal((workers, rows)).astype(np.float32)
    aggregator, slots = server(workers, spec, pool_size=2)
    compressor = slots.compressor
    chunks = dim // K
    states = [[State(rng=np.random.default_rng((r, c))) for c in range(chunks)]
              for r in range(workers)]  # fmt: skip
    x = np.zeros(dim, np.float32)
    for step in range(steps):
        grads = [a[r].T @ (a[r] @ x - b[r]) / rows for r in range(workers)]
        update = np.zeros(dim, np.float32)
        for c in range(chunks):
            for r in range(workers):
                payload = compressor.compress(grads[r][c * K : (c + 1) * K], states[r][c])
                datagram = blob(slots, r, payload, slot=c, offset=c * K, count=K, pool=step % 2)
                out = aggregator.handle(datagram, address(r))
            assert len(out) == workers  # the last contribution completes the slot
            update[c * K : (c + 1) * K] = compressor.decompress(dissect(out[0][0])[1])
        x -= lr * update

    def loss(v: np.ndarray) -> float:
        return float(sum(np.sum((a[r] @ v - b[r]) ** 2) for r in range(workers)) / (2 * rows))

    best = np.linalg.lstsq(a.reshape(-1, dim), b.reshape(-1), rcond=None)[0]
    return loss(x) - loss(best.astype(np.float32))


def test_doublesqueeze_converges_where_plain_topk_does_worse() -> None:
    """Top-k (10 %) both ways: with worker- and server-side error feedback (DoubleSqueeze) the
    excess loss after 300 steps is near zero (measured 0.011), without it far from it (0.27)."""
    plain = least_squares_loss("topk:ratio=0.1")
    doublesqueeze = least_squares_loss("ef+topk:ratio=0.1")
    assert doublesqueeze < 0.05
    assert doublesqueeze * 10 < plain


def test_server_mode_end_to_end_on_loopback(tmp_path: Path) -> None:
    """The aggregator process in server mode (``--mode server --compressor ef+topk``): three
    workers' blobs for two chunks come back as top-k of their mean, the same bytes to everyone,
    and a retransmission after completion gets them again; the stats count it all."""
    workers, count = 3, 20
    spec = "ef+topk:ratio=0.25"
    compressor = create(spec)
    config = JobConfig.create(job=JOB, workers=workers, k=K, result_format="nc8")
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(workers)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
        s.settimeout(10)
    aggregator = start_aggregator(
        "python", tmp_path, job=JOB, workers=workers, k=K, result=None,
        extra=["--mode", "server", "--compressor", spec, "--seed", "1"],
    )  # fmt: skip
    try:
        rng = np.random.default_rng(3)
        for chunk in range(2):
            xs = rng.standard_normal((workers, count)).astype(np.float32)
            payloads = [compressor.compress(x, State()) for x in xs]
            for rank, s in enumerate(sockets):
                s.sendto(pack(job=JOB, rank=rank, slot=chunk, offset=chunk * count, count=count,
                              emin=config.window.e_min, fmt=2, payload=payloads[rank]),
                         aggregator.address)  # fmt: skip
            mean = np.mean([compressor.decompress(p) for p in payloads], axis=0, dtype=np.float32)
            expected = compressor.compress(mean, State())  # the server's residual starts at 0
            for s in sockets:
                fields, payload = dissect(s.recv(2048))
                assert (fields["format"], fields["offset"], fields["count"]) == (
                    2, chunk * count, count)  # fmt: skip
                assert payload == expected
        sockets[1].sendto(pack(job=JOB, rank=1, slot=1, offset=count, count=count,
                               emin=config.window.e_min, fmt=2, flags=flags_for(0, retx=True),
                               payload=payloads[1]), aggregator.address)  # fmt: skip
        assert dissect(sockets[1].recv(2048))[1] == expected
        job = aggregator.stats()["jobs"][str(JOB)]
        assert (job["slots_completed"], job["results_resent"], job["contributions"]) == (2, 1, 6)
    finally:
        assert aggregator.stop() == 0
        for s in sockets:
            s.close()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--mode", "server", "--compressor", "topk", "--result", "nc8"],
         "server mode's results are compressor payloads: drop --result"),
        ([], "INA mode needs --result nc8 or --result int"),
        (["--mode", "server", "--compressor", "topk:ratio=1", "--k", "1024"],
         "a topk result of k=1024 elements may take 5387 payload bytes, more than the 1456 a "
         "frame has at MTU 1500; the largest k for topk at this MTU is 281"),
        # 1500 - 20 - 8 - 16 = 1456 bytes; k values of 4 bytes and 10-bit (9-bit up to k = 512)
        # indices after 5 + 4 header bytes, plus 2 of padding: 281 x 41 / 8 + 11 = 1452 fits.
    ],
    ids=["result-in-server-mode", "no-result-in-ina-mode", "server-mtu"],
)  # fmt: skip
def test_server_mode_command_line_errors(arguments: list[str], message: str) -> None:
    argv = ["--listen", "127.0.0.1:0", "--job", "1", "--workers", "2", "--k", "8", *arguments]
    proc = subprocess.run(aggregator_command("python", argv), capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == f"ncina aggregator: error: {message}\n"


def test_error_feedback_memory_is_capped_and_the_overflow_counted() -> None:
    """The residuals are keyed by the packets' offsets: past ``max_residual_elements`` a new
    chunk is compressed with a fresh state that is not kept (the same bytes every time, no
    error feedback), counted; the kept chunks keep theirs, and memory stays at the cap."""
    config = JobConfig.create(job=JOB, workers=1, k=K, result_format="nc8", pool_size=4, seed=5)
    charge = 20 + ServerSlots.STATE_OVERHEAD
    aggregator = Aggregator(max_residual_elements=3 * charge)
    slots = aggregator.add_job(config, create("ef+topk:ratio=0.1"))
    assert isinstance(slots, ServerSlots)
    x = np.random.default_rng(1).standard_normal(20).astype(np.float32)
    payload = create("topk:ratio=0.5").compress(x, State())  # more than the server keeps
    uses = [0] * 4

    def send(offset: int) -> bytes:
        slot = offset % 4
        pool, uses[slot] = uses[slot] % 2, uses[slot] + 1
        out = aggregator.handle(blob(slots, 0, payload, slot=slot, offset=offset, count=20,
                                     pool=pool), address(0))  # fmt: skip
        assert len(out) == 1
        return dissect(out[0][0])[1]

    first = [send(offset) for offset in range(10)]
    assert len(slots._states) == 3 and slots.residual_elements == 3 * charge
    assert aggregator.limits.residuals_unkept == 7
    assert aggregator.limits.to_json() == {"jobs_refused": 0, "residuals_unkept": 7}
    # A kept chunk compresses its mean plus its residual: other bytes than the first time.
    assert send(0) != first[0]
    # A chunk past the cap starts afresh each time: the same bytes, counted again.
    assert send(9) == first[9]
    assert aggregator.limits.residuals_unkept == 8 and len(slots._states) == 3
    assert slots.stats.slots_completed == 12
