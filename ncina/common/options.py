"""Command-line helpers that every command shares.

One concept has one option name in every command (``tests/test_cli_options.py`` holds the
table); a renamed option keeps its old name for one release through :func:`deprecated_alias`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


class DeprecatedAlias(argparse.Action):
    """An option's old name: does what the ``canonical`` action does with the same value, after
    one line on stderr naming the new option. Hidden from ``--help``."""

    def __init__(self, option_strings: list[str], dest: str, canonical: argparse.Action) -> None:
        super().__init__(option_strings, canonical.dest, nargs=canonical.nargs,
                         default=argparse.SUPPRESS, type=canonical.type, choices=canonical.choices,
                         help=argparse.SUPPRESS, metavar=canonical.metavar)  # fmt: skip
        self.canonical = canonical

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is deprecated and goes in the next release; "
              f"use {self.canonical.option_strings[0]}", file=sys.stderr)  # fmt: skip
        self.canonical(parser, namespace, values, option_string)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, canonical: argparse.Action) -> None:
    """Accept ``old`` as a deprecated spelling of ``canonical`` (an action of ``parser``)."""
    parser.add_argument(old, action=DeprecatedAlias, canonical=canonical)


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
