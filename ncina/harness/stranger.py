"""A stranger on the fabric (``python -m ncina.harness.stranger``, run by ``ncina soak`` in its
stranger host): one round of hostile datagrams at a keyed job's aggregator.

Three kinds, all of which the aggregator must count (docs/reliability.md, "Soak"):

- fuzzed datagrams from the stranger's own address: ``ncina.harness.fuzzing.hostile_datagrams``
  (mutated packets, random headers, scapy's ``fuzz()``, raw and truncated bytes): one counted drop
  each;
- unkeyed hellos: ``job`` datagrams of the job without a tag, from the stranger's address: each
  answered with a ``NOT_AUTHENTIC`` handshake answer and counted as a handshake;
- spoofed retransmissions: a member's chunk with ``RETX`` and a tag that is not the key's, sent
  from the member's own address (a raw socket writes the IPv4 header): one ``bad_tag`` drop each;
- forged results: results with a tag that is not the key's, sent to a worker's socket from the
  aggregator's address: each one ignored and counted (``bad_tag``) by the worker.

It prints one JSON line: how many of each it sent.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import time
from collections.abc import Callable

from ncina.common.address import peer_address
from ncina.harness.fuzzing import BURST, PAUSE, hostile_datagrams
from ncina.proto.descriptor import JOB_DATAGRAM_SIZE
from ncina.proto.header import FLAG_RESULT, FLAG_RETX, FLAG_TAG, HEADER, VERSION, Format, pack
from ncina.proto.job import JobSpec
from ncina.proto.wire import TAG_SIZE

IPV4 = struct.Struct("!BBHHHBBH4s4s")
UDP = struct.Struct("!HHHH")


def udp_frame(source: tuple[str, int], destination: tuple[str, int], payload: bytes) -> bytes:
    """An IPv4 packet of a UDP datagram (IP checksum and id filled by the kernel, UDP checksum
    0: none, as IPv4 allows)."""
    udp = UDP.pack(source[1], destination[1], UDP.size + len(payload), 0) + payload
    ip = IPV4.pack(0x45, 0, IPV4.size + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                   socket.inet_aton(source[0]), socket.inet_aton(destination[0]))  # fmt: skip
    return ip + udp


def paced(send: Callable[[bytes], None]) -> Callable[[bytes], None]:
    """``send`` with a short pause every ``BURST`` datagrams (no socket buffer overflows)."""
    sent = [0]

    def send_paced(datagram: bytes) -> None:
        send(datagram)
        sent[0] += 1
        if sent[0] % BURST == 0:
            time.sleep(PAUSE)

    return send_paced


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ncina.harness.stranger", description=__doc__)
    p.add_argument("--aggregator", type=peer_address, required=True, help="IP:PORT")
    p.add_argument("--member", action="append", default=[], type=peer_address,
                   help="IP:PORT of rank r's socket, in rank order (spoofed and forged to)")
    JobSpec.add_arguments(p, "job", "k", "pool_size", required=("job", "k", "pool_size"))
    p.add_argument("--emin", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fuzz", type=int, default=0, help="fuzzed datagrams")
    p.add_argument("--hellos", type=int, default=0, help="unkeyed hellos")
    p.add_argument("--spoofed", type=int, default=0, help="spoofed retransmissions")
    p.add_argument("--forged", type=int, default=0, help="forged results (to the members)")
    args = p.parse_args(argv)
    rnd = random.Random(args.seed)
    workers = max(1, len(args.member))
    own = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    sent = {"fuzzed": 0, "hellos": 0, "spoofed": 0, "forged": 0}
    try:
        to_aggregator = paced(lambda d: own.sendto(d, args.aggregator))
        for datagram in hostile_datagrams(args.fuzz, seed=args.seed, job=args.job,
                                          workers=workers, k=args.k, emin=args.emin,
                                          pool_size=args.pool_size):  # fmt: skip
            to_aggregator(datagram)
            sent["fuzzed"] += 1
        hello_body = JOB_DATAGRAM_SIZE - HEADER.size
        for _ in range(args.hellos):
            rank = rnd.randrange(workers)
            header = HEADER.pack(VERSION, 0, Format.JOB, args.emin, args.job, rank, 0, 1, 0)
            to_aggregator(header + rnd.randbytes(hello_body))
            sent["hellos"] += 1
        raw_send = paced(lambda frame: raw.sendto(frame, (args.aggregator[0], 0)))
        for _ in range(args.spoofed if args.member else 0):
            rank = rnd.randrange(workers)
            slot = rnd.randrange(args.pool_size)
            datagram = pack(job=args.job, rank=rank, slot=slot, offset=slot * args.k,
                            count=args.k, emin=args.emin, flags=FLAG_RETX | FLAG_TAG,
                            payload=rnd.randbytes(args.k)) + rnd.randbytes(TAG_SIZE)  # fmt: skip
            raw_send(udp_frame(args.member[rank], args.aggregator, datagram))
            sent["spoofed"] += 1
        forge_send = paced(lambda frame: raw.sendto(frame, (frame_destination(frame), 0)))
        for i in range(args.forged if args.member else 0):
            rank = i % workers  # as many to every rank (the last ones aside)
            slot = rnd.randrange(args.pool_size)
            datagram = pack(job=args.job, rank=rank, slot=slot, offset=slot * args.k,
                            count=args.k, emin=args.emin, flags=FLAG_RESULT | FLAG_TAG,
                            payload=rnd.randbytes(args.k)) + rnd.randbytes(TAG_SIZE)  # fmt: skip
            forge_send(udp_frame(args.aggregator, args.member[rank], datagram))
            sent["forged"] += 1
    finally:
        own.close()
        raw.close()
    print(json.dumps(sent), flush=True)
    return 0


def frame_destination(frame: bytes) -> str:
    """The destination address of an IPv4 packet."""
    return socket.inet_ntoa(frame[16:20])


if __name__ == "__main__":
    raise SystemExit(main())
