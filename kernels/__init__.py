"""Triton kernels for the paged KV path (installed as asyncpage.kernels).

attention_kernels.py  decode and chunked-prefill attention over block tables (causal, sliding window, GQA)
cache_ops.py        KV write by slot mapping, block copy (copy-on-write)
bitmask.py          guided-decoding token bitmask applied to logits

Raw kernels only (tensors in, tensors out); the attention backend that calls them is
asyncpage/model/attention_triton.py. On a CUDA GPU they run compiled; on the CPU they run under
Triton's interpreter (TRITON_INTERPRET=1, set before this package is imported), which is how the
tests check them against the torch backend.
"""

if __name__ == "kernels":
    # Imported as a top-level `kernels`: a checkout's root is on sys.path (`python -m ...` or pytest run
    # there). That name is PyPI's `kernels`, which transformers 5.25+ imports when it is installed: hand
    # the import over to it, so this directory never shadows it (nothing of asyncpage's is lost: its own
    # name is asyncpage.kernels).
    import importlib as _importlib
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _saved = list(_sys.path)
    _me = _sys.modules[__name__]
    _sys.path[:] = [p for p in _saved if _os.path.abspath(p or _os.curdir) != _root]
    del _sys.modules[__name__]
    try:
        _real = _importlib.import_module(__name__)
    except ModuleNotFoundError as _exc:
        if _exc.name != __name__:
            raise  # PyPI's `kernels` is there but broken: its own error, not a stand-in
        # PyPI's `kernels` is not installed. Raising here broke transformers (5.17 and 5.25 alike import a
        # package they find without metadata and let the error out: `from transformers import LlamaConfig`
        # failed in a checkout's root). Stay an empty module without __file__, __version__ or submodules
        # instead (no second copy of asyncpage.kernels' modules under this name), which transformers reads
        # as a namespace-package shadow: absent.
        _real = _me
        globals().pop("__file__", None)
        __path__.clear()
    finally:
        _sys.path[:] = _saved
    _sys.modules[__name__] = _real
