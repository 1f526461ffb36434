"""Every example runs as a user runs it, in a fresh interpreter at small sizes, and prints what its docstring
says: tokens equal to eager attention's, losses that track torch's SDPA, one compiled graph, decode errors
below tolerance. The examples also exit with an error when their own check fails."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, timeout: float = 300) -> str:
    """The stdout of ``python argv...`` from the repository root; ``src`` on the path, so that a checkout
    works without an install (an editable install finds the same files)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{argv} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _number(pattern: str, out: str) -> float:
    found = re.search(pattern, out)
    assert found, f"{pattern!r} not in the output:\n{out}"
    return float(found.group(1))


def test_seed_example_dense_equals_tiled():
    out = _run("examples/01_seed_example.py")
    assert "output shape: [2, 1, 6, 4]" in out
    assert _number(r"max \|dense - tiled\|: (\S+)", out) < 1e-6


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the [transformers] extra")
def test_llama_generation_with_left_padding_equals_eager():
    out = _run("examples/02_llama_generate_padding.py", "--new-tokens", "4", "--layers", "1")
    assert "attn_implementation: 'teach', compared with 'eager'" in out
    assert _number(r"max \|logits - eager\| on real tokens: (\S+)", out) < 1e-5
    rows = re.findall(r"row (\d) (flashattn_teach|eager): +(\[.*\])", out)
    assert len(rows) == 4
    by_row: dict[str, dict[str, str]] = {}
    for row, impl, tokens in rows:
        by_row.setdefault(row, {})[impl] = tokens
    assert all(r["flashattn_teach"] == r["eager"] for r in by_row.values())
    assert "tokens equal eager's: True" in out
    assert out.count("explain, ") == 2 and "attn_mask read tile by tile" in out


def _loss_table(out: str) -> list[tuple[int, float, float, float, float]]:
    """The GPT example's rows: step, mean losses (flashattn_teach, torch SDPA), their relative difference,
    the largest difference in one step."""
    rows = re.findall(r"^ *(\d+) +(\S+) +(\S+) +(\S+) +(\S+)$", out, flags=re.MULTILINE)
    return [(int(step), *map(float, values)) for step, *values in rows]


def test_small_gpt_losses_track_torch_sdpa():
    args = ("--steps", "8", "--every", "4", "--batch", "4", "--block", "16", "--layers", "1")
    out = _run("examples/03_train_small_gpt.py", *args)
    table = _loss_table(out)
    assert [row[0] for row in table] == [4, 8]
    # Over so few steps rounding has not grown yet: each step's losses agree far inside the example's
    # tolerance on the means (3e-2 relative); without the causal mask the first step already differs by 4e-3.
    assert all(largest < 1e-4 for *_, largest in table)
    assert table[-1][1] < table[0][1]  # it trains
    assert _number(r"largest relative difference: (\S+)", out) <= 3e-2
    assert "is_causal=True" in out and "parallel: " in out  # explain's line


def test_small_gpt_compiled_is_one_graph_for_every_length():
    args = ("--steps", "6", "--every", "2", "--batch", "2", "--block", "16", "--layers", "1")
    # aot_eager: dynamo and AOT autograd trace the same graph (the op, its fake and its backward) as inductor
    # does, without inductor's C++ compile, which would take most of this file's time budget.
    out = _run("examples/03_train_small_gpt.py", *args, "--compile", "--backend", "aot_eager")
    table = _loss_table(out)
    assert len(table) == 3 and all(largest < 1e-4 for *_, largest in table)
    graphs = re.search(r"backend='aot_eager'\): (\d+) graph\(s\) for (\d+) sequence lengths", out)
    assert graphs, out
    assert int(graphs.group(1)) == 1 and int(graphs.group(2)) >= 3


