"""Measurement commands, run by `asyncpage bench*|soak` and `python -m asyncpage.bench.<name>`:
throughput workloads (throughput.py), settings side by side (quant.py), llama.cpp baselines
(llama_server.py), speculation (spec.py), the soak, perplexity (quality.py), one step's profile
(profile_step.py), the JSON-Schema-suite runner. `import asyncpage` loads none of it."""
