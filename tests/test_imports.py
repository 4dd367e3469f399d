"""Import rules of the tree, read from the sources with ``ast`` (nothing is imported).

The ``ncina`` modules are found through ``pyproject.toml``'s ``package-dir`` (``ncina.proto``
is ``proto/``, ``ncina.topo`` is ``mininet/`` ...); the modules of ``tests/`` are named
``tests.<name>`` (pytest puts ``tests/`` on the path, so they import each other by their bare
names), so a rule can name them too (``Rule("tests", "ncina.bench", ...)``).

Four kinds of check:
- ``FLOORS``: the folders are the layers, and a layer imports only layers of lower floors
  (docs/architecture.md draws them), so no two layers import each other, even through others.
- ``RULES``: layers that must not depend on each other, each with its reason. Every import
  counts, wherever it stands (a lazy import in a function is a dependency too). To add one, add
  a row.
- no import cycle among module-level imports. An import inside a function or under
  ``if TYPE_CHECKING:`` runs after the module is loaded (or never), so it cannot take part in
  a cycle of half-initialised modules and is left out of that graph.
- every ``ncina.*`` name resolves to its file through pyproject's package map alone: each
  imported module (and each module named in a string, ``-m ncina.cli`` or a registry's
  ``"ncina.proto.nc8:_build_c"``) is a file of the tree; a name imported from a module is defined
  there, not re-exported; no module defines a module-level ``__getattr__`` to forward names.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = "tests"


@dataclass(frozen=True)
class Rule:
    """Modules under ``importer`` must not import anything under ``forbidden``."""

    importer: str
    forbidden: str
    why: str


# The layers, bottom up: a module may import its own layer and those of lower floors only; two
# layers of one floor do not import each other. A module belongs to the longest layer name it is
# under (``ncina`` itself: the console ``ncina.cli`` and the ``torch`` entry point ``ncina.torch``).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("ncina.common",),
    ("ncina.proto",),
    ("ncina.worker", "ncina.aggregator"),
    ("ncina.harness", "ncina.topo"),
    ("ncina.bench",),
    ("ncina",),
)

RULES = (
    Rule("ncina.aggregator", "ncina.worker",
         "the switch side does not depend on the worker; shared codecs live in ncina.proto"),
    Rule("ncina.proto", "ncina.worker", "the wire format is below both sides"),
    Rule("ncina.proto", "ncina.aggregator", "the wire format is below both sides"),
    Rule("tests", "ncina.bench",
         "tests share harnesses with the benchmarks through ncina.harness; a benchmark is "
         "tested through its command, ncina bench NAME"),
    Rule("ncina.harness", "ncina.bench", "the benchmarks use the harness, not the other way"),
    Rule("ncina.worker", "ncina.aggregator",
         "the worker does not depend on the switch side; what both use is in ncina.proto or "
         "ncina.common"),
    Rule("ncina.worker", "ncina.harness",
         "the harness drives workers from outside; a helper both use belongs in ncina.common"),
    Rule("ncina", "ncina.cli",
         "ncina.cli is the console script only (tests run it); shared helpers are ncina.common's"),
    Rule("ncina.worker.client.handshake", "ncina.worker.client.datapath",
         "the client's concepts call one way: the data paths make the handshake, not it them"),
    Rule("ncina.worker.client.datapath", "ncina.worker.client.recovery",
         "the data paths raise errors.Restart; the recovery above them recovers from it"),
    Rule("ncina.worker.client.recovery", "ncina.worker.client.allreduce",
         "the public call (AllreduceClient) runs the recovery, not the other way"),
)


@dataclass(frozen=True)
class Import:
    """One imported module as written in ``module`` (resolved to a module of the tree if any)."""

    target: str
    line: int
    module_level: bool


def under(name: str, prefix: str) -> bool:
    """Whether the dotted ``name`` is ``prefix`` or inside it."""
    return name == prefix or name.startswith(prefix + ".")


def source_folders() -> dict[str, Path]:
    """Package name -> folder, from pyproject's ``package-dir``, plus ``tests``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    folders = {name: ROOT / path for name, path in mapping.items()}
    folders[TESTS] = ROOT / TESTS
    return folders


