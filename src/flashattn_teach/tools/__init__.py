"""Tools that study the library rather than run it, each loaded only by its command.

kernels/    ``flashattn-teach kernels``: ahead-of-time compiles of the Triton kernels, registers, spills,
            shared memory, SASS loops (``kernels-decode``, ``kernels-fp8`` for the decode and FP8 kernels)
iomodel/    ``flashattn-teach iomodel``: HBM traffic and FLOPs of standard against tiled attention
scheduler.py  the GPU's block scheduler in plain Python: which program runs on which SM, and when
"""
