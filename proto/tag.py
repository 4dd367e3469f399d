"""The optional per-job authentication tag (docs/protocol.md, "Authentication tag").

A job configured with a shared secret key requires every datagram of the job, both ways, to set
the ``TAG`` flag and to end in an 8-byte tag: keyed BLAKE2b (RFC 7693) with an 8-byte digest over
every byte before the tag (the 16-byte header, ``TAG`` flag included, and the payload). Python's
``hashlib.blake2b`` is the reference; the C code (data planes, worker fast path) uses
``blake2b.c`` beside this file, and the tests check that the two agree.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
from pathlib import Path

from ncina.proto.wire import TAG_SIZE

__all__ = ["TAG_SIZE", "check_key", "compute", "key_file_argument", "key_from_hex",
           "read_key_file", "sign", "verify"]

MIN_KEY_SIZE = 16  # 128 bits: shorter keys are refused, not padded
MAX_KEY_SIZE = 64  # BLAKE2b's own limit


def check_key(key: bytes) -> bytes:
    """Return ``key`` if its length is usable, else raise ``ValueError``."""
    if not MIN_KEY_SIZE <= len(key) <= MAX_KEY_SIZE:
        raise ValueError(
            f"a job key has {MIN_KEY_SIZE} to {MAX_KEY_SIZE} bytes "
            f"({2 * MIN_KEY_SIZE} to {2 * MAX_KEY_SIZE} hex digits), not {len(key)}"
        )
    return key


def key_from_hex(text: str) -> bytes:
    """A key from its hexadecimal text (whitespace around it ignored); ``ValueError`` if bad."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError("a job key is written as hexadecimal digits") from None
    return check_key(key)


def read_key_file(path: str | Path) -> bytes:
    """The key held (as hex) in ``path``; ``ValueError`` naming the file if it is unusable."""
    try:
        return key_from_hex(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"key file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"key file {path}: {exc}") from None


def key_file_argument(text: str) -> bytes:
    """An argparse ``type`` for ``--key-file FILE`` options: the key in that file."""
    try:
        return read_key_file(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def compute(key: bytes, message: bytes | bytearray | memoryview) -> bytes:
    """The tag of ``message`` (the datagram's bytes before the tag)."""
    return hashlib.blake2b(message, digest_size=TAG_SIZE, key=key).digest()


def sign(key: bytes, message: bytes | bytearray | memoryview) -> bytes:
    """``message`` followed by its tag; its header must already have the ``TAG`` flag set."""
    return bytes(message) + compute(key, message)


def verify(key: bytes, datagram: bytes | bytearray | memoryview) -> bool:
    """Whether the last ``TAG_SIZE`` bytes of ``datagram`` are the tag of the bytes before them
    (compared in constant time)."""
    view = memoryview(datagram)
    if len(view) < TAG_SIZE:
        return False
    return hmac.compare_digest(compute(key, view[:-TAG_SIZE]), view[-TAG_SIZE:])
