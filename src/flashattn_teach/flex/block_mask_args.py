"""torch's arguments of a block mask (:class:`flashattn_teach.flex.block_mask.BlockMask`), named and checked:
the index-list attributes in torch's order (:data:`INDEX_LISTS`), those read only here (:data:`READ_ONLY`:
derived from the tile kinds, so assigning them would change nothing), the deterministic-backward metadata
refused (:data:`DQ_METADATA`), the default block size, and the checks of ``BLOCK_SIZE`` and ``seq_lengths``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import AttentionValueError

# torch's index-list attributes of a block mask, in its order
INDEX_LISTS = tuple(
    "kv_num_blocks kv_indices full_kv_num_blocks full_kv_indices q_num_blocks q_indices full_q_num_blocks "
    "full_q_indices".split()
)
DEFAULT_BLOCK_SIZE = 128  # torch's _DEFAULT_SPARSE_BLOCK_SIZE


def block_size(BLOCK_SIZE: int | tuple[int, int]) -> tuple[int, int]:
    size = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
        raise AttentionValueError(
            f"BLOCK_SIZE must be a positive int or a pair (Q_BLOCK_SIZE, KV_BLOCK_SIZE) of them, got {BLOCK_SIZE!r}"
        )
    return size[0], size[1]


# what torch's BlockMask exposes and this one derives from block_kinds: assigning them would change nothing
READ_ONLY = (*INDEX_LISTS, "BLOCK_SIZE", "shape", "batch_shape", "has_full")
DQ_METADATA = ("dq_write_order", "dq_write_order_full", "dq_kv_order")


def read_only_error(name: str) -> AttributeError:
    return AttributeError(
        f"BlockMask.{name} is read only: the attention reads the block kinds the mask was built with, so "
        "setting it would change nothing; build a new mask with BlockMask.from_kv_blocks(...) from the "
        "lists you want, or with create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)"
    )


def refuse_dq_metadata(where: str, *values: object) -> None:
    for name, value in zip(DQ_METADATA, values, strict=True):
        if value is not None:
            raise AttentionValueError(
                f"{where}: {name} (torch's deterministic dQ write order) is not supported here; leave {name}=None"
            )


def seq_lengths_pair(value: object) -> tuple[int, int]:
    if (
        not isinstance(value, Sequence)
        or len(value) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)
    ):
        raise AttentionValueError(f"BlockMask.seq_lengths must be a pair (Q_LEN, KV_LEN) of ints >= 0, got {value!r}")
    return (int(value[0]), int(value[1]))


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DQ_METADATA",
    "INDEX_LISTS",
    "READ_ONLY",
    "block_size",
    "read_only_error",
    "refuse_dq_metadata",
    "seq_lengths_pair",
]
