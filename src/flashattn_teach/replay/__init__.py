"""Tile replay: the online softmax's running statistics, one step at a time, as data and pictures.

Three scenario builders yield one step type, :class:`Step` (step.py): its :class:`StepKind` (update, merge,
preprocess, dK/dV, dQ), its tile, its terms by the papers' names (``step["m_i"]``) and its equations with their
numbers (``step.equations``); ``r.all_steps()`` yields them in the order they run. Every format is one renderer
that serves the three:

    replay(q, k, v, block_m=2, block_n=2)   forward -> Replay: UPDATEs (replay.py; the builder steps.py,
                                            schedule.py for the order); causal, window, softcap, alibi_slopes,
                                            seqlens_k and attn_mask as in flashattn_teach.masks; sinks= the
                                            head's attention sink; block_mask=, score_mod= FlexAttention's
    replay_backward(q, k, v, dO=None, block_m=2, block_n=2)
                                            backward -> BackwardReplay: the PREPROCESS (delta), then the DKDV
                                            and DQ passes, each step's terms from core.backward.tile_terms and
                                            its equations with their numbers, and the float64 autograd oracle
                                            (backward_replay.py)
    replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, num_splits=3, block_n=2)
                                            decode -> DecodeReplay: each split-KV range's UPDATEs, then the
                                            MERGEs (decode_replay.py, decode_merges.py); block_table= a paged
                                            cache; sinks= merged in after the splits

    render_table(r) / write_json(r), to_json(r) / render_html(r) / render_png(r, path)
                                            the terminal (table.py), strict JSON of one schema,
                                            replay.schema.json, with "replayKind" and each step's "stepKind"
                                            (manifest.py), the self-contained page
                                            (html.py, page*.js: a backward is a tab of the forward's page) and
                                            the picture (png/: one module per scenario), for any r
    step.equations                          an UPDATE's: FA2 Alg. 1's lines with its numbers, per query row
                                            (equations.py); key-major: FA1 Alg. 1's (equations_key_major.py);
                                            what the table, picture and page show of them: equations_view.py
    memory_figure(r) / memory_json(r)       memory step by step, by iomodel's rules (memory.py, memory_table.py)
    Replay._repr_html_ / notebook_html      the page in a Jupyter notebook (notebook.py); DecodeReplay's too

``flashattn-teach replay forward|backward|decode`` is the command line (cli.py: the subcommands and their
options; cli_run.py: each one run and rendered; cli_common.py: the inputs). rich and matplotlib load only when
their format is asked for.
"""

from .backward_replay import BackwardReplay, replay_backward
from .decode_replay import DecodeReplay, KeyRole, SplitReplay, replay_decode
from .manifest import decode_to_experiment, to_experiment, to_json, write_json
from .notebook import decode_notebook_html, notebook_html
from .replay import Replay, replay
from .step import Step, StepEquation, StepKind, TileState

Replay.notebook_page = notebook_html  # Replay._repr_html_: the page in a notebook
DecodeReplay.notebook_page = decode_notebook_html  # DecodeReplay._repr_html_: the decode page

__all__ = [
    "BackwardReplay",
    "DecodeReplay",
    "KeyRole",
    "Replay",
    "SplitReplay",
    "Step",
    "StepEquation",
    "StepKind",
    "TileState",
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
