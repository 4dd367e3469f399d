"""Progress bars show on a terminal's stderr and nowhere else (CI logs stay clean)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from ncina.cli import main
from ncina.common.progress import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_yields_every_item_and_is_silent_off_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert list(progress(range(5), desc="work")) == [0, 1, 2, 3, 4]
    assert capsys.readouterr() == ("", "")


def test_a_bar_shows_on_a_terminal_and_is_cleared_when_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progress(range(3), desc="work", unit="run")) == [0, 1, 2]
    shown = terminal.getvalue()
    # Drawn at the start (later redraws are throttled by time), wiped at the end (leave=False:
    # the figures a command prints stay alone).
    assert shown.startswith("\rwork:   0%|") and "| 0/3 [" in shown
    assert shown.endswith("\r") and shown.rsplit("\r", 2)[1].strip() == ""


def test_a_benchmark_shows_its_repeats_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "codec", "--elements", "4096", "--repeat", "2", "--impl", "numpy",
            "--output", str(tmp_path / "codec.jsonl")]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().err == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 0
    shown = terminal.getvalue()
    assert shown.startswith("\rbench codec:   0%|") and "| 0/2 [" in shown
