"""Control messages between the front end and its workers (multiprocessing pipes, pickled tuples),
and how a typed error crosses a process boundary.

front end -> prefill   ("submit", rid, prompt, params)   ("abort", rid)   ("shutdown",)
front end -> decode    ("abort", rid)   ("shutdown",)
worker -> front end    ("ready", info)   ("failed", error)   ("stats", EngineStats, transfer figures)
                       ("released", rid, role, EngineStats): this side holds nothing of rid any more
                       ("error", rid, error): rid failed on this side (typed, see encode_error)
decode -> front end    ("chunk", rid, StreamChunk, final): `final` (on the last chunk) carries
                       prompt_token_ids and num_cached_prompt_tokens

Pipes, not torch.distributed, for control: they are ordered per worker, survive a peer's death as
an EOF the front end can act on, and need no rendezvous. Only the KV (wire.py) goes over gloo.
"""

from __future__ import annotations

from typing import Any

from asyncpage import errors

EncodedError = tuple[str, tuple[Any, ...]]


def encode_error(exc: BaseException) -> EncodedError:
    """(class name, constructor args): asyncpage's errors do not all pickle (InvalidRequestError's
    __init__ takes two arguments, its `args` holds one)."""
    if isinstance(exc, errors.InvalidRequestError):
        return type(exc).__name__, (exc.field, exc.message)
    if isinstance(exc, errors.ExtractionError):
        return "EngineDeadError", (str(exc),)  # not raised on these paths; never rebuilt half-typed
    return type(exc).__name__, (str(exc),)


def decode_error(encoded: EncodedError) -> BaseException:
    """The typed error back (an unknown class becomes EngineDeadError with its text)."""
    name, args = encoded
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.AsyncPageError):
        try:
            return cls(*args)
        except TypeError:
            pass
    return errors.EngineDeadError(f"{name}: {args[0] if args else ''}")
