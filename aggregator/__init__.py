"""Aggregator backends behind one contract (Python reference; DPDK and BMv2 to come)."""
