"""Tile replay: the online softmax's running statistics, one tile update at a time, as data and pictures.

    replay(q, k, v, block_m=2, block_n=2)   -> Replay of TileStep (replay.py)
    Replay.to_experiment() / to_json()      the seed manifest's "experiment" format (manifest.py)
    render_table / render_html / render_png terminal, self-contained page, picture (table.py, html.py, png.py)

``flashattn-teach replay ...`` is the command line (cli.py). rich and matplotlib load only when their
format is asked for.
"""

from .replay import Replay, TileStep, replay

__all__ = ["Replay", "TileStep", "replay"]
