"""Several ``flashattn-teach`` commands run in turn in one subprocess, for the ahead-of-time compile tests.

Why: each subprocess of a compile test imports torch and triton before it compiles anything, about 2-3 s of
CPU; a test file that started one per command (up to 16 at once) spent more CPU on imports than on its
compiles once triton's cache and ``sass_cache`` were warm. Commands that run in one process share nothing
but the imports: each is a fresh ``flashattn_teach.cli.main(argv)``, its printed table and exit status kept
apart (an exception ends that command, not the others: its table ends with the traceback, its status -1;
argparse's exit gives its status).

Use: ``run_in_turn({key: argv, ...}, group=...)`` starts one process per group of keys (all at once, under
``sass_cache``, without ``TRITON_INTERPRET``) and returns ``{key: (table, stderr, exit status)}``, the stderr
being the whole process's.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Hashable

from sass_cache import AOT_PYTHON, aot_env

IN_TURN = """
import contextlib, io, json, sys, traceback
from flashattn_teach.cli import main
for index, argv in json.loads(sys.argv[1]):
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
    processes = [
        subprocess.Popen(
            [*AOT_PYTHON, "-c", IN_TURN, json.dumps(share)],
            env=aot_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for share in shares.values()
    ]
    results: dict[Hashable, tuple[str, str, int | None]] = {}
    for share, process in zip(shares.values(), processes, strict=True):
        out, err = process.communicate(timeout=timeout)
        done = {line["index"]: line for line in map(json.loads, filter(lambda s: s.startswith("{"), out.splitlines()))}
        for index, _ in share:
            line = done.get(index, {"out": "", "code": None})
            results[keys[index]] = (line["out"], err, line["code"])
    return results
