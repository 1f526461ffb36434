"""Does triton take a NamedTuple as one ``tl.constexpr``? The probe behind ``triton/flags.py`` (README: "The flags
record"). A 20-line kernel reads a record ``P`` (a static ``if P.NEGATE:``, a ``@triton.jit`` function in
``P.MOD`` called, an int ``P.ADD``) and passes it whole to a helper; its twin takes the same three as constexprs
of their own. For four records the probe asks the JIT for each (:func:`requests_for`, nothing launched) and
compiles both for sm_90: the JIT's cache key must differ between records, and the record's SASS must equal the
twin's. Run without TRITON_INTERPRET, with any triton:

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/results/kernel_args/flags_probe.py
    PYTHONPATH=$PWD/src /work/scratch/t36/bin/python benchmarks/results/kernel_args/flags_probe.py
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
from triton import language as tl
from triton.runtime.jit import JITFunction

from flashattn_teach.tools.kernels.specialize import capture


class Probe(NamedTuple):
    NEGATE: bool
    MOD: Any  # a @triton.jit function or None
    ADD: int


@triton.jit
def plus_one(x):
    return x + 1.0


@triton.jit
def _inner_record(x, P: tl.constexpr):
    if P.MOD is not None:
        x = P.MOD(x)
    if P.ADD > 0:
        x = x + P.ADD
    return x


@triton.jit
def with_record(X, Y, P: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    if P.NEGATE:
        x = -x
    tl.store(Y + offs, _inner_record(x, P))


@triton.jit
def _inner_flat(x, MOD: tl.constexpr, ADD: tl.constexpr):
    if MOD is not None:
        x = MOD(x)
    if ADD > 0:
        x = x + ADD
    return x


@triton.jit
def with_flags(X, Y, NEGATE: tl.constexpr, MOD: tl.constexpr, ADD: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    if NEGATE:
        x = -x
    tl.store(Y + offs, _inner_flat(x, MOD, ADD))


def main() -> None:
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty_like(x)
    records = [Probe(False, None, 0), Probe(True, None, 0), Probe(True, plus_one, 0), Probe(True, plus_one, 64)]
    keys: list[str] = []
    sass: list[str] = []
    with capture("sm90") as requests:
        record_compile = JITFunction._do_compile  # capture's stand-in; note each cache key it is given

        def note_key(self, key, *args):
            keys.append(key)
            return record_compile(self, key, *args)

        JITFunction._do_compile = note_key
        for p in [*records, Probe(True, None, 0)]:  # the last, an equal record: the same key
            with_record[(1,)](x, y, p, N=16)
        for p in records:
            with_flags[(1,)](x, y, *p, N=16)
    print(
        f"triton {triton.__version__}: the record kernel's cache keys for 4 records: {len(set(keys[:4]))} distinct;",
        end=" ",
    )
    print(f"an equal record's key is the same: {keys[4] == keys[1]}")
    for i, p in enumerate(records):
        # the two kernels' names aside (the SASS names its function)
        a = requests[i].compile().asm["sass"].replace("with_record", "kernel")
        b = requests[5 + i].compile().asm["sass"].replace("with_flags", "kernel")
        sass.append(a)
        print(f"  {p}: record's SASS == the flat twin's: {a == b} ({len(a.splitlines())} lines)")
    print(f"  distinct SASS over the four records: {len(set(sass))}")


if __name__ == "__main__":
    main()
