"""Runtime, the bottom layer: the event loop an engine belongs to (eventloop.py), the one compute thread
all torch work runs on (compute.py), the CPU share it adapts to (cpu_share.py), the per-user cache
directory (cache_dir.py). Imports nothing of asyncpage but errors."""
