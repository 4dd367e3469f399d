"""A file of JSON events, one a line, read as it grows (a rank's metrics file while it trains)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_new_events(path: Path, offset: int) -> tuple[int, list[dict[str, Any]]]:
    """The events of the whole lines ``path`` gained past byte ``offset`` (a line still being
    written waits for the next call; blank lines are skipped), and the offset after them. A file
    not written yet has none."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read()
    except FileNotFoundError:
        return offset, []
    end = text.rfind(b"\n") + 1
    lines = text[:end].decode(errors="replace").splitlines()
    return offset + end, [json.loads(line) for line in lines if line.strip()]
