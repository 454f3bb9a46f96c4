"""The default model and pydantic: the README's first example returns the model's instance, and a value its
field_validator refuses is decoded again from that field, the prompt's KV served by the prefix cache."""

from __future__ import annotations

from typing import ClassVar

import pytest
from pydantic import BaseModel, field_validator

from asyncpage import AsyncEngine

PROMPT = "Alice is 31. As JSON: "


class PydanticPerson(BaseModel):
    name: str
    age: int


class RefusesFirstName(BaseModel):
    seen: ClassVar[list[str]] = []
    name: str
    age: int

    @field_validator("name")
    @classmethod
    def not_the_first(cls, v: str) -> str:
        cls.seen.append(v)
        if len(cls.seen) == 1:
            raise ValueError("the first name is always refused")
        return v


async def test_extract_returns_a_pydantic_instance_and_retries_a_refused_field(default_engine: AsyncEngine) -> None:
    p = await default_engine.extract(PROMPT, PydanticPerson, max_retries=0)
    assert isinstance(p, PydanticPerson) and p.name == "Alice"
    RefusesFirstName.seen.clear()
    before = default_engine.stats().prefix_cache_hit_tokens
    # The default prompt (written from the schema): the prefix cache shares whole blocks only, and PROMPT alone
    # is shorter than one.
    [r] = [r async for r in default_engine.extract_many(["Alice is 31."], RefusesFirstName, max_retries=1)]
    grown = default_engine.stats().prefix_cache_hit_tokens - before
    n_prompt = r.prompt_tokens
    assert r.ok, r.error
    assert isinstance(r.value, RefusesFirstName) and r.attempts == 2
    assert r.value.name == RefusesFirstName.seen[1] != RefusesFirstName.seen[0]
    assert grown >= 0.9 * n_prompt, (grown, n_prompt)
    print(f"prompt {n_prompt} tokens, prefix-cache hits grew {grown}; names {RefusesFirstName.seen}; {r.value!r}")
    assert default_engine.stats().kv_blocks_used == 0


class RaisesOnBob(BaseModel):
    name: str
    age: int

    @field_validator("name")
    @classmethod
    def no_bob(cls, v: str) -> str:
        if v.startswith("Bob"):
            raise RuntimeError("a bug in the caller's validator")  # not a ValueError: pydantic lets it through
        return v


async def test_a_validator_that_raises_fails_its_record_and_the_job_goes_on(default_engine: AsyncEngine) -> None:
    records = ["Alice is 31.", "Bob is 40.", "Carol is 27."]
    rows = {r.position - 1: r async for r in default_engine.extract_many(records, RaisesOnBob, max_retries=1)}
    assert sorted(rows) == [0, 1, 2]
    assert rows[0].ok and rows[2].ok and isinstance(rows[2].value, RaisesOnBob)
    bob = rows[1]
    assert not bob.ok and bob.error is not None and bob.attempts == 2
    assert "RuntimeError" in bob.error.message and "a bug in the caller's validator" in bob.error.message
    assert default_engine.stats().kv_blocks_used == 0


async def test_a_type_adapter_is_a_type_and_a_function_is_refused(default_engine: AsyncEngine) -> None:
    from pydantic import TypeAdapter

    from asyncpage import InvalidRequestError

    p = await default_engine.extract(PROMPT, TypeAdapter(PydanticPerson), max_retries=0)
    assert isinstance(p, PydanticPerson)

    def helper() -> None: ...

    with pytest.raises(InvalidRequestError, match="callable"):
        await default_engine.extract(PROMPT, helper)
