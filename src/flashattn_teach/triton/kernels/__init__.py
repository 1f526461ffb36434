"""The ``@triton.jit`` code, nothing else: the forward and its key/value loop, the three backward kernels,
the split-KV decode kernels, and the tile loads, masks and dropout draws they share. Importing this package
does not import triton; the launchers (``flashattn_teach.triton.launch``, ``decode_launch``) import a
kernel module on first launch.
"""
