"""The library as ``torch.library`` custom ops, so ``torch.compile`` and ``torch.export`` see one node per
call. The public functions (:mod:`flashattn_teach.api`) call them only while compiling, after their own
checks; each op's eager body runs the dispatcher (:mod:`flashattn_teach.dispatch`), never a public function.

    attention.py      flashattn_teach::attention and its backward
    varlen.py         flashattn_teach::attention_varlen and its backward

The decode op, ``flashattn_teach::attention_with_kvcache``, is serving's: :mod:`flashattn_teach.serving.ops`.
"""

from . import attention, varlen

__all__ = ["attention", "varlen"]
