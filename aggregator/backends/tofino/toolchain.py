"""Compile the Tofino program ``p4/tofino/`` with the open-source Tofino compiler and read how
much of the pipeline it takes.

``p4c-barefoot`` (p4c's Tofino back end) is looked up on ``PATH`` or named by
``NCINA_P4C_TOFINO``; nothing here ships it. A build goes to ``build/p4-tofino/<target>-k<K>/``
of the checkout (or the cache folder of an installed copy): the generated ``config.p4`` and
``lanes.p4``, the compiler's output (``out/``) and ``resources.json``, the summary this module
writes (stages, SRAM and TCAM blocks, stateful ALUs, PHV bits). It is redone only when a source,
K, the target or the compiler changed.

The compiler fits tables to stages but does not refuse a program that needs more stages than
the device has (its assembler, which is not part of the open-source release, would): ``fits``
compares the stages used with the device's (12 on Tofino, 20 on Tofino 2). ``make p4-tofino``
runs ``main``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ncina.aggregator.backends.bmv2.toolchain import (
    CHECKOUT,
    ROOT,
    ToolchainError,
    _run_with_progress,
)
from ncina.aggregator.backends.tofino import gen
from ncina.proto.job import JobSpec
from ncina.proto.profiles import TOFINO_NC8_MAX_K

from ncina.common.cbuild import cache_root

SOURCE_DIR = ROOT / "p4" / "tofino"
MAIN = "ncina.p4"
BUILD_DIR = ROOT / "build" / "p4-tofino" if CHECKOUT else cache_root() / "p4-tofino"
STAGES = {"tofino": 12, "tofino2": 20}
"""Match-action stages per pipeline of each device."""
ARCH = {"tofino": "tna", "tofino2": "t2na"}
DEFAULT_K = 12
"""Lanes per pass of the one-register-per-lane layout's documented fit (docs/tofino.md)."""
DENSE_K = 32
"""Lanes per pass of the dense layout's documented fit (docs/tofino.md, "Density"; its report
is ``docs/tofino-resources/tofino-k32-dense.json``)."""
DEFAULT_DENSE = True
"""``make p4-tofino`` builds the dense layout (DENSE_K lanes per pass fit Tofino 1)."""
PASSES_K = 2 * gen.REGION
"""Elements per packet of the two-pass layout (``--passes 2``, docs/tofino.md "64 elements per
packet"): DENSE_K lanes per pass, two passes that add."""
REPORTS = ROOT / "docs" / "tofino-resources"
"""The committed fit reports (``--report``): one JSON file per variant (``report_name``)."""

INSTALL_HINT = (
    "build p4c with its Tofino back end (cmake -DENABLE_TOFINO=ON; the binary is p4c-barefoot) "
    "or Intel's SDE, and put it on PATH or point NCINA_P4C_TOFINO at it"
)


def compiler() -> str:
    """The Tofino compiler (``NCINA_P4C_TOFINO``, default ``p4c-barefoot``)."""
    return os.environ.get("NCINA_P4C_TOFINO", "p4c-barefoot")


def missing() -> str | None:
    """One sentence naming the missing compiler, or None."""
    if shutil.which(compiler()) is None:
        return f"{compiler()} is not installed (the Tofino compiler): {INSTALL_HINT}"
    return None


@dataclass(frozen=True)
class Resources:
    """What the compiled program takes of one pipeline (the compiler's resources.json and
    phv.json): stages used of the device's, and the totals of the tables' memories and ALUs."""

    target: str
    k: int
    stages: int
    device_stages: int
    sram_blocks: int
    tcam_blocks: int
    stateful_alus: int
    phv_bits: int
    phv_capacity: int
    dense: bool = False
    """The pair-register layout with int32 results (``gen.dense_lanes_p4``)."""
    nc8: bool = False
    """One register per lane with NC8 results re-compressed in egress (``gen.lanes_p4(k,
    nc8=True)``)."""
    passes: int = 1
    """Passes that add a packet's lanes (2: the two-pass layout, ``gen.pass_lanes_p4``)."""

    @property
    def fits(self) -> bool:
        return self.stages <= self.device_stages

    def line(self) -> str:
        """One table row of docs/tofino.md."""
        fits = "yes" if self.fits else "no"
        target = f"{self.target} dense" if self.dense else self.target
        target = f"{target} nc8" if self.nc8 else target
        target = f"{target}, {self.passes} passes" if self.passes > 1 else target
        return (
            f"| {target} | {self.k} | {self.stages} of {self.device_stages} | "
            f"{self.sram_blocks} | {self.tcam_blocks} | {self.stateful_alus} | "
            f"{self.phv_bits} of {self.phv_capacity} | {fits} |"
        )


