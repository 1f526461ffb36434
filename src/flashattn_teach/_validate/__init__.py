"""Every argument check, in one place: the inputs and options every call shares (``inputs.py``), packed
sequences (``varlen.py``) and a decode step's cache and lengths (``decode.py``). Errors name the argument
and its shape and say what to do instead (``flashattn_teach.errors``).
"""
