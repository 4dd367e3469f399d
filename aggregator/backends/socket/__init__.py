"""The socket backend: the C slot engine behind one kernel UDP socket (batched ``recvmmsg`` and
``sendmmsg``), bound with cffi; no root, no DPDK.

``ncina.aggregator.backends.socket.binding`` builds and loads the extension;
``ncina.aggregator.backends.socket.driver`` opens the socket, installs jobs, runs the loop in a
thread and writes the stats JSON. See docs/socket.md.
"""
