"""Mininet topologies and the topology runner (imported as ``ncina.topo``, never as ``mininet``)."""
