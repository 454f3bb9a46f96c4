"""KV bookkeeping: blocks (block.py), the ref-counted pool with its prefix map and block tables
(cache.py), which cached block a full pool evicts (eviction.py). Integers only: the K/V tensors are
the runner's (core/runner.py)."""
