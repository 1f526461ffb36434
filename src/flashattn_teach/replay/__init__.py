"""Tile replay: the online softmax's running statistics, one tile update at a time, as data and pictures.

    replay(q, k, v, block_m=2, block_n=2)   -> Replay of TileStep (replay.py, steps.py; schedule.py for the
                                            order); causal, window, softcap, alibi_slopes, seqlens_k and
                                            attn_mask as in flashattn_teach.masks; sinks= the head's
                                            attention sink (each row's share: Replay.sink_share());
                                            block_mask=, score_mod= FlexAttention's, for one head
                                            (tiles FULL/PARTIAL/SKIP from its table; also replay_backward)
    replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, num_splits=3, block_n=2)
                                            -> DecodeReplay: one decode step's split-KV ranges, their tile
                                            updates, then the merges (decode_replay.py, decode_merges.py);
                                            block_table= a paged cache, its pages shown per key;
                                            sinks= merged in after the splits
    replay_backward(q, k, v, dO=None, block_m=2, block_n=2)
                                            -> BackwardReplay: the preprocess (delta), the dK/dV pass and the
                                            dQ pass, one tile at a time, each step's equations with their
                                            numbers, and the float64 autograd oracle (backward_replay.py);
                                            render_backward_table (backward_table.py), to_backward_json
                                            (backward_manifest.py), render_html(r, backward=True) its view,
                                            render_backward_png (backward_png.py: a picture per
                                            step, one for the preprocess and the result)
    equations.step_equations(step)          FA2 Alg. 1's lines with the update's numbers, per query row
                                            (equations.py): in the JSON extensions, table, PNG and page;
                                            key-major: key_major_step_equations(step, v_j), FA1 Alg. 1's
                                            lines with their HBM loads and writes (the page's panel, and
                                            the table and PNG: equations_key_major.replay_equations)
    to_experiment(r) / to_json(r)           the seed manifest's "experiment" format (manifest.py;
                                            decode_to_experiment in decode_manifest.py)
    memory_figure(r) / memory_json(r)       memory step by step: the on-chip buffers and the HBM bytes moved so far
                                            per tensor, by iomodel's rules, beside the dense path (memory.py;
                                            memory_table.py, page_memory.js)
    Replay._repr_html_ / notebook_html      the page in a Jupyter notebook, in an <iframe srcdoc> (notebook.py);
                                            DecodeReplay._repr_html_ / decode_notebook_html the decode page
    render_table / render_html / render_png terminal, self-contained page, picture (table.py, html.py, png.py;
                                            decode_table.py, decode_html.py, decode_png.py)

``flashattn-teach replay forward|backward|decode`` is the command line (cli.py: the subcommands and their
options; cli_run.py: each one run; cli_common.py: the inputs). rich and matplotlib load only when their format
is asked for.
"""

from .backward_replay import BackwardReplay, replay_backward
from .decode_manifest import decode_to_experiment
from .decode_merges import MergeStep
from .decode_replay import DecodeReplay, KeyRole, SplitReplay, replay_decode
from .manifest import to_experiment, to_json, write_json
from .notebook import decode_notebook_html, notebook_html
from .replay import Replay, TileState, TileStep, replay

Replay.notebook_page = notebook_html  # Replay._repr_html_: the page in a notebook
DecodeReplay.notebook_page = decode_notebook_html  # DecodeReplay._repr_html_: the decode page

__all__ = [
    "BackwardReplay",
    "DecodeReplay",
    "KeyRole",
    "MergeStep",
    "Replay",
    "SplitReplay",
    "TileState",
    "TileStep",
    "decode_notebook_html",
    "decode_to_experiment",
    "notebook_html",
    "replay",
    "replay_backward",
    "replay_decode",
    "to_experiment",
    "to_json",
    "write_json",
]
