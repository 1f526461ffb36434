"""One decode step against a KV cache (Flash-Decoding) below the public function
:func:`flashattn_teach.flash_attention_with_kvcache`: the step's checks, the in-place cache append and the
route to a kernel (``step.py``), and the split-KV key ranges of the CPU paths (``ranges.py``).
"""
