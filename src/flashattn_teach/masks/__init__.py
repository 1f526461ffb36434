"""The mask contract: which keys a query row sees and what is added to its scores (``spec.py``), and how a
tiling meets it (``tiling.py``), from the causal diagonal (``causal.py``), the sliding window
(``window.py``) and packed sequences (``packed.py``).
"""

from .causal import TileKind
from .spec import MaskSpec
from .tiling import MaskSummary, Tiling

__all__ = ["MaskSpec", "MaskSummary", "TileKind", "Tiling"]
