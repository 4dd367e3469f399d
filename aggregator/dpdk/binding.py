"""Build (on first use) and load the C data plane as a cffi extension linked against libdpdk.

The cdef is the declarations of ``ncd.h``; the sources are this folder's C files plus the NC8
kernels and the tag's BLAKE2b of ``ncina.proto`` (``nc8.c``, ``blake2b.c``), compiled through
``ncina.cbuild`` with the flags of ``pkg-config libdpdk``.
"""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
PROTO = HERE.parent.parent / "proto"
SOURCES = ("parse.c", "slots.c", "result.c", "loop.c", "gen.c")
# The wire codecs of ncina.proto the data plane links in: NC8 and the tag's BLAKE2b.
PROTO_SOURCES = ("nc8.c", "blake2b.c")
PROTO_HEADERS = ("nc8.h", "blake2b.h")
HEADERS = ("ncd.h", "ncd_priv.h")
COMPILE_ARGS = ("-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter")


def _proto_dir() -> Path:
    """The folder of the proto C sources (the repository's proto/, or the installed package)."""
    if (PROTO / "nc8.c").is_file():
        return PROTO
    import ncina.proto

    return Path(ncina.proto.__file__).resolve().parent


def cdef() -> str:
    """The declarations of ncd.h that cffi parses (everything but preprocessor lines)."""
    lines = (HERE / "ncd.h").read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def missing() -> str | None:
    """A one-line reason why the extension cannot be built here, or None."""
    if shutil.which("pkg-config") is None:
        return "pkg-config is not installed (apt-get install pkg-config)"
    import subprocess

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
    from ncina.cbuild import build_extension

    proto = _proto_dir()
    return build_extension(
        "ncina_dpdk",
        cdef(),
        [*(HERE / s for s in SOURCES), *(proto / s for s in PROTO_SOURCES)],
        preamble='#include "ncd.h"\n',
        extra_compile_args=COMPILE_ARGS,
        include_dirs=[HERE, proto],
        depends=[*(HERE / h for h in HEADERS), *(proto / h for h in PROTO_HEADERS)],
        pkg_config="libdpdk",
    )
