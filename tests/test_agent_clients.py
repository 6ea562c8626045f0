"""The coding agents and SDKs that speak the Responses and Messages APIs, against `serve` on a tiny
pair with a long context (their prompts are 40-50 KB: tens of thousands of tiny-vocabulary tokens).

* Replays: tests/fixtures/agents/ holds request bodies recorded from Codex CLI, Claude Code, the
  `openai` and `anthropic` SDKs and the OpenAI Agents SDK (long prompt texts cut short; the
  structure as sent). Each is sent as recorded; every answer must parse with the SDK's own types,
  and an agent's second turn must reuse its first turn's prompt from the cache.
* Live: `codex exec` and `claude -p`, installed from npm (cached), each run against the server
  and ending with exit 0 and a final message, every request answered 200 (the server ends each
  tiny reply at a stop string: both agents take a reply cut by its budget as an error). A tiny
  model cannot make either agent call a tool; docs/integrations.md says which model did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pydantic
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.server import ServerSettings, create_server

from .agent_apis import KEY, read_events
from .conftest import TEST_THREADS
from .tiny_gguf import write_tiny_llama

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "agents").glob("*.json"))
N_CTX = 65536
MODEL = "tiny"
REPLY_CAP = 200  # tokens per reply (the tiny models never stop on their own); room for a forced call
CLIENTS = {"@openai/codex": "0.169.0", "@anthropic-ai/claude-code": "2.1.328"}
NPM_FOLDER = Path.home() / ".cache" / "cactus-edge" / "npm-clients"
RUN_SECONDS = 600
LIVE_STOP = "e"  # common in the tiny vocabulary's words: a reply ends within a few tokens
RESPONSE_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("long-context")
    draft = write_tiny_llama(folder / "draft.gguf", seed=1, n_ctx_train=N_CTX)
    target = write_tiny_llama(folder / "target.gguf", seed=2, base_seed=1, noise=0.2, n_ctx_train=N_CTX)
    return draft, target


def serving(pair: tuple[Path, Path], base_config: GenerationConfig | None = None):
    with Engine.load(str(pair[0]), str(pair[1]), n_ctx=N_CTX, n_threads=TEST_THREADS) as engine:
        settings = ServerSettings(
            port=0, api_key=KEY, model_name=MODEL, max_tokens_cap=REPLY_CAP, metrics=True,
            base_config=base_config or GenerationConfig(),
        )  # fmt: skip
        server = create_server(engine, settings)
        server.start()
        yield server
        server.stop()


@pytest.fixture(scope="module")
def long_server(long_pair):
    yield from serving(long_pair)


@pytest.fixture(scope="module")
def live_server(long_pair):
    """For the agents themselves: they take a reply cut by its token budget as an error, and the
    tiny models never end one, so the server's defaults end each at a stop string (greedy: the
    same reply on every run), as a user's --stop would."""
    yield from serving(long_pair, GenerationConfig(temperature=0, stop=(LIVE_STOP,)))


# --- replays -----------------------------------------------------------------------------------


def replay(http: httpx.Client, request: dict, previous_id: str | None = None) -> tuple[int, dict]:
    """Send one recorded request; (status, its usage as (prompt tokens, cached tokens) or the
    counted tokens, and a response's id), checking the answer against the SDK's types. A recorded
    previous_response_id (the recording server's) becomes ``previous_id``."""
    body = {**request["body"], "model": MODEL}
    if "previous_response_id" in body:
        body["previous_response_id"] = previous_id
    headers = {**request["headers"], "authorization": f"Bearer {KEY}"}
    path = request["path"]
    if path.startswith("/v1/messages/count_tokens"):
        response = http.post(path, json=body, headers=headers)
        return response.status_code, {
            "counted": MessageTokensCount.model_validate(response.json()).input_tokens
        }
    if not body.get("stream"):
        response = http.post(path, json=body, headers=headers)
        if response.status_code != 200:
            return response.status_code, {"error": response.text}
        if path.startswith("/v1/messages"):
            return 200, _message_usage(Message.model_validate(response.json()).model_dump()["usage"])
        answer = Response.model_validate(response.json())
        calls = [item.call_id for item in answer.output if item.type == "function_call"]
        return 200, {**_response_usage(answer.model_dump()["usage"]), "id": answer.id, "calls": calls}
    with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, {"error": response.text}
        events = [data for _, data in read_events(response)]
    if path.startswith("/v1/messages"):
        for event in events:
            if event["type"] != "ping":
                MESSAGE_EVENTS.validate_python(event)
        assert events[-1]["type"] == "message_stop"
        return 200, _message_usage(events[-2]["usage"])
    for event in events:
        RESPONSE_EVENTS.validate_python(event)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return 200, {**_response_usage(events[-1]["response"]["usage"]), "id": events[-1]["response"]["id"]}


def with_our_call_ids(request: dict, our_calls: dict[str, str]) -> dict:
    """The request with the recording server's call ids replaced by ours."""
    text = json.dumps(request)
    for recorded, ours in our_calls.items():
        text = text.replace(recorded, ours)
    return json.loads(text)


