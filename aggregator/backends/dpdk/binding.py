"""Build (on first use) and load the C data plane as a cffi extension linked against libdpdk.

The extension is the DPDK I/O layer (this folder's C files: frame classification, frame
headers, the burst loop, the benchmark load) around the shared slot engine
(``ncina.aggregator.engine``); its cdef is ``engine.h`` and ``ncd.h``, compiled through
``ncina.common.cbuild`` with the flags of ``pkg-config libdpdk``.
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOURCES = ("classify.c", "frames.c", "loop.c", "gen.c")


def missing() -> str | None:
    """A one-line reason why the extension cannot be built here, or None."""
    if shutil.which("pkg-config") is None:
        return "pkg-config is not installed (apt-get install pkg-config)"
    proc = subprocess.run(
        ["pkg-config", "--exists", "libdpdk"], capture_output=True, check=False
    )
    if proc.returncode != 0:
        return "DPDK development files not found (apt-get install dpdk libdpdk-dev)"
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "no C compiler (apt-get install gcc)"
    return None


@cache
def load() -> ModuleType:
    """Build (cached in ``~/.cache/ncina``) and import the data plane; returns the module.

    Raises ``RuntimeError`` with the package to install when DPDK or the compiler is missing.
    """
    reason = missing()
    if reason is not None:
        raise RuntimeError(f"the dpdk backend cannot be built: {reason}")
    from ncina.aggregator.engine import build

    return build("ncina_dpdk", HERE, SOURCES, "ncd.h", ("ncd_priv.h",), pkg_config="libdpdk")
