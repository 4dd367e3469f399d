"""Mutation check: each test that guards a known hole must fail when the hole is made.

For every mutation below, the tree is copied (tracked and untracked, not ignored, files) into a
temporary folder, one exact text in one file is replaced there (never in the working tree), the
copy is made the ``ncina`` that Python imports (a folder on ``PYTHONPATH`` holding the package
with its subpackages linked as ``pyproject.toml`` maps them; worker processes inherit it), and the
named tests run there. The mutation is caught when pytest says tests failed (exit status 1: a
failure, or an error in a test's setup); a collection or import error (exit status 2, the
mutation broke the tree rather than the behaviour) is not a catch.

Run: ``.venv/bin/python tools/mutation_check.py`` (all, a few minutes: before each release and
after changing a test named here), ``-k NAME`` (mutations whose name contains NAME),
``--list``. ``tests/test_mutations.py`` runs the quick ones (seconds each) in ``make test``;
docs/architecture.md, "Tests that can fail", describes the check.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The import names of the top-level folders (pyproject.toml's package-dir).
SUBPACKAGES = {"proto": "proto", "worker": "worker", "aggregator": "aggregator",
               "topo": "mininet", "p4": "p4"}  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    """One hole: ``old`` (exactly once in ``path``) replaced by ``new``; ``tests`` must fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str
    every: bool = False  # every selected test must fail, not just one
    # Its tests take a minute or more (a training run, the sanitized build): run by this
    # script (before a release), not by make test's tests/test_mutations.py.
    heavy: bool = False


NEGATE_AND_REVERSE = (
    "    compressor = _mutant(compressor)\n"
    "    return ErrorFeedback(compressor) if ef or cls.error_feedback else compressor\n\n\n"
    "def _mutant(compressor):\n"
    "    decode = compressor.decompress\n"
    "    object.__setattr__(compressor, 'decompress', lambda payload: -decode(payload)[::-1])\n"
    "    return compressor\n"
)

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "karn-python", "worker/transfer.py",
        "                if slot == 0:\n                    self.clean = False\n",
        "                pass\n",
        ("tests/test_worker_client.py::test_no_rtt_sample_from_a_retransmitted_chunk[python]",),
        "Karn's rule off: slot 0 samples the RTT of a re-sent chunk from its re-send",
    ),
    Mutation(
        "karn-c", "worker/transfer.c",
        "            if (slot == 0)\n                w->clean = 0;\n",
        "            (void)slot;\n",
        ("tests/test_worker_client.py::test_no_rtt_sample_from_a_retransmitted_chunk[c]",),
        "Karn's rule off in the C data path",
    ),
    Mutation(
        "decoders-negate-reverse", "proto/compressors/__init__.py",
        "    return ErrorFeedback(compressor) if ef or cls.error_feedback else compressor\n",
        NEGATE_AND_REVERSE,
        ("tests/test_compressors.py::test_round_trip_lengths",
         "tests/test_compressors.py::test_constant_vector"),
        "every decompress returns its output negated and reversed; every case with n >= 2 of"
        " the round trips and every constant vector fails (n = 1 is its own reverse, 0 empty)",
    ),
    Mutation(
        "qsgd-half-the-levels", "proto/compressors/qsgd.py",
        "        n, d = v.size, self._d(v.size)\n",
        "        n, d = v.size, self._d(v.size)\n"
        "        self = type(self)(s=self.s // 2 if self.s >= 16 else self.s,"
        " bucket=self.bucket, encoding=self.encoding)\n",
        ("tests/test_compressors_stats.py::test_qsgd_variance_bound",),
        "QSGD with s >= 16 (the default) quantizes to half its levels and says so in its"
        " header: 0.66 at s = 16, within the worst-case bound 1.0, 4x the Gaussian expectation",
    ),
    Mutation(
        "train-statistics-median-is-min", "mininet/report.py",
        '{"median": median, "min": ordered[0]', '{"median": ordered[0], "min": ordered[0]',
        ("tests/test_train_loopback.py::test_ina_and_gloo_runs_and_their_summary",),
        "the repeats' statistics report the minimum as the median",
        heavy=True,
    ),
    Mutation(
        "deadline-halved", "worker/transfer.py",
        "        if now - last_progress >= self.deadline:\n",
        "        if now - last_progress >= self.deadline / 2:\n",
        ("tests/test_failures.py::test_a_killed_worker_makes_the_others_fail_naming_its_rank"
         "[python]",),
        "the Python data path gives up after half the deadline (its message still says 1 s)",
    ),
    Mutation(
        "result-rounding-ignores-seed", "aggregator/backends/python/slots.py",
        "nc8.result_key(self._result_seed, ", "nc8.result_key(0, ",
        ("tests/test_aggregator_slots.py::test_nc8_results_are_seeded",),
        "the aggregator's nc8 result rounding draws the same bits whatever the job's seed",
    ),
    Mutation(
        "faults-ignore-seed", "aggregator/backends/python/faults.py",
        "np.random.default_rng(config.seed)", "np.random.default_rng(0)",
        ("tests/test_faults.py::test_same_seed_same_faults",),
        "the emulated faults draw the same decisions whatever their seed",
    ),
    Mutation(
        "bench-codec-without-agreement", "ncina/bench/codec.py",
        '        figures["identical_codes"] = bool(np.array_equal(codes["c"], codes["numpy"]))\n',
        "        pass\n",
        ("tests/test_nc8.py::test_codec_benchmark_smoke",),
        "the codec benchmark stops reporting whether C and numpy gave the same codes",
    ),
    Mutation(
        "nc8-c-does-not-build", "proto/nc8.c",
        '#include "nc8.h"\n', '#include "nc8.h"\n#error mutant: the codec does not build\n',
        ("tests/test_nc8.py::test_codec_benchmark_smoke",
         "tests/test_nc8.py::test_powers_in_window_encode_exactly[c]"),
        "the C codec does not compile: its tests fail instead of skipping or running numpy",
        every=True,
    ),
    Mutation(
        "nc8-c-does-not-build-sanitized", "proto/nc8.c",
        '#include "nc8.h"\n',
        '#include "nc8.h"\n#ifdef __SANITIZE_ADDRESS__\n#error mutant: no sanitized build\n'
        "#endif\n",
        ("tests/test_sanitizers.py",),
        "the C codec does not compile under ASan (it does without)",
        heavy=True,
    ),
)


