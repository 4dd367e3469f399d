"""A plain (non-editable) ``pip install`` carries everything the package reads at run time.

The P4 program (``p4/`` -> ``ncina/p4/``) and the C sources cffi compiles are package data: a
copy installed with ``pip install --target`` must find them with the checkout nowhere on the
path, generate the P4 program for a K exactly as the checkout does, and name p4c when it is
missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ncina.aggregator.backends.bmv2 import gen, toolchain

ROOT = Path(__file__).resolve().parents[1]
# What pip needs from the checkout to build the distribution (tests and run outputs stay behind).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "ncina", "proto", "worker", "aggregator",
           "mininet", "p4")  # fmt: skip
PACKAGE_DATA = ("*.p4", "*.c", "*.h")
# A checkout folder whose subpackage has another name (pyproject's package-dir).
PACKAGES = {"mininet": "topo"}
# Run by the installed copy, from a directory outside the checkout: where the package and its P4
# sources are, the generated files for K, and (with "build") what compiling for K says.
PROBE = """
import json, sys
from pathlib import Path
import ncina
from ncina.aggregator.backends.bmv2 import gen, toolchain
k = int(sys.argv[1])
written = gen.write(k, Path("gen"))
build = None
if sys.argv[2:] == ["build"]:
    try:
        build = str(toolchain.build(k).json)
    except toolchain.ToolchainError as exc:
        build = f"error: {exc}"
print(json.dumps({"package": ncina.__file__, "p4_dir": str(toolchain.P4_DIR),
                  "sources": [p.name for p in toolchain.sources()],
                  "generated": {p.name: p.read_text() for p in written},
                  "build_dir": str(toolchain.BUILD_DIR), "build": build}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package installed with ``pip install --no-deps --target`` from a copy of the checkout
    (pip builds in the source tree; the copy keeps build/ of the checkout untouched)."""
    base = tmp_path_factory.mktemp("install")
    src = base / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.exists():
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    target = base / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(src)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return target


def _probe(installed: Path, tmp_path: Path, k: int, *, build: bool = False) -> dict:
    """What the installed copy finds and generates for K (and, with ``build``, compiles: half a
    minute with p4c, so only the test of compiling asks for it)."""
    env = {**os.environ, "PYTHONPATH": str(installed), "NCINA_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-c", PROBE, str(k), *(["build"] if build else [])]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return json.loads(proc.stdout)


def _data_files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for pattern in PACKAGE_DATA
        for path in root.rglob(pattern)
    }


def test_the_installed_package_carries_the_p4_and_c_sources(installed: Path) -> None:
    shipped = _data_files(installed / "ncina")
    expected = {
        f"{PACKAGES.get(folder, folder)}/{name}": data
        for folder in ("p4", "proto", "worker", "aggregator", "mininet")
        for name, data in _data_files(ROOT / folder).items()
    }
    assert shipped == expected
    assert "p4/ncina.p4" in shipped and "proto/nc8.c" in shipped


def test_the_installed_copy_generates_the_p4_program_from_its_own_sources(
    installed: Path, tmp_path: Path
) -> None:
    found = _probe(installed, tmp_path, 64)
    assert Path(found["package"]).parent == installed / "ncina"
    assert Path(found["p4_dir"]) == installed / "ncina" / "p4"
    assert found["sources"] == [p.name for p in toolchain.sources()]
    assert found["generated"] == {"config.p4": gen.config_p4(64), "lanes.p4": gen.lanes_p4(64)}
    # An installed copy builds into the cache, never into its (possibly read-only) folder.
    assert Path(found["build_dir"]) == tmp_path / "cache" / "p4"


def test_the_installed_copy_compiles_the_p4_program(installed: Path, tmp_path: Path) -> None:
    reason = toolchain.missing(target=False, runtime=False)
    found = _probe(installed, tmp_path, 8, build=True)
    if reason:
        assert found["build"] == f"error: cannot compile p4/{toolchain.MAIN}: {reason}"
        pytest.skip(reason)
    assert Path(found["build"]) == tmp_path / "cache" / "p4" / "k8" / "ncina.json"
    assert Path(found["build"]).is_file()
