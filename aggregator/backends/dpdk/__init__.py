"""The DPDK backend: a C data plane (burst loop over DPDK's ``net_af_packet``) bound with cffi.

``ncina.aggregator.backends.dpdk.binding`` builds and loads the extension;
``ncina.aggregator.backends.dpdk.driver`` starts EAL, installs jobs, runs the loop in a thread and
writes the stats JSON. See docs/dpdk.md.
"""
