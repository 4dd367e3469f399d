"""The ground floor: helpers every layer may import, which import no other layer of ncina.

- ``cbuild``: the C extensions, compiled with cffi, cached and process-safe;
- ``progress``: progress bars on stderr, on a terminal only;
- ``options``: command-line helpers every command shares (``deprecated_alias``);
- ``address``: ``HOST:PORT`` parsed, the one parser of every command and environment variable;
- ``cpu``: CPU-seconds of processes and the kernel's softirq time, from ``/proc``.

docs/architecture.md draws the layers above it; tests/test_imports.py keeps them so.
"""
