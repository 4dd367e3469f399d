"""Build (on first use) and load the socket data plane as a cffi extension.

The extension is the socket I/O layer (``loop.c``) around the shared slot engine
(``ncina.aggregator.engine``); its cdef is ``engine.h`` and ``ncs.h``. It needs only a C
compiler and the Python headers.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOURCES = ("loop.c",)


@cache
def load() -> ModuleType:
    """Build (cached in ``~/.cache/ncina``) and import the data plane; returns the module.

    Raises ``RuntimeError`` naming what is missing when the compiler or headers are.
    """
    from ncina.aggregator.engine import build

    return build("ncina_socket", HERE, SOURCES, "ncs.h")
