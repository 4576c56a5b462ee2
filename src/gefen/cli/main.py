"""Entry point of the ``gefen`` command: argparse here, one module per sub-command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gefen._version import __version__


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(prog="gefen", description="Gefen: memory-efficient PyTorch optimizers.")
    parser.add_argument("--version", action="version", version=f"gefen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from gefen.cli import capacity, demo, find_lr, inspect_cmd

    demo.add_parser(sub)
    inspect_cmd.add_parser(sub)
    find_lr.add_parser(sub)
    capacity.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gefen`` command line; returns the process exit code (0 on success)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
