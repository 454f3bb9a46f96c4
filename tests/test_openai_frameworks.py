"""Agent frameworks over the in-process OpenAI surface on the real default model: pydantic-ai,
LangChain and the OpenAI Agents SDK reach the engine with no socket and no second process, and
get structurally valid tool calls and typed outputs (the 270M base model is not expected to be
smart, only to be held to the shapes)."""

from __future__ import annotations

import json
import os
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from asyncpage import AsyncEngine

pytestmark = pytest.mark.slow
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")


class Weather(BaseModel):
    city: str = Field(max_length=16)
    celsius: int = Field(ge=-60, le=60)


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return json.dumps({"city": city, "celsius": 21})


@pytest.mark.parametrize("stream", [False, True])
async def test_pydantic_ai_agent_with_a_tool_runs_to_a_typed_result(default_engine: AsyncEngine, stream: bool) -> None:
    from pydantic_ai import Agent, RunContext, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.tools import ToolDefinition
    from pydantic_ai.usage import UsageLimits

    called: list[str] = []

    def weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return get_weather(city)

    async def once(ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        # A base model would call the weather tool forever; after one call only the output tool is left.
        return None if called else tool

    model = OpenAIChatModel("gemma", provider=OpenAIProvider(openai_client=default_engine.openai_client()))
    agent = Agent(model, output_type=Weather, tools=[Tool(weather, prepare=once)],
                  instructions="Answer with the weather.",
                  model_settings={"temperature": 0.0, "max_tokens": 64, "parallel_tool_calls": False})
    limits = UsageLimits(request_limit=6)
    if stream:
        async with agent.run_stream("Weather in Paris?", usage_limits=limits) as run:
            out = await run.get_output()
    else:
        out = (await agent.run("Weather in Paris?", usage_limits=limits)).output
    assert isinstance(out, Weather)


async def test_langchain_bind_tools_and_structured_output(default_engine: AsyncEngine) -> None:
    from langchain_openai import ChatOpenAI

    from asyncpage.openai import http_client

    llm = ChatOpenAI(model="gemma", api_key="x", base_url="http://asyncpage.local/v1", temperature=0, max_tokens=48,
                     http_async_client=http_client(default_engine))
    msg = await llm.bind_tools([get_weather], tool_choice="get_weather").ainvoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)
    w = await llm.with_structured_output(Weather, method="json_schema").ainvoke("Weather in Paris as JSON?")
    assert isinstance(w, Weather)


async def test_openai_agents_sdk_runner_with_a_function_tool(default_engine: AsyncEngine) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"21 C in {city}"

    agent = Agent(name="w", instructions="Use the tool, then answer.", tools=[weather],
                  model=OpenAIChatCompletionsModel(model="gemma", openai_client=default_engine.openai_client()),
                  model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=48,
                                               parallel_tool_calls=False),
                  tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
    assert len(calls) == 1 and result.final_output == f"21 C in {calls[0]}"


class Ticket(BaseModel):
    customer: str = Field(max_length=40)
    severity: Literal["low", "medium", "high", "critical"]
    refund: bool


TICKET = [{"role": "user", "content": "Extract the ticket.\nFrom: Dana Kim\n"
                                      "Our Acme printer broke down again, this is critical."}]


async def test_openai_parse_with_a_pydantic_response_format_returns_the_instance(default_engine: AsyncEngine) -> None:
    # The openai client's .parse sends a strict json_schema (additionalProperties false) and reads the
    # message back into the model.
    r = await default_engine.openai_client().chat.completions.parse(
        model="gemma", messages=TICKET, response_format=Ticket, temperature=0, max_tokens=64)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and isinstance(ch.message.parsed, Ticket)
    assert ch.message.parsed.severity == "critical"


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
async def test_instructor_returns_a_typed_instance(default_engine: AsyncEngine, mode: str) -> None:
    # TOOLS mode forces the named tool: exactly one call comes back, whatever parallel_tool_calls says
    # (instructor leaves it at OpenAI's default, True).
    import instructor

    client = instructor.from_openai(default_engine.openai_client(), mode=getattr(instructor.Mode, mode))
    out = await client.chat.completions.create(model="gemma", response_model=Ticket, messages=TICKET,
                                               max_retries=0, temperature=0, max_tokens=64)
    assert isinstance(out, Ticket) and out.severity == "critical"
