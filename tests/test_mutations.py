"""The mutation check (``tools/mutation_check.py``): each test that guards a known hole fails
when the hole is made, in a temporary copy of the tree. The quick mutations run here (seconds
each); the heavy ones (a training run, the sanitized build) when the script runs alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "mutation_check.py"
_SPEC = importlib.util.spec_from_file_location("mutation_check", _SCRIPT)
assert _SPEC is not None and _SPEC.loader is not None
mutation_check = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = mutation_check  # dataclasses look their module up by name
_SPEC.loader.exec_module(mutation_check)

QUICK = [m for m in mutation_check.MUTATIONS if not m.heavy]


def test_every_mutation_applies_exactly_once() -> None:
    """Each mutation's text is still in its file, once (else the code moved under it)."""
    root = mutation_check.ROOT
    for m in mutation_check.MUTATIONS:
        assert (root / m.path).read_text().count(m.old) == 1, m.name


@pytest.mark.slow
@pytest.mark.parametrize("mutation", QUICK, ids=[m.name for m in QUICK])
def test_the_mutation_is_caught(mutation: mutation_check.Mutation) -> None:
    caught, summary = mutation_check.run(mutation)
    assert caught, f"{mutation.name} ({mutation.why}) was not caught: {summary}"
