"""Serving: everything a decode step against a KV cache needs, in one place (Flash-Decoding; flash-attn's
``flash_attn_with_kvcache``). Read in this order:

    api.py                 flash_attention_with_kvcache, the public function (re-exported at the top)
    explain.py             explain_with_kvcache: which path, how many key ranges, which row layout
    step.py                the step: its record (DecodeCall), its checks, the in-place cache append, the route
    checks.py              the step's argument checks and the record they fill (DecodeStep)
    pages.py               paged caches: appending into pages, the element view of a page table
    page_checks.py         the page table's and the left padding's checks
    ranges.py              split-KV: the key ranges of the CPU paths and their merge
    splitkv.py             how many splits fill a GPU (flash-attn's rule)
    ops.py, ops_traced.py  the decode step as a torch.library op for torch.compile, and its traced form
    launch.py              the Triton decode kernels' launcher (the kernels: triton/kernels/decode.py)
    varlen_pages.py        packed sequences whose keys live in pages (flash_attention_varlen's block_table)
    varlen_page_checks.py  their checks

This package's ``__init__`` imports nothing, so the low modules (``checks``, ``splitkv``, ``launch``) can be
imported by the layers below without pulling in the step (see docs/architecture.md).
"""
