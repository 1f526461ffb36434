"""``python -m flashattn_teach.triton.inspect``: the report of :mod:`.report`."""

from .report import main

if __name__ == "__main__":
    raise SystemExit(main())
