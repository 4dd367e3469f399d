"""A ``simple_switch_grpc`` process: started with no program (the control plane pushes it over
P4Runtime), one port per interface, its log in a file, pcaps optional; ready when its gRPC
server accepts connections. Stopped by PID, never by name.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ncina.aggregator.backends.bmv2 import toolchain
from ncina.aggregator.process import tail

READY_TIMEOUT = 30.0


@dataclass
class SwitchConfig:
    """How to run one switch: ``ports`` maps BMv2 port numbers to interface names.

    ``device_id`` and the ports must be unique among switches of one network namespace.
    ``log_path`` gets the switch's output (BMv2's own packet log too with ``verbose``);
    ``pcap_dir``, if set, gets one pcap per port and direction.
    """

    ports: dict[int, str]
    log_path: Path
    device_id: int = 1
    grpc_port: int = 9559
    thrift_port: int = 9090
    pcap_dir: Path | None = None
    verbose: bool = False

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        """The ``simple_switch_grpc`` command line."""
        argv = [toolchain.switch(), "--no-p4", "--device-id", str(self.device_id),
                "--thrift-port", str(self.thrift_port)]  # fmt: skip
        for port, iface in sorted(self.ports.items()):
            argv += ["-i", f"{port}@{iface}"]
        if self.pcap_dir is not None:
            argv += ["--pcap", str(self.pcap_dir)]
        if self.verbose:
            argv += ["--log-console", "--log-level", "debug"]
        return [*argv, "--", "--grpc-server-addr", self.grpc_address]


class Switch:
    """A running ``simple_switch_grpc`` (``start`` returns once its gRPC server listens)."""

    def __init__(self, config: SwitchConfig) -> None:
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = READY_TIMEOUT) -> Switch:
        reason = toolchain.missing(compiler=False, runtime=False)
        if reason:
            raise toolchain.ToolchainError(reason)
        cfg = self.config
        cfg.log_path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.pcap_dir is not None:
            cfg.pcap_dir.mkdir(parents=True, exist_ok=True)
        for iface in cfg.ports.values():
            segmentation_offloads_off(iface)
        with cfg.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                cfg.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while not _accepts(cfg.grpc_port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                status = self.process.poll()
                self.stop()
                what = f"exited with status {status}" if status is not None else (
                    f"did not open its gRPC port {cfg.grpc_port} within {timeout:g} s")
                raise toolchain.ToolchainError(
                    f"{toolchain.switch()} {what} (log {cfg.log_path}):\n{tail(cfg.log_path)}"
                )
            time.sleep(0.05)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; idempotent."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ethtool's ioctl and the commands that set TCP segmentation, generic segmentation and generic
# receive offload (linux/ethtool.h, linux/sockios.h).
SIOCETHTOOL = 0x8946
ETHTOOL_SET = {"tso": 0x1F, "gso": 0x24, "gro": 0x2C}


def segmentation_offloads_off(iface: str) -> None:
    """Switch off the segmentation offloads of ``iface`` (as ``ethtool -K IF tso off gso off
    gro off``), where the driver lets us.

    BMv2 reads a port through libpcap, whose ring (2 MiB) is cut into frames of the largest
    packet the interface may deliver: 64 KiB while an offload may hand it aggregated packets
    (so 32 frames, and a longer burst is lost before the switch sees it), MTU-sized without
    (about 1,300 frames). docs/bmv2.md, "Input loss"."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for cmd in ETHTOOL_SET.values():
            value = array.array("B", struct.pack("II", cmd, 0))
            address, _ = value.buffer_info()
            request = struct.pack("16sP", iface.encode()[:15], address)
            # a driver without it (or a fixed feature): nothing to switch off
            with contextlib.suppress(OSError):
                fcntl.ioctl(s.fileno(), SIOCETHTOOL, request)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (PR_SET_PDEATHSIG), so a killed
    aggregator never leaves its switch running."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