def find_modules() -> dict[str, Path]:
    """Every module of the tree by its dotted name (a package by its ``__init__.py``)."""
    folders = source_folders()
    claimed = {folder.resolve() for folder in folders.values()}
    found: dict[str, Path] = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            # A folder mapped to its own package (or a cache) is not part of this one.
            if any(part.startswith((".", "__pycache__")) for part in parts):
                continue
            if any((folder / Path(*parts[:i])).resolve() in claimed for i in range(1, len(parts))):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def walk_imports(body: list[ast.stmt], module_level: bool) -> Iterator[tuple[ast.stmt, bool]]:
    """The import statements of ``body``, each with whether it runs when the module loads."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, module_level
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from walk_imports(node.body, False)
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            yield from walk_imports(node.body, False)
            yield from walk_imports(node.orelse, module_level)
        else:
            # Class bodies, try/with/if/for blocks run at import time like the module's body.
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, []):
                    nested = isinstance(child, ast.excepthandler | ast.match_case)
                    yield from walk_imports(child.body if nested else [child], module_level)


def resolve(name: str, importer: str, modules: dict[str, Path]) -> str:
    """The module of the tree ``name`` stands for, seen from ``importer`` (else ``name``)."""
    if under(importer, TESTS) and f"{TESTS}.{name}" in modules:
        return f"{TESTS}.{name}"
    return name


def imports_of(module: str, modules: dict[str, Path]) -> list[Import]:
    """The modules ``module`` imports: ``from a.b import c`` is ``a.b.c`` if that is a module."""
    path = modules[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node, module_level in walk_imports(tree.body, True):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            base = resolve(base, module, modules)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        found.extend(Import(resolve(name, module, modules), node.lineno, module_level)
                     for name in names)
    return list(dict.fromkeys(found))


def import_graph() -> tuple[dict[str, Path], dict[str, list[Import]]]:
    """The tree's modules and what each imports."""
    modules = find_modules()
    return modules, {module: imports_of(module, modules) for module in modules}


def find_cycle(edges: dict[str, list[str]]) -> list[str] | None:
    """One cycle of ``edges`` as a path ``[a, b, ..., a]``, or ``None`` (iterative DFS)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    for start in sorted(edges):
        if state.get(start):
            continue
        path = [start]
        pending = [iter(sorted(edges[start]))]
        state[start] = 1
        while pending:
            step = next(pending[-1], None)
            if step is None:
                state[path.pop()] = 2
                pending.pop()
            elif state.get(step) == 1:
                return [*path[path.index(step):], step]
            elif not state.get(step):
                state[step] = 1
                path.append(step)
                pending.append(iter(sorted(edges.get(step, ()))))
    return None


def test_modules_are_found() -> None:
    """The walk sees the tree as pyproject maps it (a guard against checking nothing)."""
    modules = find_modules()
    for name in ("ncina.cli", "ncina.proto.nc8", "ncina.proto.compressors.base",
                 "ncina.worker.client", "ncina.aggregator.backends.python.slots",
                 "ncina.topo.runner", "ncina.harness.fuzzing", "ncina.bench.allreduce",
                 "tests.ncina_testlib"):
        assert name in modules, name
    assert not any(".__pycache__" in name for name in modules)


def test_relative_and_from_imports_resolve(tmp_path: Path) -> None:
    """``from . import x``, ``from .a import b`` and ``from p import submodule`` name modules."""
    (tmp_path / "b.py").write_text(
        "from . import c\nfrom .c import thing\nfrom ncina.proto import nc8\n"
        "if TYPE_CHECKING:\n    import ncina.worker\n"
        "def f():\n    import ncina.aggregator\n"
        "class K:\n    import ncina.topo\n"
    )
    modules = {"pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py", "ncina.proto.nc8": Path()}
    found = {(i.target, i.module_level) for i in imports_of("pkg.b", modules)}
    assert found == {
        ("pkg.c", True), ("ncina.proto.nc8", True), ("ncina.worker", False),
        ("ncina.aggregator", False), ("ncina.topo", True),
    }


def test_find_cycle_reports_the_path() -> None:
    assert find_cycle({"a": ["b"], "b": ["c"], "c": []}) is None
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["a"]}) == ["a", "a"]


def test_layer_rules() -> None:
    """No module imports what its layer must not depend on (``RULES``)."""
    modules, graph = import_graph()
    broken = [
        f"{modules[module].relative_to(ROOT)}:{imp.line}: {module} imports {imp.target} "
        f"({rule.why})"
        for rule in RULES
        for module, imports in graph.items() if under(module, rule.importer)
        for imp in imports if under(imp.target, rule.forbidden)
    ]
    assert not broken, "\n".join(broken)


def test_no_import_cycle() -> None:
    """Module-level imports form no cycle (each module can be loaded on its own, in any order)."""
    modules, graph = import_graph()
    edges = {
        module: sorted({i.target for i in imports if i.module_level and i.target in modules})
        for module, imports in graph.items()
    }
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def layer_of(module: str) -> str | None:
    """The layer (of ``FLOORS``) ``module`` belongs to: the longest one it is under."""
    layers = [layer for floor in FLOORS for layer in floor if under(module, layer)]
    return max(layers, key=len, default=None)


def layer_graph() -> dict[str, dict[str, list[str]]]:
    """Layer -> layer it imports -> the imports that make the edge (``file:line: a imports b``).
    Every import counts, lazy ones too; a layer's imports of itself are left out."""
    modules, graph = import_graph()
    edges: dict[str, dict[str, list[str]]] = {layer: {} for floor in FLOORS for layer in floor}
    for module, imports in graph.items():
        source = layer_of(module)
        for imp in imports:
            target = layer_of(imp.target)
            if source and target and source != target:
                edges[source].setdefault(target, []).append(
                    f"{modules[module].relative_to(ROOT)}:{imp.line}: {module} imports {imp.target}"
                )
    return edges