def test_decode_loop_matches_the_dense_oracle_at_every_step():
    args = ("--prompt-lens", "9,4", "--new-tokens", "3", "--max-len", "16", "--num-splits", "2")
    out = _run("examples/04_decode_loop.py", *args)
    steps = re.findall(r"^step (\d): cache_seqlens \[(\d+), (\d+)\]", out, flags=re.MULTILINE)
    assert steps == [("0", "9", "4"), ("1", "10", "5"), ("2", "11", "6")]
    assert _number(r"max error over 5 calls: (\S+)", out) < 1e-5
    assert out.count("explain, ") == 2 and out.count("2 key ranges per batch element") == 2
    assert "L_b = [10, 5] keys" in out and "run as 4 rows" in out  # the first step, G = 8 / 2 heads folded


def test_ring_attention_example_on_two_ranks():
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("with CUDA the example runs one rank per GPU (NCCL), and this machine has one")
    out = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "examples/ring_attention.py")
    errors = re.findall(r"max error (O|dQ|dK|dV) +(\S+)", out)
    assert [name for name, _ in errors] == ["O", "dQ", "dK", "dV"]
    assert all(float(e) < 1e-12 for _, e in errors)


def test_flex_example_matches_the_oracle_and_torch_and_trains_the_bias():
    out = _run("examples/05_flex_document_masking.py", "--n", "256")
    assert _number(r"ours - float64 oracle\| = (\S+)", out) < 1e-4
    assert _number(r"relative error against the oracle = (\S+)", out) < 1e-4
    assert _number(r"ours - torch.nn.attention.flex_attention\| = (\S+)", out) < 1e-4
    losses = [float(x) for x in re.search(r"loss while training the bias: (.*)", out).group(1).split()]
    assert losses[-1] < 0.5 * losses[0]
    assert "check: ok" in out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the kernel rungs need the [triton] extra")
def test_ladder_example_climbs_every_rung_within_tolerance():
    out = _run("examples/07_ladder.py", "--n", "45", "--causal")
    assert _number(r"max \|key-major - float64 dense\| = (\S+)", out) < 1e-5
    rungs = re.findall(r"^(\d) [a-z -]+? +\d+x\d+=\d+ .* (\S+)$", out, flags=re.MULTILINE)
    assert [n for n, _ in rungs] == ["1", "2", "3", "4", "5"], out
    assert all(float(err) < 2e-5 for _, err in rungs)
    assert "check: ok, 5 of 5 rungs" in out


# A notebook's code cells in order, as Jupyter runs them (without Jupyter): a cell's last expression is
# displayed, by its _repr_html_ when it has one. A committed notebook carries no outputs.
RUN_NOTEBOOK = """
import ast, json, sys
cells = json.load(open(sys.argv[1], encoding="utf-8"))["cells"]
ns = {"__name__": "__main__"}
for n, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
    assert not cell["outputs"] and cell["execution_count"] is None, f"code cell {n} has outputs: clear them"
    tree = ast.parse("".join(cell["source"]))
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, f"<cell {n}>", "exec"), ns)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), f"<cell {n}>", "eval"), ns)
        if hasattr(value, "_repr_html_"):
            print(f"[cell {n} displays HTML: {value._repr_html_()[:60]}]")
        elif value is not None:
            print(f"[cell {n} displays {value!r:.60}]")
"""


def test_tile_replay_notebook_runs_and_ends_at_float64_gradients():
    out = _run("-c", RUN_NOTEBOOK, "examples/06_tile_replay.ipynb")
    assert len(re.findall(r"^tile \(i=0, j=\d\)  m_i=", out, flags=re.MULTILINE)) == 3  # block 0: three updates
    assert _number(r"max \|O_online - O_dense\| over every block: (\S+)", out) < 1e-12
    assert re.search(r"\[cell \d+ displays HTML: <iframe title=\"Tile replay\" sandbox=\"allow-scripts\"", out), out
    assert "The error shrinks to zero at the last tile" in out  # the rich table
    for name in ("dQ", "dK", "dV"):
        assert _number(rf"max \|{name} - autograd\| = (\S+)", out) < 1e-12
    assert "check: ok" in out
