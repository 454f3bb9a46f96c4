"""A schema's plain booleans decided alone, without a generated value (decisions.py's readings for them):
`boolean_offsets` measures each one's offset on the reference records, `decide_booleans` decides them on a
record's text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncpage.extract.decisions import Decider, Plan

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient


async def boolean_offsets(engine: EngineClient, schema: dict[str, Any]) -> dict[str, float]:
    """The scored booleans of `schema` and their offsets (each one's mean score on the reference records);
    a boolean without one (a reference that does not fit the context) is left out, left to the model."""
    d = Decider(schema, booleans=True, choices=False)
    await d.calibrate(engine, None)
    return {name: d.offsets[r.key] for name, r in d.readings.items() if r.key in d.offsets}


async def decide_booleans(engine: EngineClient, schema: dict[str, Any], text: str,
                          offset: dict[str, float]) -> dict[str, bool]:
    """The booleans of `schema` that have an `offset`, decided on a record's `text` ({} where none can be)."""
    d = Decider(schema, booleans=True, choices=False)
    d.readings = {n: r for n, r in d.readings.items() if n in offset}
    d.offsets = {r.key: offset[n] for n, r in d.readings.items()}
    plan = Plan(d, text, [])
    await plan.run(engine)
    return {n: bool(v) for n, v in plan.outcome(engine)[0].items()}
