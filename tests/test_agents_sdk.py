"""The OpenAI Agents SDK with its default model class (Responses) runs a tool loop against
`cactus-edge serve` on SmolLM2 135M (a real instruct model: its replies end, which the SDK
requires, where the tiny test models' run to max_tokens)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")


def test_the_agents_sdk_runs_a_tool_loop_on_its_default_responses_model(smollm2_server):
    """A forced call, the tool run by the SDK, its output sent back as function_call_output, then
    the model's reply (the SDK resets tool_choice to auto after a call)."""
    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"It is cold in {city}."

    client = openai.AsyncOpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIResponsesModel(model="smollm2", openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", max_tokens=200, temperature=0)
    agent = agents.Agent(
        name="weather", instructions="Answer with the tool's result.", tools=[get_weather], model=model,
        model_settings=settings,
    )  # fmt: skip
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=4)
    assert called, "the SDK never ran the tool"
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds, kinds
    assert kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str) and result.final_output
