"""asyncpage on a Ray cluster (the optional extra: `pip install 'asyncpage[ray]'`).

- Extraction on Ray Data (asyncpage.ray.extract): `extract_dataset` (a Dataset in, a Dataset of results out)
  and `run_job` (`asyncpage extract --ray`).
- Serving on Ray Serve (asyncpage.ray.serving, asyncpage.ray.routing): `serve_app` (replicas of one
  AsyncEngine each behind the OpenAI routes, `asyncpage serve --ray`) and its cache-aware request router
  `CacheAffinityRouter`. Imported on first use, so that an extraction job never loads Ray Serve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncpage.ray.extract import ERROR_TYPE, extract_dataset, run_job

if TYPE_CHECKING:
    from asyncpage.ray.routing import CacheAffinityRouter, affinity_key
    from asyncpage.ray.serving import EngineReplica, Ingress, serve_app

_SERVING = {"serve_app": "serving", "EngineReplica": "serving", "Ingress": "serving",
            "CacheAffinityRouter": "routing", "affinity_key": "routing"}

__all__ = ["ERROR_TYPE", "CacheAffinityRouter", "EngineReplica", "Ingress", "affinity_key", "extract_dataset",
           "run_job", "serve_app"]


def __getattr__(name: str) -> Any:
    if name in _SERVING:
        import importlib

        return getattr(importlib.import_module(f"asyncpage.ray.{_SERVING[name]}"), name)
    raise AttributeError(f"module 'asyncpage.ray' has no attribute {name!r}")
