"""The ``ncina`` command: one subcommand per module, each module owning its parser and handler.

A command module exposes ``add_parser(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``. Modules are imported only when their command runs (or for ``--help``), so a
missing optional dependency (PyTorch, DPDK) only affects the command that needs it.

One concept has one option name in every command (``tests/test_cli_options.py`` holds the table);
a renamed option keeps its old name for one release through ``deprecated_alias``
(``ncina.common.options``). Nothing imports this module but the console script
(tests/test_imports.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback

# name -> module; the order is the order of `ncina --help`.
COMMANDS: dict[str, str] = {
    "aggregator": "ncina.aggregator.cli",
    "allreduce": "ncina.worker.cli",
    "bench": "ncina.bench",
    "train": "ncina.worker.train",
    "topo": "ncina.topo.cli",
    "soak": "ncina.bench.soak_cli",
}


def build_parser() -> argparse.ArgumentParser:
    """Build the full parser, with every subcommand's own options."""
    parser = argparse.ArgumentParser(
        prog="ncina",
        description="In-network aggregation emulator with natural compression (NC8).",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="log at DEBUG level and print the traceback of an error (ncina --debug COMMAND ...)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        mod = importlib.import_module(module)
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
        assert p.prog.endswith(name), f"{module} registered {p.prog}, expected {name}"
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.debug:
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s: %(message)s")
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError, TimeoutError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"ncina {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
