"""The OpenAI Agents SDK with its default model class (Responses) runs a tool loop against
`cactus-edge serve` on SmolLM2 135M (a real instruct model: its replies end, which the SDK
requires, where the tiny test models' run to max_tokens)."""

from __future__ import annotations

import pytest

from cactus_edge.engine.engine import Engine
from cactus_edge.server import ServerSettings, create_server

from .conftest import TEST_THREADS

pytestmark = pytest.mark.slow
agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(smollm2_path):
    with Engine.load(str(smollm2_path), str(smollm2_path), n_ctx=2048, n_threads=TEST_THREADS) as engine:
        server = create_server(engine, ServerSettings(port=0, model_name="smollm2"))
        server.start()
        yield server
        server.stop()


def test_the_agents_sdk_runs_a_tool_loop_on_its_default_responses_model(server):
    """A forced call, the tool run by the SDK, its output sent back as function_call_output, then
    the model's reply (the SDK resets tool_choice to auto after a call)."""
    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"It is cold in {city}."

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
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
