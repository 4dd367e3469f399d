"""The authentication tag (docs/protocol.md, "Authentication tag"): keys, sign/verify, parsing."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from ncina.aggregator.backends.python.pipeline import Aggregator
from ncina.aggregator.jobs import JobConfig
from ncina.proto import tag
from ncina.proto.header import FLAG_RETX, FLAG_TAG, HEADER, INT_DTYPE, NOTICE, Header, pack, parse
from ncina.proto.wire import HEADER_SIZE, TAG_SIZE
from ncina.worker.client import AllreduceClient
from ncina_testlib import TAGGED_BACKENDS, Worker, start_aggregator, uplink, worker_host

from ncina.harness.reference import powers_of_two

pytestmark = pytest.mark.timeout(120)

KEY = bytes(range(16))


def tagged(payload: bytes = b"\x01\x02\x03", **fields: int) -> bytes:
    header = {"job": 7, "rank": 1, "slot": 2, "offset": 96, "count": len(payload), "emin": -50}
    header.update(fields)
    return tag.sign(KEY, pack(**header, flags=FLAG_TAG, payload=payload))


def test_tag_is_keyed_blake2b_with_an_8_byte_digest_over_everything_before_it() -> None:
    datagram = tagged()
    body = datagram[:-TAG_SIZE]
    assert len(datagram) == HEADER_SIZE + 3 + TAG_SIZE
    # outlen 8 in BLAKE2b's parameter block: not the first 8 bytes of a 64-byte digest.
    assert datagram[-TAG_SIZE:] == hashlib.blake2b(body, digest_size=8, key=KEY).digest()
    assert datagram[-TAG_SIZE:] != hashlib.blake2b(body, key=KEY).digest()[:8]
    # A fixed vector, so that an implementation in another language can be checked by eye.
    assert tag.compute(KEY, b"").hex() == hashlib.blake2b(b"", digest_size=8, key=KEY).hexdigest()


def test_verify_accepts_the_signed_datagram_and_rejects_any_change() -> None:
    datagram = tagged()
    assert tag.verify(KEY, datagram)
    for i in range(len(datagram)):  # one flipped bit anywhere: header, payload or tag
        changed = bytearray(datagram)
        changed[i] ^= 0x10
        assert not tag.verify(KEY, changed), i
    assert not tag.verify(bytes(16), datagram)  # another key
    assert not tag.verify(KEY, datagram[:-1])
    assert not tag.verify(KEY, b"")


def test_parse_returns_the_payload_without_the_tag() -> None:
    header, payload = parse(tagged(b"\x05\x06"))
    assert header.is_tagged and bytes(payload) == b"\x05\x06"


@pytest.mark.parametrize("text,error", [
    ("00" * 15, "16 to 64 bytes"),
    ("00" * 65, "16 to 64 bytes"),
    ("zz" * 16, "hexadecimal"),
])
def test_unusable_keys_are_refused_with_a_reason(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        tag.key_from_hex(text)
    with pytest.raises(ValueError, match=error):
        JobConfig.create(job=1, workers=2, k=8, result_format="int", key=text)


def test_key_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "job.key"
    path.write_text(KEY.hex() + "\n")
    assert tag.read_key_file(path) == KEY
    with pytest.raises(ValueError, match=r"missing\.key"):
        tag.read_key_file(tmp_path / "missing.key")


def test_a_keyed_job_says_so_without_showing_its_key() -> None:
    config = JobConfig.create(job=1, workers=2, k=8, result_format="int", key=KEY.hex())
    assert config.key == KEY
    assert config.describe().endswith(", tagged")
    assert KEY.hex() not in repr(config)
    # The tag is part of every result frame: the MTU check counts it.
    untagged = JobConfig.create(job=1, workers=2, k=8, result_format="int")
    assert config.result_frame_size == untagged.result_frame_size + TAG_SIZE


# --- a keyed job in the aggregator's logic, without sockets --------------------------------------


def keyed_aggregator(generation: int = 3) -> tuple[Aggregator, int]:
    agg = Aggregator(generation)
    config = JobConfig.create(job=7, workers=2, k=4, result_format="int", pool_size=4, key=KEY)
    agg.add_job(config)
    return agg, config.window.e_min


def uplink_packet(
    emin: int, rank: int, key: bytes | None = KEY, *, slot: int = 1, offset: int = 4, flags: int = 0
) -> bytes:
    """Rank ``rank``'s chunk of codes (2, -2, 1, 0), tagged with ``key`` (None: untagged)."""
    flags |= FLAG_TAG if key is not None else 0
    datagram = uplink(job=7, rank=rank, slot=slot, offset=offset, codes=[2, 0x82, 1, 0],
                      emin=emin, flags=flags)  # fmt: skip
    return datagram if key is None else tag.sign(key, datagram)


