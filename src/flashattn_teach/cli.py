"""The ``flashattn-teach`` command.

Each subcommand lives in the module that owns its concept and provides ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so ``--help`` stays fast and
never imports Triton. Every parser comes from :mod:`flashattn_teach._cli_types`: a bad option or value is
one line on stderr and exit status 2. A library the command needs that is not installed (matplotlib for
``--format png``, triton for the kernels' compile: :mod:`flashattn_teach._optional`) is one line naming the
extra to install, exit status 1.
"""

from __future__ import annotations

import importlib
import os
import sys

from . import __version__
from ._cli_types import ArgumentParser
from ._optional import EXTRAS, MissingLibrary, missing

COMMANDS = {
    "demo": ("flashattn_teach.demo", "reproduce the teaching example: dense vs tiled attention"),
    "replay": ("flashattn_teach.replay.cli", "replay the tile updates: forward, backward or decode"),
    "kernels": ("flashattn_teach.tools.kernels", "compile the Triton kernels ahead of time and report resources"),
    "kernels-decode": ("flashattn_teach.tools.kernels.decode", "the decode kernels' ahead-of-time compile report"),
    "kernels-fp8": ("flashattn_teach.tools.kernels.fp8", "the FP8 forward's ahead-of-time compile report (sm_90)"),
    "iomodel": ("flashattn_teach.tools.iomodel", "HBM traffic and FLOPs of standard vs tiled attention"),
    "ladder": ("flashattn_teach.ladder", "dense attention to the production kernel, each rung checked"),
}
EXIT_SIGPIPE = 128 + 13  # what a shell reports for a writer killed by SIGPIPE (signal 13)
EXIT_MISSING_LIBRARY = 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(prog="flashattn-teach", description="Exact attention, one tile at a time.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text)
    # The top-level parser takes everything up to the command name, strictly (an unknown option or command
    # exits 2); the command's own parser takes the rest.
    split = next((n + 1 for n, arg in enumerate(argv) if not arg.startswith("-")), len(argv))
    command = parser.parse_args(argv[:split]).command
    if command is None:
        parser.print_help()
        return 0
    try:
        return _run(command, argv[split:])
    except MissingLibrary as problem:
        print(f"flashattn-teach {command}: {problem}", file=sys.stderr)
        return EXIT_MISSING_LIBRARY
    except ModuleNotFoundError as problem:
        # one the command did not require() up front: still one line, if it is an optional library
        if problem.name not in EXTRAS:
            raise
        print(f"flashattn-teach {command}: {missing(problem.name, 'this command', problem)}", file=sys.stderr)
        return EXIT_MISSING_LIBRARY


def _run(command: str, argv: list[str]) -> int:
    """Parse ``argv`` with ``command``'s own parser and run it; its exit status."""
    module_name, description = COMMANDS[command]
    module = importlib.import_module(module_name)
    cmd_parser = ArgumentParser(prog=f"flashattn-teach {command}", description=description)
    module.add_arguments(cmd_parser)
    if hasattr(module, "normalize_argv"):  # replay: the old spelling, before its subcommands, with a warning
        argv = module.normalize_argv(argv)
    args = cmd_parser.parse_args(argv)
    try:
        status = module.run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, rather than at exit
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly. stdout still holds unwritten bytes, so point it at
        # devnull, or the flush at exit raises again (Python's docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGPIPE
    return int(status)


if __name__ == "__main__":
    raise SystemExit(main())
