"""docs/architecture.md stays true: every file it names exists, every docs/protocol.md section it
links is a heading there, the table of layers has each layer on its floor (``test_imports.FLOORS``)
importing what its code imports, each concept has its row with a file in each backend, and the C
files of the engine and its I/O layers (``aggregator/engine/*.c``,
``aggregator/backends/{socket,dpdk}/*.c``) call each other without a cycle (the Python modules'
imports are ``test_imports.py``'s).

Runs everywhere: it reads files, it builds and runs nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from test_imports import FLOORS, find_cycle, find_modules, layer_graph

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PROTOCOL = ROOT / "docs" / "protocol.md"
# Where a file named without its folder may be (the picture names the aggregator's files so).
FOLDERS = ("", "aggregator", "aggregator/backends/python", "aggregator/engine",
           "aggregator/backends", "p4", "docs")
# p4/ files the P4 generator writes for the job's K (aggregator/backends/bmv2/gen.py), not in the
# tree.
GENERATED = ("lanes.p4", "config.p4")
FILE = re.compile(
    r"(?<![\w./-])(?:[\w-]+/)*[\w-]+\.(?:py|c|h|p4|md)\b"  # a file: a/b.py, b.c
    r"|(?<![\w./-])(?:[\w-]+/)+(?![\w/])"  # a folder: proto/compressors/ (not "I/O")
)
CONCEPTS = ("parse", "admission", "members", "slots", "reply", "handshake", "pipeline")
PYTHON = "aggregator/backends/python"  # the Python reference's folder


def named_paths(text: str) -> set[str]:
    """Every file (``a/b.py``, ``b.c``) and folder (``proto/compressors/``) ``text`` names."""
    return {match.group(0) for match in FILE.finditer(text)}


def resolves(name: str) -> bool:
    """Whether ``name`` is a file or folder of the repository (directly, or in one of
    ``FOLDERS`` for a bare or partial name)."""
    return any((ROOT / folder / name).exists() for folder in FOLDERS)


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def c_calls(files: Iterable[Path]) -> dict[str, set[str]]:
    """Which of ``files`` (named by their path under ``aggregator/``) each one calls: a function
    of the engine (``nce_``) or an I/O layer (``ncs_``, ``ncd_``) defined in one and called in
    another."""
    texts = {
        str(f.relative_to(ROOT / "aggregator")): re.sub(r"/\*.*?\*/", "", f.read_text(), flags=re.S)
        for f in files
    }
    defined = {
        name: file
        for file, text in texts.items()
        for name in re.findall(r"^(?!static)[a-z][\w \*]*?\b(nc[eds]_\w+)\(", text, re.M)
    }
    return {
        file: {home for name, home in defined.items()
               if home != file and re.search(rf"\b{name}\(", text)}
        for file, text in texts.items()
    }  # fmt: skip


def test_every_file_the_page_names_exists() -> None:
    text = DOC.read_text()
    names = named_paths(text)
    assert {f"{PYTHON}/{c}.py" for c in CONCEPTS} <= names
    assert {f"aggregator/engine/{c}.c" for c in CONCEPTS} <= names
    missing = sorted(
        name for name in names
        if not resolves(name) and name.rsplit("/", 1)[-1] not in GENERATED
    )  # fmt: skip
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
    generator = (ROOT / "aggregator" / "backends" / "bmv2" / "gen.py").read_text()
    assert all(name in generator for name in GENERATED)


def test_every_protocol_section_linked_is_a_heading() -> None:
    anchors = {slug(line.lstrip("#")) for line in PROTOCOL.read_text().splitlines()
               if line.startswith("#")}  # fmt: skip
    linked = set(re.findall(r"\(protocol\.md#([\w-]+)\)", DOC.read_text()))
    assert linked, "the concept table links no section of docs/protocol.md"
    assert linked <= anchors, f"no such heading in docs/protocol.md: {sorted(linked - anchors)}"


def test_the_concept_table_has_a_row_per_concept_with_each_backend() -> None:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ")]
    for concept in CONCEPTS:
        [row] = [r for r in rows if r.startswith(f"| {concept}:")]
        cells = row.split(" | ")
        assert f"`{PYTHON}/{concept}.py`" in cells[1], row
        assert f"`aggregator/engine/{concept}.c`" in cells[2], row
        assert "`p4/" in cells[3], row


def test_c_files_call_without_cycles() -> None:
    """The engine's concept files and the socket and DPDK I/O layers around them: no call
    cycle, the pipeline calls every concept, and the engine never calls an I/O layer."""
    files = sorted(
        path for folder in ("engine", "backends/socket", "backends/dpdk")
        for path in (ROOT / "aggregator" / folder).glob("*.c")
    )  # fmt: skip
    graph = {file: sorted(calls) for file, calls in c_calls(files).items()}
    concepts = {f"engine/{c}.c" for c in CONCEPTS}
    loops = {"backends/socket/loop.c", "backends/dpdk/loop.c"}
    assert concepts <= set(graph) and loops <= set(graph)
    assert set(graph["engine/pipeline.c"]) >= concepts - {"engine/pipeline.c"}
    # the I/O layer calls nce_input
    assert set(graph["backends/socket/loop.c"]) >= {"engine/pipeline.c"}
    assert not [(f, c) for f, calls in graph.items() if f.startswith("engine/")
                for c in calls if not c.startswith("engine/")]  # fmt: skip
    assert find_cycle(graph) is None, f"call cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_layer_table_is_the_import_graph() -> None:
    """Each layer of ``FLOORS`` has its row (folder, import name, floor), and its last column
    names the folders of exactly the layers its modules import."""
    modules = find_modules()
    folder = {layer: f"{modules[layer].parent.relative_to(ROOT)}/"
              for floor in FLOORS for layer in floor}  # fmt: skip
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            imported = set(re.findall(r"`([\w/]+/)`", cells[4]))
            rows[cells[1].strip("`")] = (int(cells[0]), cells[2], imported)
    graph = layer_graph()
    expected = {
        folder[layer]: (floor, {folder[target] for target in graph[layer]})
        for floor, layers in enumerate(FLOORS) for layer in layers
    }  # fmt: skip
    assert {name: (row[0], row[2]) for name, row in rows.items()} == expected
    for layer, name in folder.items():
        assert f"`{layer}`" in rows[name][1] or layer == "ncina", (layer, rows[name][1])
