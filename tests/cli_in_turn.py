"""Several ``flashattn-teach`` commands run in turn in one subprocess, for the ahead-of-time compile tests.

Why: each subprocess of a compile test imports torch and triton before it compiles anything, about 2-3 s of
CPU; a test file that started one per command (up to 16 at once) spent more CPU on imports than on its
compiles once triton's cache and ``sass_cache`` were warm. Commands that run in one process share nothing
but the imports: each is a fresh ``flashattn_teach.cli.main(argv)``, its printed table and exit status kept
apart (an exception ends that command, not the others: its table ends with the traceback, its status -1;
argparse's exit gives its status).

Use: ``run_in_turn({key: argv, ...}, group=...)`` starts one process per group of keys (all at once, under
``sass_cache``, without ``TRITON_INTERPRET``) and returns ``{key: (table, stderr, exit status)}``, the stderr
being the whole process's. ``run_shared({key: argv, ...}, processes=P)`` starts ``P`` processes that take the
commands in the given order, each the next one no process has claimed yet (a file created exclusively in a
shared folder), so that they finish within about one command of each other whatever each command costs
(put the longest first); a command's stderr is that of the process that ran it. Each process writes a line
to its stderr before each command it runs (``cli_in_turn: process PID runs flashattn-teach ARGV``).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable, Hashable

from sass_cache import AOT_PYTHON, aot_env

IN_TURN = """
import contextlib, io, json, os, sys, traceback
from flashattn_teach.cli import main
claims = sys.argv[2] if len(sys.argv) > 2 else None  # run_shared's folder: one file per command taken
for index, argv in json.loads(sys.argv[1]):
    if claims is not None:
        try:
            os.close(os.open(os.path.join(claims, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another process took it
    print(f"cli_in_turn: process {os.getpid()} runs flashattn-teach {' '.join(argv)}", file=sys.stderr, flush=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's errors and --version
            code = stop.code if isinstance(stop.code, int) else 1
        except Exception:
            print(traceback.format_exc())
            code = -1
    print(json.dumps({"index": index, "code": code, "out": out.getvalue()}), flush=True)
"""


def run_in_turn(
    commands: dict[Hashable, list[str]], group: Callable[[Hashable], Hashable], timeout: float = 3600, **env: str
) -> dict[Hashable, tuple[str, str, int | None]]:
    """``{key: (table, stderr, exit status)}`` of ``flashattn-teach ARGV`` for each ``key: ARGV``, the keys
    with the same ``group(key)`` run in turn in one process; a command that never finished (its process died)
    gets exit status None."""
    keys = list(commands)
    shares: dict[Hashable, list[tuple[int, list[str]]]] = {}
    for index, key in enumerate(keys):
        shares.setdefault(group(key), []).append((index, commands[key]))
    return _run(keys, list(shares.values()), None, timeout, env)


def run_shared(
    commands: dict[Hashable, list[str]], processes: int, timeout: float = 3600, **env: str
) -> dict[Hashable, tuple[str, str, int | None]]:
    """``{key: (table, stderr, exit status)}`` of ``flashattn-teach ARGV`` for each ``key: ARGV``, run by
    ``processes`` processes that each take the next command not yet taken, in the order given; a command
    that never finished (its process died) gets exit status None."""
    keys = list(commands)
    every = [(index, commands[key]) for index, key in enumerate(keys)]
    with tempfile.TemporaryDirectory(prefix="cli_in_turn") as claims:
        return _run(keys, [every] * processes, claims, timeout, env)


def _run(
    keys: list[Hashable], shares: list[list[tuple[int, list[str]]]], claims: str | None, timeout: float, env: dict
) -> dict[Hashable, tuple[str, str, int | None]]:
    """Start one process per share at once (each told the claims folder, if any), then gather the results."""
    started = [
        subprocess.Popen(
            [*AOT_PYTHON, "-c", IN_TURN, json.dumps(share), *([claims] if claims else [])],
            env=aot_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for share in shares
    ]
    results: dict[Hashable, tuple[str, str, int | None]] = {}
    unfinished: dict[Hashable, str] = {}  # key -> the stderr of each process that could have run it
    for share, process in zip(shares, started, strict=True):
        out, err = process.communicate(timeout=timeout)
        for line in map(json.loads, filter(lambda s: s.startswith("{"), out.splitlines())):
            if keys[line["index"]] in results:  # run_shared's claims failed: a command was run twice
                raise RuntimeError(f"{keys[line['index']]!r} ran in two processes:\n{err}")
            results[keys[line["index"]]] = (line["out"], err, line["code"])
        for index, _ in share:
            unfinished[keys[index]] = unfinished.get(keys[index], "") + err
    for key, err in unfinished.items():
        results.setdefault(key, ("", err, None))
    return results
