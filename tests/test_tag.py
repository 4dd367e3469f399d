"""The authentication tag (docs/protocol.md, "Authentication tag"): keys, sign/verify, parsing."""

from __future__ import annotations

import hashlib

import pytest
from ncina.aggregator.jobs import JobConfig
from ncina.proto import tag
from ncina.proto.header import FLAG_TAG, HEADER_SIZE, TAG_SIZE, pack, parse

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
