"""ncina: in-network aggregation emulator with natural compression.

Subpackages (each one folder of the repository):

- ``ncina.proto``: the wire format, the NC8 codec, scapy layers, the fast packer.
- ``ncina.worker``: the worker side: chunking, slot window, retransmission, training.
- ``ncina.aggregator``: aggregator backends behind one contract.
- ``ncina.topo``: Mininet topologies and the topology runner.
"""

__version__ = "0.1.0"
