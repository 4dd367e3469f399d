"""Find the P4 toolchain the user installed and build ``p4/`` with it.

Nothing here ships or builds p4c or BMv2: ``p4c-bm2-ss`` and ``simple_switch_grpc`` are looked up
on ``PATH`` (or named by ``NCINA_P4C`` / ``NCINA_BMV2``), and when one is missing the backend
stops with one sentence naming what to install. A build goes to ``build/p4/k<K>/`` of the source
checkout (``~/.cache/ncina/p4/k<K>/``, or under ``$NCINA_CACHE``, for an installed copy, whose
folder may be read-only): the generated ``config.p4`` and ``lanes.p4``, the BMv2 JSON and the
P4Info; it is redone only when a source or K changed (a digest of the inputs is kept next to the
outputs).

The P4 sources are package data (``ncina.p4``, mapped to ``p4/`` in pyproject.toml): ``p4/`` of
the checkout in an editable install, ``ncina/p4/`` in an installed one. Both sit two folders above
this file, next to ``aggregator/``, so one path finds them; the import system does not (``p4/`` has
no ``__init__.py``: a regular package there would shadow p4runtime's ``p4``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ncina.aggregator.backends.bmv2 import gen
from ncina.aggregator.backends.bmv2.layout import DEFAULT_K
from ncina.aggregator.backends.tofino import gen as gen_tofino
from ncina.aggregator.process import BUILDING
from ncina.proto.job import JobSpec

from ncina.common.cbuild import cache_root
from ncina.common.progress import progress

# The source checkout, or the installed ``ncina`` package folder.
ROOT = Path(__file__).resolve().parents[3]
P4_DIR = ROOT / "p4"
CHECKOUT = (ROOT / "pyproject.toml").is_file()
BUILD_DIR = ROOT / "build" / "p4" if CHECKOUT else cache_root() / "p4"
MAIN = "ncina.p4"
ECHO = "echo/echo.p4"  # the no-op forwarder that the benchmark measures the program against
TWIN = "twin/ncina.p4"  # the v1model twin of the Tofino program p4/tofino/ (docs/tofino.md)
PROFILES = {"default": MAIN, "tofino": TWIN}
"""The program the bmv2 backend runs for a job's ``--profile``: ``p4/`` or the Tofino program's
twin."""

INSTALL_HINT = (
    "install p4lang's p4c (p4c-bm2-ss) and behavioral-model built with PI "
    "(simple_switch_grpc), or point NCINA_P4C / NCINA_BMV2 at them"
)


class ToolchainError(RuntimeError):
    """The P4 toolchain is missing or failed; the message says what to do."""


def p4c() -> str:
    """The P4 compiler for BMv2's v1model (``NCINA_P4C``, default ``p4c-bm2-ss``)."""
    return os.environ.get("NCINA_P4C", "p4c-bm2-ss")


def switch() -> str:
    """The BMv2 switch with a P4Runtime server (``NCINA_BMV2``, default ``simple_switch_grpc``)."""
    return os.environ.get("NCINA_BMV2", "simple_switch_grpc")


def missing(*, compiler: bool = True, target: bool = True, runtime: bool = True) -> str | None:
    """One sentence naming what the BMv2 backend lacks here, or None if nothing."""
    if compiler and shutil.which(p4c()) is None:
        return f"{p4c()} is not installed (the P4 compiler): {INSTALL_HINT}"
    if target and shutil.which(switch()) is None:
        return f"{switch()} is not installed (the BMv2 switch): {INSTALL_HINT}"
    if runtime:
        try:
            import p4runtime_sh.shell  # noqa: F401
        except ImportError:
            return "p4runtime-shell is not installed: pip install p4runtime-shell"
    return None


@dataclass(frozen=True)
class Build:
    """A compiled program: the BMv2 JSON and the P4Info (text format) of ``program`` (a path
    under ``p4/``), the aggregator's for K lanes unless told."""

    k: int
    directory: Path
    program: str = MAIN

    @property
    def json(self) -> Path:
        return self.directory / f"{Path(self.program).stem}.json"

    @property
    def p4info(self) -> Path:
        return self.directory / f"{Path(self.program).stem}.p4info.txt"


def sources(program: str = MAIN) -> list[Path]:
    """The hand-written P4 files of ``program``: everything in ``p4/``, or for the twin
    everything in ``p4/twin/`` and ``p4/tofino/`` (which it includes)."""
    if program == TWIN:
        return sorted([*(P4_DIR / "twin").glob("*.p4"), *(P4_DIR / "tofino").glob("*.p4")])
    return sorted(P4_DIR.glob("*.p4"))


def compile_command(build: Build) -> list[str]:
    """The ``p4c-bm2-ss`` command line that compiles ``build``'s program into its directory."""
    return [
        p4c(), "--std", "p4-16", "--arch", "v1model",
        "-I", str(build.directory),
        "-o", str(build.json),
        "--p4runtime-files", str(build.p4info),
        str(P4_DIR / build.program),
    ]  # fmt: skip


def _digest(build: Build) -> str:
    h = hashlib.sha256(f"k={build.k}\n{p4c()}\n".encode())
    if build.program == ECHO:
        h.update((P4_DIR / build.program).read_bytes())
        return h.hexdigest()
    for path in sources(build.program):
        h.update(str(path.relative_to(P4_DIR)).encode() + b"\0" + path.read_bytes())
    # what the generator would write now
    h.update(b"".join(text.encode() for text in _generated(build)))
    return h.hexdigest()


