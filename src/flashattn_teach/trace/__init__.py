"""Tile replay: the online softmax's running statistics, one tile update at a time, as data and pictures.

    replay(q, k, v, block_m=2, block_n=2)   -> Replay of TileStep (replay.py; schedule.py for the order);
                                            causal, window, softcap, alibi_slopes, seqlens_k and attn_mask
                                            as in flashattn_teach.masks
    to_experiment(r) / to_json(r)           the seed manifest's "experiment" format (manifest.py)
    render_table / render_html / render_png terminal, self-contained page, picture (table.py, html.py, png.py)

``flashattn-teach replay ...`` is the command line (cli.py). rich and matplotlib load only when their
format is asked for.
"""

from .manifest import to_experiment, to_json, write_json
from .replay import Replay, TileState, TileStep, replay

__all__ = ["Replay", "TileState", "TileStep", "replay", "to_experiment", "to_json", "write_json"]
