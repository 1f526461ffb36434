"""Every argument check, in one place: the inputs and options every call shares (``inputs.py``), packed
sequences (``varlen.py``); a decode step's own checks sit with serving (``serving/checks.py``). Errors name the argument
and its shape and say what to do instead (``flashattn_teach.errors``).
"""
