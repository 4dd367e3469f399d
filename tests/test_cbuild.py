"""``python -m ncina.cbuild`` (run by ``make venv``) builds every C extension of the package."""

from __future__ import annotations

import pytest

from ncina import cbuild


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
