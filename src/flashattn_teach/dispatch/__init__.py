"""The one route from checked options to a backend: :func:`plan` chooses the backend and says why
(``planner.py``), :func:`run` is the one place a backend is called (``runner.py``), and ``rows.py`` folds
the query heads of a one-query call into rows of their key/value head. Callers import the two modules
(``from ..dispatch import planner, runner``) and call ``runner.run(...)`` through the module, so that a test
patching ``flashattn_teach.dispatch.runner.run`` sees every call.
"""

from .planner import BACKENDS, Plan, check_backend, dense_only, plan, plan_decode, plan_ranges, public_backend, tiles
from .runner import run, run_decode

__all__ = [
    "BACKENDS",
    "Plan",
    "check_backend",
    "dense_only",
    "plan",
    "plan_decode",
    "plan_ranges",
    "public_backend",
    "run",
    "run_decode",
    "tiles",
]
