"""The ``@triton.jit`` code and the records it takes: the forward and its key/value loop, the three backward
kernels, the split-KV decode kernels, the tile loads, masks and dropout draws they share, and ``records.py``,
the kernels' arguments as named records (plain NamedTuples, built on the host, read and made again in the
kernels). Importing this package
does not import triton; the launchers (``flashattn_teach.triton.launch``, ``decode_launch``) import a
kernel module on first launch.
"""
