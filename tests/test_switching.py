"""What the P4 switch only switches leaves it byte for byte as it came, on both BMv2 programs:
the default p4/ and the Tofino program's twin p4/twin/ (whose switching, parser and egress
are the TNA program's, docs/tofino.md "The v1model twin").

Both parsers take any UDP datagram's first bytes as an ncina header and its lanes (a parser
cannot tell the aggregator's address, a table entry), so a datagram between two hosts that
looks like a chunk or a job handshake is parsed as one. Switched at L2, it must still leave
unchanged: no header the parser made valid for the aggregator (the dense layout's int32 result
headers), no recomputed IPv4 checksum. The switch here has two ports, the tests' bridge (host
A: a raw socket on the bridge's end of the veth) and a veth to host B (a raw socket on its other
end), and host B's MAC address as an L2 entry; every frame goes from A to B, to B's MAC (its
port) or to an unknown one (flooded), and B must receive exactly the frame A sent. Needs root.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
from ncina.aggregator.backends.dpdk import netns
from ncina.proto import corpus
from ncina.proto import descriptor as desc
from ncina.proto.header import Format
from ncina_testlib import TWIN, uplink, window_e_min, worker_host

from ncina.harness.aggregators import RunningAggregator, start_aggregator

pytestmark = pytest.mark.timeout(120)

JOB = 3
K = 4
A_MAC = "02:fd:33:00:00:0a"
UNKNOWN_MAC = "02:fd:33:00:00:0b"
ETH_P_ALL = 0x0003


def frames(star: netns.Star, aggregator: tuple[str, int], b_mac: str) -> dict[str, bytes]:
    """The frames from host A to host B, by name: NC8 chunks of at most K lanes and a job
    handshake, to another port and to the aggregator's port at B's address, and odd ones."""
    emin = window_e_min(2)
    chunk = uplink(job=JOB, rank=0, slot=0, offset=0, codes=[1, 0x85, 9, 0], emin=emin)
    short = uplink(job=JOB, rank=1, slot=1, offset=K, codes=[2, 0x83], emin=emin)
    hello = desc.pack_job_datagram(
        desc.Descriptor(mode=int(Format.INT), workers=2, pool_size=16, k=K, e_max=10,
                        e_min=emin, keyed=False, compressor=0), job=JOB, rank=0)  # fmt: skip
    a_ip, b_ip = (str(star.subnet.network_address + n) for n in (200, 201))
    port = aggregator[1]
    cases = {
        "chunk to another port": (b_mac, port + 1, chunk, {}),
        "chunk to the aggregator's port": (b_mac, port, chunk, {}),
        "chunk flooded": (UNKNOWN_MAC, port, chunk, {}),
        "shorter chunk, bytes after its codes": (b_mac, port, short + b"after", {}),
        "count beyond the datagram": (b_mac, port, chunk[:-2], {}),
        "shorter than an ncina header": (b_mac, port, chunk[:10], {}),
        "job handshake": (b_mac, port, hello, {}),
        "job handshake flooded": (UNKNOWN_MAC, port, hello, {}),
        "wrong IPv4 checksum": (b_mac, port, chunk, {"ip_checksum": "bad"}),
    }
    out = {}
    for i, (name, (dst_mac, dst_port, datagram, transport)) in enumerate(cases.items()):
        (out[name],) = corpus.frames(corpus.Step(0, datagram, transport), src_mac=A_MAC,
                                     dst_mac=dst_mac, src=(a_ip, 47000), dst=(b_ip, dst_port),
                                     ip_id=i + 1)  # fmt: skip
    return out


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def two_port_switch(backend: str, workdir: Path) -> tuple[RunningAggregator, netns.Site, str]:
    """An aggregator of ``backend`` (bmv2 or the twin) on a switch of two ports: port 1 a site
    of the tests' bridge, port 2 a veth whose other end (returned, host B) is in this
    namespace, without an address."""
    worker_host(backend)  # skips without root or the P4 toolchain
    site = netns.shared_star().add_site()
    host_b, port_b = f"{site.peer}b", f"{site.iface}b"
    _ip("link", "add", host_b, "type", "veth", "peer", "name", port_b)
    try:
        _ip("link", "set", port_b, "netns", site.ns)
        _ip("-n", site.ns, "link", "set", port_b, "up")
        Path(f"/proc/sys/net/ipv6/conf/{host_b}/disable_ipv6").write_text("1")  # no chatter
        _ip("link", "set", host_b, "up")
        b_mac = Path(f"/sys/class/net/{host_b}/address").read_text().strip()

        def command(_: str, arguments: list[str]) -> list[str]:
            profile = ["--profile", "tofino"] if backend == TWIN else []
            argv = site.aggregator_command([*arguments, *profile, "--l2-host", f"{b_mac}=2"],
                                           "bmv2")  # fmt: skip
            argv[argv.index("--iface") + 1] += f",{port_b}"
            return argv

        agg = start_aggregator("bmv2", workdir, job=JOB, workers=2, k=K, result="int",
                               command=command)  # fmt: skip
    except BaseException:
        subprocess.run(["ip", "link", "del", host_b], capture_output=True, check=False)
        raise
    return agg, site, host_b


@pytest.mark.parametrize("backend", ["bmv2", TWIN])
def test_a_frame_between_two_hosts_leaves_as_it_came(backend: str, tmp_path: Path) -> None:
    agg, site, host_b = two_port_switch(backend, tmp_path)
    a = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    b = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        a.bind((site.peer, 0))
        b.bind((host_b, ETH_P_ALL))
        b.settimeout(5.0)
        b_mac = Path(f"/sys/class/net/{host_b}/address").read_text().strip()
        a_mac = bytes.fromhex(A_MAC.replace(":", ""))
        sent = frames(netns.shared_star(), agg.address, b_mac)
        got: dict[str, bool | str] = {}
        for name, frame in sent.items():
            a.send(frame)
            got[name] = "nothing"
            while True:  # the first frame from A that B receives (A sends one at a time)
                try:
                    data, (_, _, kind, *_) = b.recvfrom(0xFFFF)
                except TimeoutError:
                    break
                if kind != socket.PACKET_OUTGOING and data[6:12] == a_mac:
                    got[name] = data == frame or data.hex()
                    break
        assert got == dict.fromkeys(sent, True)
    finally:
        a.close()
        b.close()
        subprocess.run(["ip", "link", "del", host_b], capture_output=True, check=False)
        assert agg.stop() == 0, agg.log()
