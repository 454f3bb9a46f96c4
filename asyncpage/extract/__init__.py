"""Typed extraction on top of the engine: one record (`extract_one`), a stream of them (`extract_many`),
grounded (copied) fields, scored booleans, the prompt written from a schema, JSONL jobs.

Typed against `asyncpage.core.client.EngineClient`, never the `AsyncEngine` facade (which imports this).
"""

from asyncpage.extract.many import extract_many
from asyncpage.extract.run import (
    ExtractError,
    ExtractResult,
    beams_per_record,
    check_job,
    decode_value,
    extract_one,
    json_params,
)

__all__ = ["ExtractError", "ExtractResult", "beams_per_record", "check_job", "decode_value", "extract_many",
           "extract_one", "json_params"]
