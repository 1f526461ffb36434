"""A backward replay in the terminal (rich): the preprocess, every dK/dV step, every dQ step, then the error.

Each step is a panel: its tile ``(i, j)`` and kind, then each equation of the step (FA2 Alg. 2 line,
``name = symbolic``) with its numbers put in and its result. The last table compares each gradient with the
float64 ``torch.autograd`` oracle (:meth:`~flashattn_teach.replay.backward_replay.BackwardReplay.oracle`).
Every step is drawn: a backward replay is meant to be small (``--format json`` for a long one).
"""

from __future__ import annotations

from typing import IO

from .backward_replay import BackwardEquation, BackwardPass, BackwardReplay, BackwardStep
from .manifest import span

PASS_TITLES = {BackwardPass.DKDV: "dK/dV pass", BackwardPass.DQ: "dQ pass"}


def _equations(eqs: list[BackwardEquation]):
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_header=True)
    table.add_column("line", justify="right", style="dim")
    table.add_column("equation")
    table.add_column("with the numbers", overflow="fold")
    for eq in eqs:
        table.add_row("" if eq.line is None else str(eq.line), f"{eq.name} = {eq.symbolic}", eq.substituted)
    return table


def _step_panel(step: BackwardStep, count: int):
    from rich.panel import Panel

    (r0, r1), (c0, c1) = step.rows, step.cols
    title = (
        f"{PASS_TITLES[step.pass_name]} · step {step.index + 1} of {count} · tile (i={step.i}, j={step.j}) · "
        f"query rows {span(r0, r1)} · key columns {span(c0, c1)} · {step.kind.name}"
    )
    return Panel(_equations(step.equations), title=title, title_align="left")


def _errors(br: BackwardReplay):
    from rich.table import Table

    table = Table(title="Gradients against float64 torch.autograd of dense attention")
    for column in ("gradient", "shape", "max |grad - oracle|"):
        table.add_column(column, justify="right")
    mine = br.gradients()
    for name, error in br.max_error().items():
        table.add_row(name, "x".join(map(str, mine[name].shape)), f"{error:.3e}")
    return table


def render_backward_table(br: BackwardReplay, file: IO[str] | None = None, *, width: int = 160) -> None:
    """Print ``br`` to ``file`` (default stdout): preprocess, the dK/dV steps, the dQ steps, the errors."""
    from rich.console import Console
    from rich.panel import Panel

    console = Console(file=file, width=width, highlight=False)
    N_q, N_k = br.q.shape[0], br.k.shape[0]
    extras = [f"softcap {br.softcap:g}"] if br.softcap is not None else []
    extras += [f"sink {float(br.sink[0]):g}"] if br.sink is not None else []
    console.print(
        f"[bold]Backward replay[/bold] (FlashAttention-2 Alg. 2) · batch element {br.batch_index} · N_q={N_q}, "
        f"N_k={N_k} · BLOCK_M={br.block_m}, BLOCK_N={br.block_n} · scale {br.scale:.4g}"
        + "".join(f" · {x}" for x in extras)
    )
    skipped = br.skipped()
    if skipped:
        console.print("SKIP tiles (never computed): " + ", ".join(f"({i}, {j})" for i, j in skipped))
    console.print(Panel(_equations(br.preprocess()), title="Preprocess", title_align="left"))
    for steps in (list(br.dkdv_steps()), list(br.dq_steps())):
        for step in steps:
            console.print(_step_panel(step, len(steps)))
    console.print(_errors(br))
    worst = max(br.max_error().values())
    console.print(f"max |grad - oracle| over every gradient: [bold]{worst:.3e}[/bold]")
