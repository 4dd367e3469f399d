"""``HOST:PORT``: the one parser of an address, on every command line and in the environment.

HOST is an IPv4 address or a name resolved to one (the protocol runs over IPv4); PORT is a
decimal number. An address to bind may have port 0 (the system picks one); an address to send
to may not. Every violation has one message, fit for a command line.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket

Address = tuple[str, int]
"""An IPv4 UDP endpoint as ``socket.recvfrom`` reports it: ``(dotted quad, port)``."""


def parse_address(text: str, *, port_zero: bool = True) -> Address:
    """``HOST:PORT`` to an ``Address``, HOST resolved to IPv4. ``port_zero``: whether port 0 is
    allowed (an address to bind); without it the port must be in 1..65535 (an address to send to).

    Raises ``ValueError`` with a message fit for a command line.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{text!r}: port {port_text!r} is not a number") from None
    lowest = 0 if port_zero else 1
    if not lowest <= port <= 0xFFFF:
        raise ValueError(f"{text!r}: port {port} is not in {lowest}..65535")
    try:
        return str(ipaddress.IPv4Address(host)), port
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ValueError(f"{text!r}: cannot resolve {host!r} to an IPv4 address ({exc})") from None
    return infos[0][4][0], port


def bind_address(text: str) -> Address:
    """argparse type of an address to bind (``HOST:PORT``, port 0: the system picks one)."""
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def peer_address(text: str) -> Address:
    """argparse type of an address to send to (``HOST:PORT``, port 1..65535)."""
    try:
        return parse_address(text, port_zero=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