def _generated(build: Build) -> tuple[str, str]:
    """The generated ``config.p4`` and ``lanes.p4`` of ``build``'s program."""
    if build.program == TWIN:
        return gen_tofino.config_p4(build.k, dense=True), gen_tofino.twin_lanes_p4(build.k)
    return gen.config_p4(build.k), gen.lanes_p4(build.k)


def build(k: int, directory: Path | None = None, *, force: bool = False,
          profile: str = "default", announce: Announce | None = None) -> Build:  # fmt: skip
    """Generate and compile the program of ``profile`` (``PROFILES``) for ``k`` lanes (unless
    an up-to-date build exists): ``build/p4/k<K>/``, the twin's ``build/p4/tofino-k<K>/``.
    ``announce`` is given a line before a compile, or a wait for another process's, and one
    after it (see ``_announced``)."""
    program = PROFILES[profile]
    if program == TWIN:
        k = gen_tofino.twin_k(k)  # (pairs: an odd K's jobs run on the build for K + 1)
    else:
        gen.check_k(k)
    name = f"k{k}" if program == MAIN else f"{profile}-k{k}"
    result = Build(k, directory or BUILD_DIR / name, program)
    result.directory.mkdir(parents=True, exist_ok=True)
    # Aggregators started together share the build: one compiles, the others wait for it.
    with (result.directory / ".lock").open("w") as lock:
        _lock(lock, result, announce)
        return _build_locked(result, force, announce)


def build_echo(directory: Path | None = None, *, force: bool = False,
               announce: Announce | None = None) -> Build:  # fmt: skip
    """Compile the no-op forwarder ``p4/echo/echo.p4`` (unless an up-to-date build exists);
    ``announce`` as for ``build``."""
    result = Build(0, directory or BUILD_DIR / "echo", ECHO)
    result.directory.mkdir(parents=True, exist_ok=True)
    with (result.directory / ".lock").open("w") as lock:
        _lock(lock, result, announce)
        return _build_locked(result, force, announce)


Announce = Callable[[str], None]
"""Where a build says that it compiles, or waits for another process's compile (the
aggregator: a line on its log)."""


@contextlib.contextmanager
def _announced(announce: Announce | None, what: str) -> Iterator[None]:
    """Around a step that can take minutes: a ``BUILDING`` line first, which an aggregator's
    ``wait_ready`` does not count against its start while it is the log's last line, and a
    line with the time taken after."""
    if announce is None:
        yield
        return
    began = time.monotonic()
    announce(f"{BUILDING}{what}")
    try:
        yield
    finally:
        announce(f"{what}: {time.monotonic() - began:.0f} s")


def _lock(lock: IO[str], result: Build, announce: Announce | None) -> None:
    """Take the build's lock, announcing a wait for another process's compile."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    with _announced(announce, f"waiting for another process compiling {result.directory}"):
        fcntl.flock(lock, fcntl.LOCK_EX)


def _build_locked(result: Build, force: bool, announce: Announce | None) -> Build:
    stamp = result.directory / "inputs.sha256"
    digest = _digest(result)
    if (not force and result.json.exists() and result.p4info.exists() and stamp.exists()
            and stamp.read_text().strip() == digest):  # fmt: skip
        return result
    reason = missing(target=False, runtime=False)
    if reason:
        raise ToolchainError(f"cannot compile p4/{result.program}: {reason}")
    if result.program != ECHO:
        gen.write_generated(result.directory, *_generated(result))
    command = compile_command(result)
    what = f" K={result.k}" if result.program != ECHO else ""
    with _announced(announce, f"compiling p4/{result.program}{what} into {result.directory}"):
        proc = _run_with_progress(command, f"p4c-bm2-ss {result.program}{what}")
    if proc.returncode != 0:
        raise ToolchainError(
            f"{' '.join(command)} failed with status {proc.returncode}:\n"
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    stamp.write_text(digest + "\n")
    return result


def _run_with_progress(command: list[str], desc: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` and capture its output; on a terminal, a bar counts the seconds it has
    taken (p4c prints nothing for minutes at large K). Interrupted, the command is killed."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc, progress(desc=desc, unit="s") as bar:  # fmt: skip
        try:
            while True:
                try:
                    out, err = proc.communicate(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:  # output so far is kept for the next call
                    bar.update(1)
        except BaseException:
            proc.kill()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def main(argv: list[str] | None = None) -> int:
    """``python -m ncina.aggregator.backends.bmv2.toolchain --k K``: what ``make p4`` runs."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m ncina.aggregator.backends.bmv2.toolchain",
        description=f"Generate and compile p4/{MAIN} (or the Tofino profile's p4/{TWIN}) for "
        f"K lanes into {BUILD_DIR}/k<K>/ ({BUILD_DIR}/tofino-k<K>/).",
    )
    JobSpec.add_arguments(parser, "k", k=DEFAULT_K)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default",
                        help=f"default: p4/{MAIN}; tofino: p4/{TWIN}, the v1model twin of the "
                        "Tofino program, K up to 12 (default: %(default)s)")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="compile even if up to date")
    args = parser.parse_args(argv)
    try:
        result = build(args.k, force=args.force, profile=args.profile)
    except (ToolchainError, ValueError) as exc:
        print(f"make p4: {exc}", file=sys.stderr)
        return 1
    print(f"{result.json}\n{result.p4info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
