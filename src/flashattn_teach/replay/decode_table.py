"""A decode-step replay in the terminal (rich): the cache's keys, each split's tile updates, then the merges.

Every tile update is drawn (a decode replay is meant to be small: ``--format json`` for a long one).

The table takes the terminal's width (:mod:`.terminal`); below :data:`~.terminal.WIDE` columns the cache's
roles are one letter each (with a legend) and each tile update and each merge is a few labelled lines
instead of a row of a wide table.
"""

from __future__ import annotations

from typing import IO

from torch import Tensor

from .decode_replay import DecodeReplay, KeyRole
from .manifest import span
from .terminal import is_narrow, open_console

ROLE_GLYPHS = {KeyRole.OLD: ("o", "cyan"), KeyRole.NEW: ("n", "bold magenta"), KeyRole.UNUSED: (".", "dim")}


def _fmt(x: float) -> str:
    return "-inf" if x == float("-inf") else f"{x:.4g}"


def _vec(t: Tensor) -> str:
    return "[" + ", ".join(_fmt(float(x)) for x in t.tolist()) + "]"


def _cache(r: DecodeReplay, narrow: bool):
    """The cache's slots: role, split, and per query row which keys it sees (x) or not (.); ``narrow``: each
    role as its letter, spelt out in the table's caption."""
    from rich.table import Table

    legend = "role: " + ", ".join(f"{glyph} {role.value}" for role, (glyph, _) in ROLE_GLYPHS.items())
    table = Table(
        box=None,
        pad_edge=False,
        show_header=True,
        title="The cache after the step's write",
        caption=legend if narrow else None,
        caption_justify="left",
    )
    table.add_column("")
    for j in range(r.N_max):
        table.add_column(str(j), justify="center")
    roles = [
        (ROLE_GLYPHS[r.role(j)][0] if narrow else r.role(j).value, ROLE_GLYPHS[r.role(j)][1]) for j in range(r.N_max)
    ]
    table.add_row("role", *(f"[{style}]{text}[/]" for text, style in roles))
    table.add_row("split", *("·" if (s := r.split_of(j)) is None else str(s) for j in range(r.N_max)))
    if r.page_size is not None:  # paged: the block id of each key's page (slot j % page_size)
        table.add_row("page", *("·" if (at := r.page_of(j)) is None else str(at[0]) for j in range(r.N_max)))
    first = r.L - r.N_new
    for i, row in enumerate(r.visible.tolist()):
        table.add_row(f"q{i} (at {first + i})", *("x" if seen else "." for seen in row))
    return table


def _split_updates_stacked(r: DecodeReplay, s: int) -> list[str]:
    """Each tile update of split ``s`` as labelled lines: what fits 80 columns."""
    out = []
    for step in r.splits[s]:
        (c0, c1) = step.cols
        out += [
            f"update {step.index + 1} · key columns {span(c0, c1)} · {step.tile_kind.name} tile · "
            f"max |O_s - O_final| {step.max_diff:.3e}",
            f"  S_ij (row-major) = {_vec(step['S_ij'].reshape(-1))}",
            f"  m_i = {_vec(step['m_i'])}, l_i = {_vec(step['l_i'])}",
        ]
    return out


def _split_panel(r: DecodeReplay, s: int, narrow: bool):
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    split = r.splits[s]
    result = f"partial result: lse_s = {_vec(split.lse_s)}, O_s row 0 = {_vec(split.O_s[0])}"
    s0, s1 = split.keys
    title = f"Split {split.index} · keys {span(s0, s1)} · {len(split)} tile update{'s' * (len(split) != 1)}"
    if narrow:
        return Panel(Group(*_split_updates_stacked(r, s), result), title=title, title_align="left")
    table = Table(box=None, pad_edge=False)
    for column in ("update", "key columns", "tile", "S_ij (row-major)", "m_i", "l_i", "max |O_s - O_final|"):
        table.add_column(column, justify="left" if column.startswith(("S_ij", "tile")) else "right")
    for step in split:
        (c0, c1) = step.cols
        table.add_row(
            str(step.index + 1),
            span(c0, c1),
            step.tile_kind.name,
            _vec(step["S_ij"].reshape(-1)),
            _vec(step["m_i"]),
            _vec(step["l_i"]),
            f"{step.max_diff:.3e}",
        )
    return Panel(Group(table, result), title=title, title_align="left")


MERGES_TITLE = "Merges: lse = log(exp(lse_a) + exp(lse_b)), O = w_a O_a + w_b O_b"


def _merges_stacked(r: DecodeReplay):
    """Each merge as labelled lines: what fits 80 columns."""
    from rich.console import Group
    from rich.text import Text

    lines: list[Text | str] = [Text(MERGES_TITLE, style="italic")]
    for m in r.merges:
        lines += [
            f"merge {m.index + 1}: {m.label} · max |O - O_final| {m.max_diff:.3e}",
            f"  lse_a = {_vec(m['lse_a'])}, lse_b = {_vec(m['lse_b'])}, lse = {_vec(m['lse'])}",
            f"  w_a = exp(lse_a - lse) = {_vec(m['w_a'])}, w_b = {_vec(m['w_b'])}",
        ]
    return Group(*lines)


def _merges(r: DecodeReplay):
    from rich.table import Table

    table = Table(title=MERGES_TITLE)
    for column in ("merge", "a + b", "lse_a", "lse_b", "lse", "w_a = exp(lse_a - lse)", "w_b", "max |O - O_final|"):
        table.add_column(column, justify="right")
    for m in r.merges:
        table.add_row(
            str(m.index + 1),
            m.label,
            _vec(m["lse_a"]),
            _vec(m["lse_b"]),
            _vec(m["lse"]),
            _vec(m["w_a"]),
            _vec(m["w_b"]),
            f"{m.max_diff:.3e}",
        )
    return table


def render_decode_table(r: DecodeReplay, file: IO[str] | None = None, *, width: int | None = None) -> None:
    """Print ``r`` to ``file`` (default stdout): the cache, one panel per split, the merges, the final error;
    ``width`` columns wide (default the terminal's, :mod:`.terminal`)."""
    console = open_console(file, width)
    narrow = is_narrow(console)
    console.print(
        f"[bold]Decode step replay[/bold] · batch element {r.batch_index}, query head {r.head} · "
        f"{r.cache_len} cached + {r.N_new_kv} new keys = L {r.L} of N_max {r.N_max} slots · N_new={r.N_new} "
        f"quer{'y' if r.N_new == 1 else 'ies'} · num_splits={r.num_splits}, BLOCK_N={r.block_n} · "
        + ("" if r.page_size is None else f"paged, page_size {r.page_size}, pages {list(r.pages)} · ")
        + " · ".join(r.labels() or ["no mask"])
    )
    console.print(_cache(r, narrow))
    empty = [span(a, b) if a < b else "empty" for a, b in r.ranges]
    console.print("Split ranges: " + ", ".join(f"{s}: {keys}" for s, keys in enumerate(empty)))
    for s in range(len(r.splits)):
        console.print(_split_panel(r, s, narrow))
    if r.merges:
        console.print(_merges_stacked(r) if narrow else _merges(r))
    console.print(
        f"merged O against the dense float64 output of the step: max difference [bold]{r.max_diff:.3e}[/bold]; "
        f"lse = {_vec(r.lse)} (dense {_vec(r.lse_final)})"
    )
