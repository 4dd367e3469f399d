"""docs/architecture.md stays true: every file it names exists, every docs/protocol.md section it
links is a heading there, and the concept files of the Python reference (``aggregator/*.py``)
and of the C engine (``aggregator/engine/*.c``) import or call each other without a cycle.

Runs everywhere: it reads files, it builds and runs nothing.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PROTOCOL = ROOT / "docs" / "protocol.md"
# Where a file named without its folder may be (the picture names the aggregator's files so).
FOLDERS = ("", "aggregator", "aggregator/engine", "p4", "docs")
# p4/ files the P4 generator writes for the job's K (aggregator/bmv2/gen.py), not in the tree.
GENERATED = ("lanes.p4", "config.p4")
FILE = re.compile(
    r"(?<![\w./-])(?:[\w-]+/)*[\w-]+\.(?:py|c|h|p4|md)\b"  # a file: a/b.py, b.c
    r"|(?<![\w./-])(?:[\w-]+/)+(?![\w/])"  # a folder: worker/compressors/ (not "I/O")
)
CONCEPTS = ("parse", "admission", "members", "slots", "reply", "handshake", "pipeline")


def named_paths(text: str) -> set[str]:
    """Every file (``a/b.py``, ``b.c``) and folder (``worker/compressors/``) ``text`` names."""
    return {match.group(0) for match in FILE.finditer(text)}


def resolves(name: str) -> bool:
    """Whether ``name`` is a file or folder of the repository (directly, or in one of
    ``FOLDERS`` for a bare or partial name)."""
    return any((ROOT / folder / name).exists() for folder in FOLDERS)


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle of ``graph`` (node -> the nodes it depends on) as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for other in graph.get(node, ()):
            if state.get(other) == 1:
                return [*path[path.index(other):], other]
            if other not in state and (found := visit(other)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def python_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` (``ncina.aggregator.<name>``) that ``path`` imports when it
    runs (imports under ``if TYPE_CHECKING:`` are for type hints only)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["ncina", "aggregator"] and len(parts) > 2 and parts[2] in modules:
                found.add(parts[2])
    return found - {path.stem}


def c_calls(files: Iterable[Path]) -> dict[str, set[str]]:
    """Which of ``files`` each one calls (a function defined in one, called in another)."""
    texts = {f.name: re.sub(r"/\*.*?\*/", "", f.read_text(), flags=re.S) for f in files}
    defined = {
        name: file
        for file, text in texts.items()
        for name in re.findall(r"^(?!static)[a-z][\w \*]*?\b(nce_\w+)\(", text, re.M)
    }
    return {
        file: {home for name, home in defined.items()
               if home != file and re.search(rf"\b{name}\(", text)}
        for file, text in texts.items()
    }  # fmt: skip


def test_every_file_the_page_names_exists() -> None:
    text = DOC.read_text()
    names = named_paths(text)
    assert {f"aggregator/{c}.py" for c in CONCEPTS} <= names
    assert {f"aggregator/engine/{c}.c" for c in CONCEPTS} <= names
    missing = sorted(
        name for name in names
        if not resolves(name) and name.rsplit("/", 1)[-1] not in GENERATED
    )  # fmt: skip
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
    generator = (ROOT / "aggregator" / "bmv2" / "gen.py").read_text()
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
        assert f"`aggregator/{concept}.py`" in cells[1], row
        assert f"`aggregator/engine/{concept}.c`" in cells[2], row
        assert "`p4/" in cells[3], row


def test_python_concepts_import_without_cycles() -> None:
    files = sorted((ROOT / "aggregator").glob("*.py"))
    modules = {f.stem for f in files} | {"engine", "socket", "dpdk", "bmv2"}
    graph = {f.stem: python_imports(f, modules) for f in files}
    assert set(CONCEPTS) <= set(graph)
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_c_engine_files_call_without_cycles() -> None:
    files = sorted((ROOT / "aggregator" / "engine").glob("*.c"))
    graph = c_calls(files)
    assert {f"{c}.c" for c in CONCEPTS} <= set(graph)
    # The pipeline calls every concept; no concept calls the pipeline back.
    assert graph["pipeline.c"] >= {f"{c}.c" for c in CONCEPTS if c != "pipeline"}
    assert find_cycle(graph) is None, f"call cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
