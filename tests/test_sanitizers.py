"""The C code's tests again, with every extension built under AddressSanitizer and UBSan.

Two fresh pytest processes run the test files that drive C code (the NC8 kernels, the DPDK engine
offline and on the wire, the worker's C data path) with ``NCINA_SANITIZE=address,undefined`` and the
ASan runtime preloaded (``ncina.common.cbuild.sanitizer_environment``): any out-of-bounds access,
use after free or undefined behaviour aborts its process, and this test fails with its report.
Aggregators the inner tests start inherit the environment, so their C data planes are checked too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ncina.common.cbuild import sanitizer_environment

TESTS = Path(__file__).resolve().parent
# The tests whose work happens in C; each runs in a sanitized process. They run as two
# processes at once, split about evenly by their time under ASan: most of it is waiting on
# sockets and timers (one process keeps a core under half busy), so two take about 60 % of
# the time one does on two cores.
C_TESTS = (
    ("test_conformance.py", "test_dpdk_packets.py", "test_dpdk_engine.py", "test_dpdk_lcores.py",
     "test_nc8.py", "test_jobs.py", "test_worker_window.py"),
    ("test_hierarchical.py", "test_socket_packets.py", "test_socket_gro.py",
     "test_worker_client.py", "test_worker_parity.py", "test_handshake.py", "test_engine.py"),
)  # fmt: skip
# Cases left to the plain run: trees of Python aggregators only and the P4 switch (no C data
# plane of ours to check); all but one of each backend pair's handshake mismatches (the same
# C path each time); and trees with a Python level, except under loss, whose C level runs the
# same code as in the all-C trees kept here; of those under loss, the int ones (the nc8 ones
# add only the re-encoding, which the trees kept here run); and the socket backend run by an
# unprivileged user (the C code of the other socket tests, after a second sanitized build).
# They cost about 140 s under ASan, where the whole suite has 20 minutes on two cores.
DESELECT = (
    "not (python-python or spine_options1 or spine_options2 or spine_options3 or bmv2"
    " or (hierarchical and (socket-python or python-socket or dpdk-python or python-dpdk)"
    " and not (survive_loss and int)) or unprivileged_user)"
)
INNER_TIMEOUT = 900


@pytest.mark.slow
@pytest.mark.timeout(INNER_TIMEOUT + 60)
def test_c_code_is_clean_under_asan_and_ubsan(tmp_path: Path) -> None:
    env = {**os.environ, **sanitizer_environment()}
    env.pop("NCINA_NO_C", None)  # the point is to run the C code
    # Every extension this machine can build must build with the sanitizers (``ncina.common.cbuild``
    # skips only one whose tools are missing, DPDK's): the inner tests would otherwise skip
    # (DPDK) or fail on it, but this says which and why, and fails at once.
    built = subprocess.run([sys.executable, "-m", "ncina.common.cbuild"], cwd=TESTS.parent, env=env,
                           capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert built.returncode == 0, f"an extension does not build sanitized:\n{built.stderr}"
    runs = []
    for group, names in enumerate(C_TESTS):
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", DESELECT,
            f"--basetemp={tmp_path / f'inner{group}'}", *(str(TESTS / name) for name in names),
        ]  # fmt: skip
        runs.append(subprocess.Popen(command, cwd=TESTS.parent, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    try:
        outputs = [run.communicate(timeout=INNER_TIMEOUT)[0] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    for run, output in zip(runs, outputs, strict=True):
        report = output[-6000:]
        assert run.returncode == 0, f"sanitized run failed (exit {run.returncode}):\n{report}"
        assert "ERROR: AddressSanitizer" not in report and "runtime error:" not in report, report
        # The inner run really exercised the C code: tests ran and passed. None was skipped for
        # an extension that does not build: the extensions built above, and the inner tests
        # fail, not skip, on one that does not (test_nc8's c_codec; the C data path raises).
        assert " passed" in output and " failed" not in output, report
