"""Compile the P4 programs the suite starts, in a process of their own, before the tests ask.

A BMv2 or Tofino build is made on first use, under a file lock, by whichever aggregator or test
needs it (``ncina.aggregator.backends.bmv2.toolchain.build``, ``...tofino.toolchain.build``); in
a clean clone that puts about two and a half minutes of p4c on the suite's critical path while
the machine's second core waits. ``make test`` (``NCINA_P4_WARMUP=1``) has ``conftest.py`` start
this script at low priority when collection is done: it makes the same builds, one at a time, in
the same folders and under the same locks, so a test that gets there first waits for the
compile under way or finds the build made; nothing a test checks comes from here. Builds the
installed toolchains cannot make are skipped; a failed compile is left for its test to report.

``BUILDS`` lists what the tests start, in the order the suite first needs them; a build missing
from it is only compiled later, by its test, as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

from ncina.aggregator.backends.bmv2 import toolchain as bmv2
from ncina.aggregator.backends.tofino import toolchain as tofino

# (K, profile) of the BMv2 programs the tests run: the packet tests' K = 12 on the default
# program and the Tofino twin, then the K of the fuzz, bench, torch and hierarchical tests (64),
# the reinit and server tests' 32, the DPDK lcores' 16, the twin's nc8 results' 7 (the twin's
# build for 8: its lanes are pairs) (test_tofino_twin), the GRO test's 4, the twin's smallest
# build (4), and the twin at the design's 32 lanes (test_tofino_twin's all-reduces: about 2
# minutes of CPU, the longest of these).
BMV2_BUILDS = ((12, "default"), (12, "tofino"), (64, "default"), (32, "default"),
               (16, "default"), (7, "tofino"), (4, "default"), (4, "tofino"),
               (32, "tofino"))  # fmt: skip
# K of the Tofino builds tests/test_tofino.py checks: the default layout and the dense one.
TOFINO_BUILDS = ((4, False), (4, True))


def main() -> int:
    if bmv2.missing(target=False, runtime=False) is None:
        for k, profile in BMV2_BUILDS:
            _quietly(partial(bmv2.build, k, profile=profile), f"BMv2 K={k} {profile}")
        _quietly(bmv2.build_echo, "BMv2 echo")
    if tofino.missing() is None:
        for k, dense in TOFINO_BUILDS:
            _quietly(partial(tofino.build, k, "tofino", dense=dense), f"Tofino K={k} dense={dense}")
    return 0


def _quietly(build: Callable[[], object], name: str) -> None:
    """Run ``build``; a failure is printed (to this process's log) and left to the test."""
    try:
        build()
        print(f"p4 warm-up: {name} ready", flush=True)
    except Exception as exc:  # the test that needs the build reports it
        print(f"p4 warm-up: {name} failed: {exc}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