def read_resources(
    out: Path, target: str, k: int, dense: bool = False, nc8: bool = False, passes: int = 1
) -> Resources:
    """Sum the compiler's per-stage report in ``out/pipe/logs`` (compiled with ``-g``)."""
    logs = out / "pipe" / "logs"
    try:
        report = json.loads((logs / "resources.json").read_text())["resources"]
        phv = json.loads((logs / "phv.json").read_text())
    except (OSError, ValueError, KeyError) as exc:
        raise ToolchainError(f"no resource report in {logs}: {exc}") from exc
    stages = report["mau"]["mau_stages"]
    capacity = sum(group["units"] * group["width"]
                   for group in report["phv_containers"].get("normal", []))  # fmt: skip
    used = sum(c["bit_width"] for c in phv["containers"] if c["container_type"] == "normal")
    return Resources(
        target=target,
        k=k,
        stages=1 + max((s["stage_number"] for s in stages), default=-1),
        device_stages=STAGES[target],
        sram_blocks=sum(len(s["rams"]["srams"]) for s in stages),
        tcam_blocks=sum(len(s["tcams"]["tcams"]) for s in stages),
        stateful_alus=sum(len(s["meter_alus"]["meters"]) for s in stages),
        phv_bits=used,
        phv_capacity=capacity,
        dense=dense,
        nc8=nc8,
        passes=passes,
    )


def stages_of(out: Path) -> list[dict[str, object]]:
    """Where the stages go: per stage of the compiler's report, its stateful ALUs, TCAM and SRAM
    blocks and the logical tables it holds (the compiler's names, control prefixes dropped;
    ``tbl_*`` are its tables for actions outside tables, ``cond-*`` its gateways)."""
    stages = json.loads((out / "pipe" / "logs" / "resources.json").read_text())
    out_stages = []
    for s in stages["resources"]["mau"]["mau_stages"]:
        tables = [re.sub(r"^Ncina(Ingress|Egress)\.", "", t["table_name"])
                  for t in s["logical_tables"]["ids"]]  # fmt: skip
        out_stages.append({
            "stage": s["stage_number"],
            "stateful_alus": len(s["meter_alus"]["meters"]),
            "tcam_blocks": len(s["tcams"]["tcams"]),
            "sram_blocks": len(s["rams"]["srams"]),
            "tables": tables,
        })
    return sorted(out_stages, key=lambda st: int(st["stage"]))  # type: ignore[call-overload]


def report_name(k: int, target: str, dense: bool, nc8: bool = False, passes: int = 1) -> str:
    """The file name of a variant's fit report, e.g. ``tofino-k32-dense.json``,
    ``tofino-k7-nc8.json``, ``tofino-k64-dense-2pass.json``."""
    more = f"-{passes}pass" if passes > 1 else ""
    return f"{target}-k{k}{'-dense' if dense else ''}{'-nc8' if nc8 else ''}{more}.json"


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.p4"))


def compile_command(k: int, target: str, directory: Path) -> list[str]:
    """The ``p4c-barefoot`` command line that compiles ``p4/tofino/ncina.p4`` into
    ``directory/out`` with detailed logs (``-g``, which writes the resource report)."""
    return [compiler(), "--target", target, "--arch", ARCH[target], "-g",
            "-I", str(directory), "-o", str(directory / "out"), str(SOURCE_DIR / MAIN)]  # fmt: skip


def inputs_digest(k: int, target: str, dense: bool, nc8: bool = False, passes: int = 1) -> str:
    """What a build is compiled from: K, the target, the compiler's name, ``p4/tofino/*.p4`` and
    the generated ``config.p4`` and ``lanes.p4`` (a build, and a fit report, is of this)."""
    h = hashlib.sha256(f"k={k}\ntarget={target}\n{compiler()}\n".encode())
    for path in sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(gen.config_p4(k, dense, nc8, passes).encode()
             + gen.lanes_p4(k, dense, nc8, passes).encode())  # fmt: skip
    return h.hexdigest()


