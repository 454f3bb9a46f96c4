"""The Responses API (issue 34 item 1) through the official client in-process, on the default model:
a forced function call with valid arguments, the next turn over previous_response_id with the tool's
output and most of the first turn's input cached, the streamed event sequence, retrieve and delete,
and the Agents SDK's Responses model running an agent with a function tool to its final output."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from asyncpage import AsyncEngine

pytestmark = pytest.mark.slow

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                           "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": PARAMS, "strict": True}
SYSTEM = "You are a weather assistant. " + "Answer briefly and use the tools you are given. " * 20


@pytest.fixture(scope="module")
def client(default_engine: AsyncEngine) -> openai.AsyncOpenAI:
    return default_engine.openai_client()


async def test_a_required_function_call_then_its_output_answers_with_the_first_turn_cached(
        client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(model="m", instructions=SYSTEM, input="Weather in Paris, in celsius?",
                                          tools=[WEATHER], tool_choice="required", max_output_tokens=48,
                                          temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
    assert first.usage is not None and first.usage.input_tokens > 200
    second = await client.responses.create(
        model="m", instructions=SYSTEM, previous_response_id=first.id, max_output_tokens=16, temperature=0,
        tools=[WEATHER],  # an agent sends its tools every turn (they are not inherited)
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C and sunny"}])
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert isinstance(second.output_text, str)
    assert second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 0.8 * first.usage.input_tokens, (cached, first.usage.input_tokens)


async def test_a_streamed_response_sends_the_event_sequence(client: openai.AsyncOpenAI) -> None:
    kinds: list[str] = []
    text: list[str] = []
    final: Any = None
    stream = await client.responses.create(model="m", input="Say hello.", max_output_tokens=8, temperature=0,
                                           stream=True)
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final is not None and final.output_text == "".join(text) and final.usage.output_tokens <= 8
    got = await client.responses.retrieve(final.id)
    assert got.id == final.id and got.output_text == final.output_text
    await client.responses.delete(final.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(final.id)


async def test_a_streamed_function_call_arrives_whole(client: openai.AsyncOpenAI) -> None:
    done: list[Any] = []
    stream = await client.responses.create(model="m", input="Weather in Rome, fahrenheit?", tools=[WEATHER],
                                           tool_choice="required", max_output_tokens=48, temperature=0, stream=True)
    async for event in stream:
        if event.type == "response.function_call_arguments.done":
            done.append(event.arguments)
    assert done and all(jsonschema.validate(json.loads(a), PARAMS) is None for a in done)


async def test_a_bad_previous_response_id_is_a_400_naming_it(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="m", input="hi", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_the_agents_sdk_responses_model_runs_an_agent_with_a_function_tool(default_engine: AsyncEngine) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"21 C in {city}"

    agent = Agent(name="w", instructions="Use the tool, then answer.", tools=[weather],
                  model=OpenAIResponsesModel(model="gemma", openai_client=default_engine.openai_client()),
                  model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=48,
                                               parallel_tool_calls=False),
                  tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
    assert len(calls) == 1 and result.final_output == f"21 C in {calls[0]}"