def test_every_module_is_on_a_floor() -> None:
    """Each module of the package is in a layer of ``FLOORS`` (a new folder gets its floor)."""
    modules = find_modules()
    assert not [m for m in modules if not under(m, TESTS) and layer_of(m) is None]
    assert [layer_of(m) for m in ("ncina.cli", "ncina.common.cbuild", "ncina.topo.runner",
                                  "ncina.aggregator.engine")] == [
        "ncina", "ncina.common", "ncina.topo", "ncina.aggregator"]  # fmt: skip


def test_layers_import_only_lower_floors() -> None:
    """The layers import each other without a loop, and only downwards (``FLOORS``)."""
    edges = layer_graph()
    cycle = find_cycle({layer: sorted(targets) for layer, targets in edges.items()})
    assert cycle is None, "layers import each other: " + " -> ".join(cycle or ())
    floor = {layer: i for i, layers in enumerate(FLOORS) for layer in layers}
    upward = [
        f"{why} (floor {floor[source]} imports floor {floor[target]})"
        for source, targets in edges.items()
        for target, whys in targets.items() if floor[target] >= floor[source]
        for why in whys
    ]
    assert not upward, "\n".join(upward)


def names_defined(path: Path) -> set[str]:
    """The names ``path``'s module binds at its top level other than by importing them."""
    names: set[str] = set()
    for node, _ in walk_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def walk_statements(body: list[ast.stmt]) -> Iterator[tuple[ast.stmt, None]]:
    """The statements of a module's top level, into ``if``/``try``/``with`` blocks."""
    for node in body:
        yield node, None
        if isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    nested = isinstance(child, ast.excepthandler)
                    yield from walk_statements(child.body if nested else [child])


MODULE_STRING = re.compile(r"ncina(?:\.\w+)+(?=(?::\w+)?\Z)")


def test_every_ncina_name_resolves_through_the_package_map() -> None:
    """What a reader (or a tool drawing the imports) follows with pyproject's package map alone:
    every imported ``ncina.*`` module is a file of the tree, every module a string names for
    ``importlib`` or ``python -m`` too, every name imported from a plain module is defined in
    it (no re-export), and no module forwards names with a module-level ``__getattr__``."""
    modules, graph = import_graph()
    packages = {m for m, path in modules.items() if path.name == "__init__.py"}
    defined: dict[str, set[str]] = {}
    broken = []
    for module, path in modules.items():
        where = path.relative_to(ROOT)
        broken += [f"{where}:{i.line}: no module {i.target}" for i in graph[module]
                   if under(i.target, "ncina") and i.target not in modules]  # fmt: skip
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            named = isinstance(node, ast.Constant) and MODULE_STRING.match(str(node.value))
            # A string under a package of the tree names a module or a module's name (a file
            # name like "ncina.p4", a Wireshark field "ncina.code" is none).
            if named and ".".join(named.group(0).split(".")[:2]) in modules:
                parent, _, name = named.group(0).rpartition(".")
                if named.group(0) not in modules and not (
                    parent in modules and name in names_defined(modules[parent])
                ):
                    broken.append(f"{where}:{node.lineno}: no module {named.group(0)}")
        for node, _ in walk_statements(tree.body):
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                broken.append(f"{where}:{node.lineno}: a module-level __getattr__")
            if not (isinstance(node, ast.ImportFrom) and node.module in modules) or node.level:
                continue
            if node.module in packages:
                continue  # a package's __init__ may gather its own modules' names
            names = defined.setdefault(node.module, names_defined(modules[node.module]))
            broken += [
                f"{where}:{node.lineno}: {alias.name} is imported from {node.module}, which only "
                f"imports it" for alias in node.names
                if alias.name not in names and f"{node.module}.{alias.name}" not in modules
            ]
    assert not broken, "\n".join(broken)
