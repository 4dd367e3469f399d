"""ncina: in-network aggregation emulator with natural compression.

Subpackages (each one folder, and one layer: docs/architecture.md, "Folders and layers"):

- ``ncina.common``: the ground floor every layer may import (C build, progress, options,
  ``HOST:PORT``, CPU time).
- ``ncina.proto``: the wire format, the NC8 codec, scapy layers, the fast packer.
- ``ncina.worker``: the worker side: chunking, slot window, retransmission, training.
- ``ncina.aggregator``: aggregator backends behind one contract.
- ``ncina.harness``: what drives the system from outside, for benchmarks and tests.
- ``ncina.topo`` (folder ``mininet/``): Mininet topologies and the topology runner.
- ``ncina.bench``: the benchmarks.
"""

__version__ = "0.1.0"