def build(k: int = DEFAULT_K, target: str = "tofino", directory: Path | None = None, *,
          force: bool = False, dense: bool = False, nc8: bool = False,
          passes: int = 1) -> Resources:  # fmt: skip
    """Generate and compile the program for ``k`` lanes (unless an up-to-date build exists);
    return its resources. ``dense``: the pair-register layout with int32 results
    (docs/tofino.md, "Density"); ``nc8``: one register per lane with NC8 results (docs/tofino.md,
    "NC8 results on the switch"); ``passes`` 2: the dense layout adding ``k / 2`` lanes per pass
    (Tofino 1, docs/tofino.md "64 elements per packet"). A compile error is a
    ``ToolchainError`` with the compiler's words."""
    if target not in STAGES:
        raise ValueError(f"target must be one of {', '.join(STAGES)}, not {target}")
    gen.check_k(k)
    if dense:
        gen.check_dense_k(k, passes)
    elif passes != 1:
        raise ValueError("two passes are built on the dense layout only")
    if passes != 1 and target != "tofino":
        raise ValueError("two passes are built for Tofino 1 (--target tofino) only")
    if dense and nc8:
        raise ValueError("NC8 results are built on the one-register-per-lane layout only")
    name = report_name(k, target, dense, nc8, passes)
    directory = directory or BUILD_DIR / name.removesuffix(".json")
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = directory / "inputs.sha256"
        summary = directory / "resources.json"
        digest = inputs_digest(k, target, dense, nc8, passes)
        if (not force and summary.exists() and stamp.exists()
                and stamp.read_text().strip() == digest):  # fmt: skip
            return Resources(**json.loads(summary.read_text()))
        reason = missing()
        if reason:
            raise ToolchainError(f"cannot compile p4/tofino/{MAIN}: {reason}")
        gen.write(k, directory, dense, nc8, passes)
        command = compile_command(k, target, directory)
        started = time.monotonic()
        proc = _run_with_progress(command, f"p4c-barefoot {target} K={k}")
        if proc.returncode != 0:
            errors = [line for line in (proc.stderr + proc.stdout).splitlines()
                      if "error" in line.lower()]  # fmt: skip
            raise ToolchainError(
                f"{' '.join(command)} failed with status {proc.returncode}:\n"
                + "\n".join(errors[:20] or [(proc.stderr or proc.stdout).strip()])
            )
        resources = read_resources(directory / "out", target, k, dense, nc8, passes)
        summary.write_text(json.dumps(asdict(resources), indent=1) + "\n")
        report = {
            "resources": asdict(resources),
            "fits": resources.fits,
            "inputs_sha256": digest,
            "compile_wall_seconds": round(time.monotonic() - started),
            "stages": stages_of(directory / "out"),
        }
        (directory / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        stamp.write_text(digest + "\n")
        return resources


def main(argv: list[str] | None = None) -> int:
    """``python -m ncina.aggregator.backends.tofino.toolchain --k K``: what ``make p4-tofino``
    runs."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m ncina.aggregator.backends.tofino.toolchain",
        description=f"Generate p4/tofino/{MAIN} for K lanes, compile it with p4c-barefoot into "
        f"{BUILD_DIR}/<target>-k<K>/ and print the pipeline resources it takes.",
    )
    JobSpec.add_arguments(parser, "k", k=None, rules={
        "k": f"{DENSE_K} dense, {DEFAULT_K} one per lane, {TOFINO_NC8_MAX_K} nc8"})  # fmt: skip
    parser.add_argument("--target", choices=sorted(STAGES), default="tofino")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--dense", action="store_true", default=DEFAULT_DENSE,
                        help="the pair-register layout with int32 results (docs/tofino.md, "
                        "\"Density\"; the default)")  # fmt: skip
    layout.add_argument("--one-per-lane", dest="dense", action="store_false",
                        help="one 32-bit register per lane, int results (at most 12 lanes)")
    layout.add_argument("--nc8", action="store_true",
                        help="one register per lane with NC8 results re-compressed in egress "
                        "(docs/tofino.md, \"NC8 results on the switch\"; fits 7 lanes)")
    parser.add_argument("--passes", type=int, choices=(1, 2), default=None,
                        help=f"passes that add a packet's lanes: 2 adds {DENSE_K} lanes per pass, "
                        f"{PASSES_K} per packet (the dense layout on tofino; the default at "
                        f"--k {PASSES_K} there, docs/tofino.md \"64 elements per packet\")")
    parser.add_argument("--force", action="store_true", help="compile even if up to date")
    parser.add_argument("--report", action="store_true", help=f"copy the fit report (stages "
                        f"and tables, resources, the inputs' digest) into {REPORTS}/")  # fmt: skip
    args = parser.parse_args(argv)
    args.dense = args.dense and not args.nc8
    if args.k is None:
        args.k = TOFINO_NC8_MAX_K if args.nc8 else DENSE_K if args.dense else DEFAULT_K
    if args.passes is None:
        args.passes = 2 if args.dense and args.k == PASSES_K and args.target == "tofino" else 1
    try:
        res = build(args.k, args.target, force=args.force, dense=args.dense, nc8=args.nc8,
                    passes=args.passes)  # fmt: skip
    except (ToolchainError, ValueError) as exc:
        print(f"make p4-tofino: {exc}", file=sys.stderr)
        return 1
    if args.report:
        name = report_name(args.k, args.target, args.dense, args.nc8, args.passes)
        REPORTS.mkdir(parents=True, exist_ok=True)
        directory = BUILD_DIR / name.removesuffix(".json")
        shutil.copyfile(directory / "report.json", REPORTS / name)
    print("| target | K | stages | SRAM blocks | TCAM blocks | stateful ALUs | PHV bits | fits |")
    print(res.line())
    if not res.fits:
        print(f"make p4-tofino: K={args.k} takes {res.stages} stages; {args.target} has "
              f"{res.device_stages}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
