"""The library's exception types.

torch raises ``RuntimeError`` for most bad input to ``scaled_dot_product_attention``, while Python code
conventionally raises ``ValueError`` or ``TypeError``. Each error here subclasses both the matching
built-in and ``RuntimeError``, so ``except ValueError`` and ``except RuntimeError`` (written for torch)
both catch it.
"""

from __future__ import annotations


class AttentionError(RuntimeError):
    """Base class of every error this library raises for bad input."""


class AttentionValueError(AttentionError, ValueError):
    """An argument has the right type but a wrong value: a shape, a size, a device, an option."""


class AttentionTypeError(AttentionError, TypeError):
    """An argument has the wrong type or dtype."""


class BackendUnavailableError(AttentionValueError, NotImplementedError):
    """A backend named explicitly cannot run the call; the message says why and what to use instead. It is
    a ``NotImplementedError``, as torch raises for a case a kernel does not support, and an
    :class:`AttentionValueError`, since the ``backend`` argument is what cannot be honoured."""


class AttentionDtypeError(AttentionTypeError, AttentionValueError):
    """Tensors whose dtypes cannot be combined (query, key and value of different dtypes). Both a
    ``TypeError`` (a dtype is a type) and a ``ValueError``, which torch's FlexAttention raises for it, so
    code written for either catches it."""


class BlockMaskListsError(AttentionValueError, AssertionError):
    """Index lists given to :class:`~flashattn_teach.BlockMask` that do not pair up (a ``full_*`` count
    without its indices, or the reverse). torch's ``BlockMask`` asserts on them, so this is also an
    ``AssertionError``, and code written for either catches it."""
