"""Compile small C extensions with cffi (API mode), cached and process-safe.

``make venv`` (and so ``make setup``, ``make test`` and ``make topo``) runs ``python -m
ncina.common.cbuild``, which builds every extension of the package (``EXTENSIONS``) once, at
install time. Without it (a plain ``pip install``), or when its extension's sources changed
since, a process builds the extension on first use, saying so in one line on stderr (a first
call takes seconds and should not look hung).

Several worker processes of one job start at the same moment and all want the same extension, so
the build is keyed by a hash of everything that affects the binary (sources, declarations, flags,
Python ABI, cffi version) and serialised by an ``fcntl`` lock; the finished shared object is moved
into place atomically, so a reader never sees a half-written file. The cache lives in
``$NCINA_CACHE`` or ``~/.cache/ncina``, one directory ``<name>-<hash>`` per build; a build
happens in a temporary folder there, and cffi changes the process's working directory to it
meanwhile (build before starting threads that rely on the working directory).

Flags are portable (``-O3``, no ``-march=native``): the cache may be shared between machines of
different CPU types.

``NCINA_SANITIZE=address,undefined`` (any ``-fsanitize=`` list) builds every extension with those
sanitizers instead, as separate cache entries; the process must then start with the ASan runtime
preloaded (``sanitizer_environment`` gives the variables; ``tests/test_sanitizers.py`` runs the C
code's tests that way).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import cffi

# Every C extension of the package: (what it is, "module:function" that builds or loads it,
# "module:function" returning why it cannot be built on this machine, or None).
EXTENSIONS: tuple[tuple[str, str, str | None], ...] = (
    ("NC8 codec", "ncina.proto.nc8:_build_c", None),
    ("worker data path", "ncina.worker.cpath:load", None),
    ("socket data plane", "ncina.aggregator.backends.socket.binding:load", None),
    ("DPDK data plane", "ncina.aggregator.backends.dpdk.binding:load",
     "ncina.aggregator.backends.dpdk.binding:missing"),
)  # fmt: skip

DEFAULT_COMPILE_ARGS: tuple[str, ...] = ("-O3", "-std=c11", "-Wall", "-Wextra")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
SANITIZE_ENV = "NCINA_SANITIZE"


def _sanitizer_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) that ``NCINA_SANITIZE`` asks for; empty without it. Every
    finding aborts (no recovery), so a test run cannot pass over one."""
    wanted = os.environ.get(SANITIZE_ENV, "").strip()
    if not wanted:
        return [], []
    if not re.fullmatch(r"[a-z]+(,[a-z]+)*", wanted):
        raise RuntimeError(f"{SANITIZE_ENV}={wanted!r} is not a list like address,undefined")
    sanitize = f"-fsanitize={wanted}"
    return [sanitize, "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"], [sanitize]