def forcing_the_recorded_call(request: dict) -> dict:
    """A Responses request made to call the tool the recording server called, with room to."""
    name = request["answered_with_calls"][0]["name"]
    forced = {"tool_choice": {"type": "function", "name": name}, "max_output_tokens": REPLY_CAP}
    # Greedy, and the call's strings held short (a tiny model's never end): a whole call on every run.
    tools = [_short_strings(tool) if tool.get("name") == name else tool for tool in request["body"]["tools"]]
    return {**request, "body": {**request["body"], **forced, "tools": tools, "temperature": 0}}


def _short_strings(tool: dict) -> dict:
    properties = tool["parameters"].get("properties", {})
    short = {key: {**value, "maxLength": 8} if value.get("type") == "string" else value
             for key, value in properties.items()}  # fmt: skip
    return {**tool, "parameters": {**tool["parameters"], "properties": short}}


def _message_usage(usage: dict) -> dict:
    cached = usage["cache_read_input_tokens"]
    return {"prompt": usage["input_tokens"] + cached, "cached": cached}


def _response_usage(usage: dict) -> dict:
    return {"prompt": usage["input_tokens"], "cached": usage["input_tokens_details"]["cached_tokens"]}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fixture", FIXTURES, ids=[path.stem for path in FIXTURES])
def test_each_recorded_request_is_answered_in_its_apis_types(long_server, fixture):
    recorded = json.loads(fixture.read_text())
    previous_id, our_calls = None, {}
    requests = recorded["requests"]
    with httpx.Client(base_url=long_server.url, timeout=RUN_SECONDS) as http:
        for index, request in enumerate(requests):
            request = with_our_call_ids(request, our_calls)
            chained = any("previous_response_id" in later["body"] for later in requests[index + 1 :])
            if chained and request.get("answered_with_calls"):  # our reply must make the call too
                request = forcing_the_recorded_call(request)
            status, answer = replay(http, request, previous_id)
            assert status == 200, (request["path"], answer)
            previous_id = answer.get("id", previous_id)
            for recorded_call, ours in zip(
                request.get("answered_with_calls", ()), answer.get("calls", ()), strict=False
            ):
                our_calls[recorded_call["call_id"]] = ours


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["codex-exec", "claude-code-print"])
def test_an_agents_second_turn_reuses_its_first_turns_prompt(long_server, name):
    """Turn 2 is turn 1's conversation plus a tool call and its output: all of turn 1's prompt
    comes back from the cache (Claude Code's billing header, which changes, is left out)."""
    first, second = json.loads((FIXTURES[0].parent / f"{name}.json").read_text())["requests"]
    with httpx.Client(base_url=long_server.url, timeout=RUN_SECONDS) as http:
        _, turn_one = replay(http, first)
        _, turn_two = replay(http, second)
    assert turn_one["prompt"] > 300
    assert turn_two["cached"] >= turn_one["prompt"] - 8, (turn_one, turn_two)


# --- live clients ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def npm_clients() -> Path:
    """Codex CLI and Claude Code installed from npm into a cache folder (once)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agents' live runs need Node.js and npm")
    folder = NPM_FOLDER / "-".join(f"{name.split('/')[-1]}{version}" for name, version in CLIENTS.items())
    if not (folder / "node_modules" / ".bin" / "codex").exists():
        folder.mkdir(parents=True, exist_ok=True)
        packages = [f"{name}@{version}" for name, version in CLIENTS.items()]
        result = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), *packages],
            capture_output=True, text=True, timeout=RUN_SECONDS,
        )  # fmt: skip
        if result.returncode != 0:
            if any(word in result.stderr for word in ("ENOTFOUND", "ECONNREFUSED", "ETIMEDOUT", "EAI_AGAIN")):
                pytest.skip(f"the npm registry is unreachable: {result.stderr.strip()[-200:]}")
            raise AssertionError(f"npm install failed: {result.stderr[-2000:]}")
    return folder / "node_modules" / ".bin"


def failed_requests(server) -> dict[str, float]:
    """Requests answered with a status other than 200 so far, from /metrics."""
    text = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=30).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("cactus_edge_requests_total{") and 'status="200"' not in line:
            counts[line.split()[0]] = float(line.split()[-1])
    return counts


def run_client(command: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=RUN_SECONDS,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.mark.timeout(900)
def test_codex_exec_runs_against_serve_to_a_final_message(live_server, npm_clients, tmp_path):
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "cactus"\n\n[model_providers.cactus]\nname = "cactus-edge"\n'
        f'base_url = "{live_server.url}/v1"\nwire_api = "responses"\nenv_key = "CACTUS_EDGE_API_KEY"\n'
        "stream_max_retries = 0\nrequest_max_retries = 0\n"
    )
    before = failed_requests(live_server)
    result = run_client(
        [str(npm_clients / "codex"), "exec", "--skip-git-repo-check", "say hello"],
        {"CODEX_HOME": str(home), "CACTUS_EDGE_API_KEY": KEY},
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), result.stderr[-3000:]  # codex exec prints the final message
    assert failed_requests(live_server) == before


@pytest.mark.timeout(900)
def test_claude_print_runs_against_serve_to_a_final_message(live_server, npm_clients, tmp_path):
    env = {
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": live_server.url,
        "ANTHROPIC_API_KEY": KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    before = failed_requests(live_server)
    result = run_client([str(npm_clients / "claude"), "-p", "say hello", "--model", MODEL], env, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.strip()
    assert failed_requests(live_server) == before
