"""Keep the repository root off ``sys.path`` during tests.

``python -m pytest`` run from the repository root puts the root on ``sys.path``, where the
``mininet/`` folder (imported as ``ncina.topo``) would shadow Debian's Mininet package. Dropping
the root before any test module is imported keeps ``import mininet`` pointing at the real one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]


# --- the P4 warm-up (tests/p4_warmup.py): make test's builds on the otherwise idle core ---------

_warmup: subprocess.Popen[bytes] | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``NCINA_P4_WARMUP=1`` (``make test``), start ``p4_warmup.py`` once the
    run has selected a test that starts a P4 program; its output goes to ``build/p4-warmup.log``."""
    global _warmup
    if os.environ.get("NCINA_P4_WARMUP") != "1" or session.config.option.collectonly:
        return
    if not any("bmv2" in item.nodeid or "tofino" in item.nodeid for item in session.items):
        return
    log_dir = os.path.join(_ROOT, "build")
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "p4-warmup.log"), "wb") as log:
        _warmup = subprocess.Popen(
            # At the tests' own priority: a test that needs a build waits for the warm-up's
            # compile under way, and at nice 10 beside two CPU hogs that compile got a tenth of
            # a core (the twin's K = 12 is 38 s of CPU): minutes, past the test's timeout.
            [sys.executable, os.path.join(_ROOT, "tests", "p4_warmup.py")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=_ROOT,
            start_new_session=True,  # its compilers too can be stopped as one group
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop a warm-up still compiling (a run cut short): its process group, which it leads (the
    only one we started), so that no compiler it ran outlives it."""
    if _warmup is not None and _warmup.poll() is None:
        os.killpg(_warmup.pid, signal.SIGTERM)
        try:
            _warmup.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(_warmup.pid, signal.SIGKILL)
            _warmup.wait()
