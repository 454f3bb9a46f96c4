"""Triton kernels for the paged KV path (installed as asyncpage.kernels).

attention_kernels.py  decode and chunked-prefill attention over block tables (causal, sliding window, GQA)
cache_ops.py        KV write by slot mapping, block copy (copy-on-write)
bitmask.py          guided-decoding token bitmask applied to logits

Raw kernels only (tensors in, tensors out); the attention backend that calls them is
asyncpage/model/attention_triton.py. On a CUDA GPU they run compiled; on the CPU they run under
Triton's interpreter (TRITON_INTERPRET=1, set before this package is imported), which is how the
tests check them against the torch backend.
"""
