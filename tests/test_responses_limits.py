"""What a /v1/responses body may hold, checked before any work (no model needed): what a response echoes
back and the store keeps (`metadata`, `text`, `store`) as OpenAI bounds it, a `function_call_output` that
answers no call refused, and the store bounded in bytes as well as in count."""

from __future__ import annotations

from typing import Any

import pytest

from asyncpage.errors import InvalidRequestError
from asyncpage.openai.responses import ResponseStore, Turn, body_field

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


def _turn(kept: ResponseStore | None = None, **body: Any) -> Turn:
    return Turn({"input": "hi", **body}, kept or ResponseStore(), "m")


@pytest.mark.parametrize(("body", "field"), [
    ({"metadata": {"k": "v" * 513}}, "metadata"), ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": [1, 2]}, "metadata"), ({"metadata": {"k": 3}}, "metadata"),
    ({"text": {"format": {"type": "text"}, "junk": "x" * 1000}}, "text"), ({"text": "json"}, "text"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity"), ({"store": "no"}, "store"), ({"store": 0}, "store")])
def test_what_a_response_echoes_and_the_store_keeps_is_bounded_as_openai_bounds_it(body: dict[str, Any],
                                                                                    field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        _turn(**body)
    assert err.value.field == field


def test_well_formed_echoed_fields_are_taken() -> None:
    turn = _turn(metadata={f"k{i}": "v" * 512 for i in range(16)}, text={"format": {"type": "text"},
                                                                       "verbosity": "low"}, store=False)
    assert not turn.store
    assert _turn().store  # stored unless asked otherwise


@pytest.mark.parametrize(("ours", "theirs"), [
    ("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
    ("tools[3].function.parameters", "tools[3].parameters"), ("tools[0].function.name", "tools[0].name"),
    ("tools", "tools"), ("max_tokens", "max_output_tokens"), ("messages[2].content", "input"),
    ("prompt_cache_key", "prompt_cache_key"), ("temperature", "temperature")])
def test_an_error_from_chat_names_the_field_as_the_responses_body_wrote_it(ours: str, theirs: str) -> None:
    assert body_field(ours) == theirs


def test_a_bad_reasoning_effort_is_named_as_the_responses_body_wrote_it() -> None:
    with pytest.raises(InvalidRequestError) as err:
        _turn(reasoning={"effort": "extreme"})
    assert err.value.field == "reasoning.effort", err.value
    assert _turn(reasoning={"effort": "low"}).args["reasoning_effort"] == "low"
    _turn(reasoning={"effort": "extreme"}, max_reasoning_tokens=64)  # outranked by the budget, as in chat()


def test_an_output_for_a_call_never_made_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequestError) as err:
        _turn(input=[{"role": "user", "content": "x"},
                     {"type": "function_call_output", "call_id": "nope", "output": "1"}])
    assert err.value.field == "input[1].call_id"
    # Answering a call made earlier in the input, or in the stored conversation, is fine.
    _turn(input=[CALL, {"type": "function_call_output", "call_id": "c1", "output": "1"}])
    store = ResponseStore()
    first = _turn(store, input=[{"role": "user", "content": "x"}, CALL])
    store.put(first.shell("completed", []), first.conversation)
    _turn(store, previous_response_id=first.id,
          input=[{"type": "function_call_output", "call_id": "c1", "output": "1"}])


def test_the_store_keeps_the_most_recent_within_its_bytes() -> None:
    store = ResponseStore(limit=100, max_bytes=10_000)
    for i in range(20):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 2_000}])
    assert store.bytes <= 10_000 and store.get("r19") is not None and store.get("r0") is None
    kept = [i for i in range(20) if store.get(f"r{i}") is not None]
    assert kept == list(range(20 - len(kept), 20)) and len(kept) >= 4
    assert store.delete("r19") and not store.delete("r19") and store.bytes <= 10_000 - 2_000