def tree_files(root: Path) -> list[str]:
    """The files git would carry: tracked ones and untracked ones it does not ignore."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=root, capture_output=True,
                             check=True).stdout  # fmt: skip
    return [name for name in listing.decode().split("\0") if name and (root / name).is_file()]


def copy_tree(root: Path, target: Path) -> Path:
    """Copy the tree into ``target``; return the folder to put on ``PYTHONPATH``. The copy's
    ``ncina/`` gets its subpackages as links, so that it is the whole package both from that
    folder and from the copy's root (a process started there has the root on ``sys.path``)."""
    for name in tree_files(root):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target / name)
    package = target / "ncina"
    for module, folder in SUBPACKAGES.items():
        (package / module).symlink_to(target / folder, target_is_directory=True)
    site = target / ".mutation-site"
    site.mkdir()
    (site / "ncina").symlink_to(package, target_is_directory=True)
    return site


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"{mutation.name}: the text to replace occurs {count} times in "
                         f"{mutation.path} (the code changed: update tools/mutation_check.py)")
    path.write_text(text.replace(mutation.old, mutation.new))


def run(mutation: Mutation, root: Path = ROOT) -> tuple[bool, str]:
    """Apply ``mutation`` in a copy of ``root`` and run its tests; (caught, pytest's summary)."""
    with tempfile.TemporaryDirectory(prefix=f"ncina-mutant-{mutation.name}-") as folder:
        tree = Path(folder)
        site = copy_tree(root, tree)
        apply(mutation, tree)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
        where = subprocess.run([sys.executable, "-c", "import ncina.proto; print(ncina.proto"
                                ".__file__)"], cwd=tree / "tests", env=env, capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
        if not where.startswith(str(tree)):
            raise SystemExit(f"{mutation.name}: the copy's ncina is not the one imported ({where})")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rN", "-p",
                               "no:cacheprovider", "--no-header", "--durations=0",
                               "--durations-min=1000", *mutation.tests],
                              cwd=tree, env=env, capture_output=True, text=True)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else done.stderr.strip()[-300:]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (failed|passed|error|errors)",
                                                      summary)}  # fmt: skip
    failed, passed = counts.get("failed", 0), counts.get("passed", 0)
    errors = counts.get("error", 0) + counts.get("errors", 0)
    caught = done.returncode == 1 and failed + errors > 0
    if mutation.every:
        caught = caught and passed == 0
    return caught, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name}{' (heavy)' if m.heavy else ''}: {m.why}")
        return 0 if chosen or args.list else 2
    missed = []
    for mutation in chosen:
        began = time.monotonic()
        caught, summary = run(mutation)
        verdict = "caught" if caught else "MISSED"
        print(f"{verdict:6} {mutation.name} ({time.monotonic() - began:.1f} s): {summary}",
              flush=True)  # fmt: skip
        if not caught:
            missed.append(mutation.name)
    if missed:
        print(f"{len(missed)} of {len(chosen)} mutations were not caught: {', '.join(missed)}")
        return 1
    print(f"all {len(chosen)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
