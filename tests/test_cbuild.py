"""``python -m ncina.common.cbuild`` (run by ``make venv``) builds every C extension of the
package."""

from __future__ import annotations

from pathlib import Path

import pytest

from ncina.common import cbuild


def test_build_all_builds_or_names_why_not(capsys: pytest.CaptureFixture[str]) -> None:
    assert cbuild.build_all() == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(cbuild.EXTENSIONS)
    assert lines[0] == "ncina cbuild: NC8 codec: ready"
    for line, (what, _, _) in zip(lines, cbuild.EXTENSIONS, strict=True):
        assert line.startswith(f"ncina cbuild: {what}: ")
        assert line.endswith(": ready") or ": skipped (" in line


def test_a_failed_build_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken() -> None:
        raise RuntimeError("no C compiler found")

    monkeypatch.setattr(cbuild, "EXTENSIONS", (("broken", "anywhere:broken", None),))
    monkeypatch.setattr(cbuild, "_resolve", lambda target: broken)
    assert cbuild.build_all() == 1
    assert "ncina cbuild: broken: FAILED: no C compiler found" in capsys.readouterr().err


def test_sanitizer_flags_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cbuild.SANITIZE_ENV, raising=False)
    assert cbuild._sanitizer_flags() == ([], [])
    monkeypatch.setenv(cbuild.SANITIZE_ENV, "address,undefined")
    compile_flags, link_flags = cbuild._sanitizer_flags()
    assert "-fsanitize=address,undefined" in compile_flags and "-fno-sanitize-recover=all" in (
        compile_flags
    )
    assert link_flags == ["-fsanitize=address,undefined"]
    monkeypatch.setenv(cbuild.SANITIZE_ENV, "address; rm -rf /")
    with pytest.raises(RuntimeError, match="is not a list"):
        cbuild._sanitizer_flags()


def test_a_build_on_first_use_says_so_once_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A package installed without ``make venv`` compiles on first use: one line on stderr says
    so and names the cache, so that the first call does not look hung; a cached build is quiet."""
    monkeypatch.setenv("NCINA_CACHE", str(tmp_path))
    source = tmp_path / "twice.c"
    source.write_text("#include <stdint.h>\nint64_t twice(int64_t x) { return 2 * x; }\n")
    cdef = "int64_t twice(int64_t x);"
    module = cbuild.build_extension("ncina_test_twice", cdef, [source])
    assert module.lib.twice(21) == 42
    (build_dir,) = tmp_path.glob("ncina_test_twice-*")
    assert capsys.readouterr().err == (
        f"ncina: compiling C extension ncina_test_twice (once; cached in {build_dir})\n"
    )
    assert cbuild.build_extension("ncina_test_twice", cdef, [source]).lib.twice(-4) == -8
    assert capsys.readouterr().err == ""
