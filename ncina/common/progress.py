"""Progress bars for long work (p4c compiles, benchmark runs), on stderr and only on a terminal.

``tqdm(disable=None)`` turns itself off when its stream is not a TTY, so logs in CI and files a
run's stderr goes to stay free of carriage-return noise; on a terminal a first p4c compile or a
``--repeat 5`` benchmark shows that it is moving and how far it got. The bars do not stay once
done (``leave=False``): the figures a command prints are what remains.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(iterable: Iterable[T] | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr (``desc``, ``total``, ``unit`` ... as tqdm takes them), off unless
    stderr is a terminal. Iterate over it as over ``iterable``, or ``update`` it by hand."""
    return tqdm(iterable, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True, **kwargs)