def peer(rank: int) -> tuple[str, int]:
    return ("10.0.0.1", 6000 + rank)


def test_keyed_job_drops_every_unauthenticated_packet_before_it_changes_anything() -> None:
    agg, emin = keyed_aggregator()
    good = uplink_packet(emin, 0)
    forged = [
        uplink_packet(emin, 0, key=None),  # no tag at all
        uplink_packet(emin, 0, key=bytes(16)),  # another key
        good[:-1] + bytes([good[-1] ^ 1]),  # a changed tag
        good[:20] + bytes([good[20] ^ 1]) + good[21:],  # a changed payload
    ]
    for datagram in forged:  # from rank 1's address: had it been believed, rank 0 is taken
        assert agg.handle(datagram, peer(1)) == ()
    stats = agg.jobs[7].stats.to_json()
    assert stats["drops"]["bad_tag"] == len(forged) and stats["packets_in"] == len(forged)
    assert stats["bytes_in"] == sum(len(d) for d in forged)
    assert stats["contributions"] == 0 and agg.jobs[7].members == [None, None]
    # The genuine packets still make a complete slot, and its results are tagged.
    assert agg.handle(good, peer(0)) == ()
    out = agg.handle(uplink_packet(emin, 1), peer(1))
    assert [to for _, to in out] == [peer(0), peer(1)]
    for rank, (datagram, _) in enumerate(out):
        header, payload = parse(datagram)
        assert header.flags & FLAG_TAG and header.rank == rank and tag.verify(KEY, datagram)
        assert np.frombuffer(payload, dtype=INT_DTYPE).tolist() == [4, -4, 2, 0]


def test_keyed_job_tags_its_notices() -> None:
    agg, emin = keyed_aggregator(generation=3)
    assert agg.handle(uplink_packet(emin, 0), peer(0)) == ()
    (notice, to), = agg.handle(uplink_packet(emin, 0, flags=FLAG_RETX), peer(0))
    assert to == peer(0) and len(notice) == HEADER_SIZE + NOTICE.size + TAG_SIZE
    header = Header._make(HEADER.unpack_from(notice))  # count 0: not a datagram parse accepts
    assert header.count == 0 and header.is_tagged and header.generation == 3
    assert tag.verify(KEY, notice)
    assert NOTICE.unpack_from(notice, HEADER_SIZE)[0] == 0b01


# --- a keyed job end to end: the aggregator process and real clients ----------------------------


@pytest.mark.parametrize("backend", TAGGED_BACKENDS)
def test_keyed_job_end_to_end(backend: str, tmp_path: Path) -> None:
    workers, k, elements = 3, 64, 20_000
    key_file = tmp_path / "job.key"
    key_file.write_text(KEY.hex())
    agg = start_aggregator(backend, tmp_path, job=7, workers=workers, k=k, result="int",
                           extra=["--key-file", str(key_file)])  # fmt: skip
    host = worker_host(backend)
    try:
        emin = JobConfig.create(job=7, workers=workers, k=k, result_format="int").window.e_min
        forger = Worker(agg.address)
        try:  # a rank's place taken by a packet with a wrong tag would stall rank 0 below
            forger.send(uplink_packet(emin, 0, key=bytes(16), slot=0, offset=0))
            forger.send(uplink_packet(emin, 0, key=None, slot=0, offset=0))
        finally:
            forger.close()
        with (
            AllreduceClient(agg.address, job=7, rank=0, workers=workers, k=k,
                            result_format="int", bind=(host, 0), deadline=0.5,
                            handshake_timeout=None) as stranger,
            pytest.raises(TimeoutError),  # no key: not one of its packets is accepted
        ):
            stranger.allreduce(np.ones(100, dtype=np.float32))
        inputs = [powers_of_two(elements, seed=r) for r in range(workers)]

        def run(rank: int) -> np.ndarray:
            with AllreduceClient(agg.address, job=7, rank=rank, workers=workers, k=k,
                                 result_format="int", bind=(host, 0), key=KEY,
                                 seed=rank) as client:  # fmt: skip
                return client.allreduce(inputs[rank], op="sum")

        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(run, range(workers)))
        exact = np.sum(np.stack(inputs).astype(np.float64), axis=0)
        for result in results:
            np.testing.assert_array_equal(result, exact.astype(np.float32))
        job = agg.stats()["jobs"]["7"]
        assert job["drops"]["bad_tag"] >= 3 and job["drops"]["non_member"] == 0
        assert job["slots_completed"] == -(-elements // k) + 1  # +1: the agreement
    finally:
        assert agg.stop() == 0, agg.log()
