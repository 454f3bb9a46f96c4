"""Disaggregated prefill and decode: `DisaggEngine` runs a prefill worker and a decode worker in two
processes and hands each prompt's KV blocks from the first to the second (one authenticated socket
between the two: AF_UNIX in a private directory, or TCP on `kv_host`; typed msgspec frames, no pickle).

    engine = DisaggEngine.from_pretrained(dtype="float32")
    async with engine:
        out = await engine.generate("Hello", SamplingParams(max_tokens=16, temperature=0))

Files: engine.py (the front end), front.py (a request as the caller holds it), messages.py (the
control messages), worker.py (a worker process), cores.py (the export and import paths of the two
engine loops), wire.py (the KV hand-over protocol), transport.py (its socket: bind, handshake, frames),
actors.py (the two workers as Ray actors placed by resources on other nodes: `prefill_resources=`,
`decode_resources=`, `ray_address=`; imported only then).
"""

from .engine import DisaggEngine

__all__ = ["DisaggEngine"]
