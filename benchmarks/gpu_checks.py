"""Run the GPU checks of ``tests/triton/gpu_cases.py`` without pytest: for a bare GPU machine.

    python benchmarks/gpu_checks.py               # every check
    python benchmarks/gpu_checks.py -k d128 fp32  # only checks whose name contains one of the words

Prints one line per check (PASS or FAIL, seconds, name, and the reason of a failure), then a summary and the
number of kernel specialisations Triton compiled. Exit status 1 if any check failed, else 0; without CUDA it
says so and exits 0, having run nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "triton"))
if importlib.util.find_spec("flashattn_teach") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402


def compiled_kernels() -> dict[str, int]:
    """Per launched kernel, how many specialisations Triton's JIT holds compiled (all devices)."""
    from triton.runtime.jit import JITFunction

    from flashattn_teach.triton.kernels import backward, backward_dkdv, backward_dq, decode, forward

    counts = {}  # by name: a helper imported into several kernel modules is one JIT function, counted once
    for module in (forward, backward, backward_dkdv, backward_dq, decode):
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                # device_caches: device -> (kernel cache, ...); the tuple's length differs across triton versions
                n = sum(len(entry[0]) for entry in getattr(fn, "device_caches", {}).values())
                if n:
                    counts[name] = n
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", nargs="+", default=[], metavar="WORD", help="run only checks whose name contains a WORD")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is absent (torch.cuda.is_available() is False): no GPU check run")
        return 0

    import gpu_cases
    import graph_cases
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    every = gpu_cases.all_checks() + graph_cases.graph_checks()
    checks = [(name, run) for name, run in every if not args.k or any(w in name for w in args.k)]
    failed = []
    start = time.perf_counter()
    for name, run in checks:
        t0 = time.perf_counter()
        try:
            run()
            outcome = "PASS"
        except Exception as e:  # an error is a failure too; the line says which kind
            outcome = "FAIL"
            where = traceback.extract_tb(e.__traceback__)[-1]
            reason = f"{type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})"
            failed.append(name)
        print(f"{outcome} {time.perf_counter() - t0:6.2f} s  {name}" + (f"  {reason}" if outcome == "FAIL" else ""))
        sys.stdout.flush()
    seconds = time.perf_counter() - start
    try:
        kernels = compiled_kernels()
        per_kernel = ", ".join(f"{name} {n}" for name, n in kernels.items())
        compiled = f"{sum(kernels.values())} specialisations compiled ({per_kernel})"
    except Exception as e:  # the JIT's cache layout is triton's private business: report, do not fail
        compiled = f"compiled specialisations unknown ({type(e).__name__}: {e})"
    for name in failed:
        print(f"FAILED {name}")
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed in {seconds:.1f} s; {compiled}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
