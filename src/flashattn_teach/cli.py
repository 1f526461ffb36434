"""The ``flashattn-teach`` command.

Each subcommand lives in the module that owns its concept and provides ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so ``--help`` stays fast and
never imports Triton.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("flashattn_teach.demo", "reproduce the teaching example: dense vs tiled attention"),
    "replay": ("flashattn_teach.trace.cli", "replay one query block's tile updates: table, JSON, HTML or PNG"),
    "kernels": ("flashattn_teach.triton.inspect", "compile the Triton kernels ahead of time and report resources"),
    "iomodel": ("flashattn_teach.iomodel", "HBM traffic and FLOPs of standard vs tiled attention"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="flashattn-teach", description="Exact attention, one tile at a time.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text)
    # Parse the command name first, then let its module add its own arguments.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    if known.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(COMMANDS[known.command][0])
    cmd_parser = argparse.ArgumentParser(
        prog=f"flashattn-teach {known.command}", description=COMMANDS[known.command][1]
    )
    module.add_arguments(cmd_parser)
    return module.run(cmd_parser.parse_args(argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