def sanitizer_environment(sanitizers: str = "address,undefined") -> dict[str, str]:
    """Environment variables under which a new Python process runs every extension with
    ``sanitizers``: the ASan runtime preloaded (it must come first; Python itself is not
    instrumented), leak checks off (the interpreter keeps memory until exit), aborts on errors."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[0]
    runtime = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    if not Path(runtime).is_file():
        raise RuntimeError(f"{cc} has no AddressSanitizer runtime (libasan); install gcc")
    return {
        SANITIZE_ENV: sanitizers,
        "LD_PRELOAD": runtime,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:detect_odr_violation=0",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }


def cache_root() -> Path:
    """The directory builds are cached in: ``$NCINA_CACHE`` or ``~/.cache/ncina``."""
    env = os.environ.get("NCINA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ncina"


def _pkg_config(package: str) -> tuple[list[str], list[str]]:
    """Return (compile flags, link flags) of a pkg-config package, or explain what is missing."""
    exe = shutil.which("pkg-config")
    if exe is None:
        raise RuntimeError(f"pkg-config is not installed; it is needed to find {package}")
    flags = []
    for what in ("--cflags", "--libs"):
        proc = subprocess.run([exe, what, package], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            detail = proc.stderr.strip() or f"pkg-config {what} {package} failed"
            raise RuntimeError(f"{package} development files not found: {detail}")
        flags.append(shlex.split(proc.stdout))
    return flags[0], flags[1]


def _check_toolchain() -> None:
    """Raise a RuntimeError naming the missing compiler or Python headers."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[0]
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler found ({cc!r}, from $CC or Python's build); install gcc")
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise RuntimeError(
            f"Python headers not found ({include / 'Python.h'}); install python3-dev"
        )


def _digest(parts: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def build_extension(
    name: str,
    cdef: str,
    sources: Sequence[Path],
    *,
    preamble: str | None = None,
    extra_compile_args: Sequence[str] = DEFAULT_COMPILE_ARGS,
    libraries: Sequence[str] = (),
    include_dirs: Sequence[Path] = (),
    depends: Sequence[Path] = (),
    pkg_config: str | None = None,
) -> ModuleType:
    """Build (or reuse) the cffi extension ``name`` and return its module (``.ffi``, ``.lib``).

    ``cdef`` declares what Python sees; ``preamble`` is the C text the generated wrapper starts
    with and must declare the same functions (default: ``<stdint.h>``, ``<stddef.h>`` and the
    ``cdef`` itself, which suffices when it holds plain prototypes). ``sources`` are compiled
    and linked into the module; their folders are on the include path, and ``depends`` (headers)
    only enter the cache key. ``pkg_config`` names a package whose flags are added (for example
    ``"libdpdk"``). Raises ``RuntimeError`` naming what is missing when the build fails.
    """
    if not _NAME.match(name):
        raise ValueError(f"extension name {name!r} is not a C identifier")
    sources = [Path(s).resolve() for s in sources]
    if preamble is None:
        preamble = "#include <stdint.h>\n#include <stddef.h>\n" + cdef
    san_cflags, ldflags = _sanitizer_flags()
    cflags = [*extra_compile_args, *san_cflags]
    if pkg_config is not None:
        pc_cflags, pc_libs = _pkg_config(pkg_config)
        cflags += pc_cflags
        ldflags += pc_libs
    includes = list(dict.fromkeys([*map(str, include_dirs), *(str(s.parent) for s in sources)]))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"

    key = _digest(
        [
            cdef.encode(),
            preamble.encode(),
            *(s.read_bytes() for s in [*sources, *map(Path, depends)]),
            "\0".join([*cflags, *ldflags, *libraries, *includes]).encode(),
            f"{suffix} {sys.implementation.cache_tag} {platform.machine()}".encode(),
            f"cffi {cffi.__version__}".encode(),
        ]
    )
    module_name = f"_{name}_{key}"
    build_dir = cache_root() / f"{name}-{key}"
    target = build_dir / (module_name + suffix)

    if not target.exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not target.exists():  # another process may have built it meanwhile
                print(f"ncina: compiling C extension {name} (once; cached in {build_dir})",
                      file=sys.stderr, flush=True)  # fmt: skip
                ffi = cffi.FFI()
                ffi.cdef(cdef)
                ffi.set_source(
                    module_name,
                    preamble,
                    sources=[str(s) for s in sources],
                    include_dirs=includes,
                    extra_compile_args=cflags,
                    extra_link_args=ldflags,
                    libraries=list(libraries),
                )
                _compile(ffi, build_dir, target)
    return _import(module_name, target)


def _compile(ffi: cffi.FFI, build_dir: Path, target: Path) -> None:
    """Compile in a private temporary folder, then move the result into place atomically."""
    _check_toolchain()
    with tempfile.TemporaryDirectory(dir=build_dir, prefix="tmp-") as tmp:
        try:
            built = ffi.compile(tmpdir=tmp, verbose=False)
        except Exception as exc:  # cffi wraps compiler and linker failures in several types
            raise RuntimeError(
                f"building C extension {target.name} failed (compiler messages above): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        os.replace(built, target)


def _import(module_name: str, target: Path) -> ModuleType:
    """Import a built extension from its file (it is not on ``sys.path``)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, target)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import C extension {target}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module


def _resolve(target: str) -> Any:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def build_all() -> int:
    """Build every extension of ``EXTENSIONS`` now; print one line each. Returns 1 when one
    that this machine can build failed, else 0 (one it cannot build is reported and skipped)."""
    failed = 0
    for what, build, missing in EXTENSIONS:
        reason = _resolve(missing)() if missing else None
        if reason:
            print(f"ncina cbuild: {what}: skipped ({reason})")
            continue
        try:
            _resolve(build)()
        except RuntimeError as exc:
            print(f"ncina cbuild: {what}: FAILED: {exc}", file=sys.stderr)
            failed = 1
            continue
        print(f"ncina cbuild: {what}: ready")
    return failed


if __name__ == "__main__":
    sys.exit(build_all())
