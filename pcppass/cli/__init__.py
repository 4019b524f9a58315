"""The ``pcppass`` command line: ``pcppass audit``, ``pcppass run``, ``pcppass bench``.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds its parser and
sets ``func`` (taking the parsed namespace, returning the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("audit", "run", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pcppass",
        description="Decode sharding across PCP ranks: audit state writes, run sharded decode, benchmark.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"pcppass.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"pcppass.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
