"""`cactus-edge serve`: a real server on 127.0.0.1 (port 0) over the tiny pair, talked to with the
real `openai` client for the happy paths and with httpx for everything else.

Every wait is bounded (client timeouts, WAIT-second polls), every server stops by itself at the
end of its fixture, and generations stay a few tokens long (the tiny models are slow on 2 shared
cores). Queue tests hold the engine with a gate instead of relying on timing."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.errors import ContextLengthError, InvalidSettingError
from cactus_edge.openai_api import create_chat_completion
from cactus_edge.server import Server, ServerApp, ServerSettings, create_server, setting_flags

from .conftest import TEST_THREADS

WAIT = 60  # seconds: generous bound for every wait
KEY = "test-key-123"
MODEL = "tiny"
ORIGIN = "http://app.example"
MESSAGES = [{"role": "user", "content": "the water is hot and"}]
GREEDY = {"temperature": 0, "seed": 0, "speculative": {"method": "sps", "n_draft": 3}}
AUTH = {"Authorization": f"Bearer {KEY}"}


def wait_until(condition, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server(engine):
    settings = ServerSettings(
        port=0,
        api_key=KEY,
        metrics=True,
        cors_origins=(ORIGIN,),
        model_name=MODEL,
        max_body_bytes=64 * 1024,
    )
    server = create_server(engine, settings)
    server.start()
    yield server
    assert server.stop(timeout=WAIT)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=WAIT) as client:
        yield client


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=WAIT, max_retries=0)


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}


def sse_events(response: httpx.Response) -> list:
    """The data of each SSE event ("[DONE]" stays a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_normal_request_works(http) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(max_tokens=1, **GREEDY))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


def assert_blocks_consistent(body: dict, max_tokens: int) -> None:
    usage, timings, stats, spec = body["usage"], body["timings"], body["stats"], body["speculative"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert timings["predicted_n"] == usage["completion_tokens"] <= max_tokens
    for key in ("prompt_n", "prompt_ms", "predicted_ms", "predicted_per_second"):
        assert timings[key] >= 0
    assert timings["draft_n_accepted"] <= timings["draft_n"]
    assert stats["accepted_draft_tokens_count"] <= stats["total_draft_tokens_count"] == timings["draft_n"]
    assert (
        stats["accepted_draft_tokens_count"] + stats["rejected_draft_tokens_count"]
        == stats["total_draft_tokens_count"]
    )
    assert stats["time_to_first_token"] > 0 and stats["tokens_per_second"] >= 0
    assert spec["accepted"] == timings["draft_n_accepted"] and spec["drafted"] == timings["draft_n"]
    calls = spec["verifier_calls"]
    assert calls >= 1 and sum(spec["draft_length_histogram"].values()) == calls
    assert spec["acceptance_length"] == pytest.approx(spec["accepted"] / calls)
    if stats["stop_reason"] == "length":  # no EOS: every verifier call emitted accepted + 1 tokens
        assert spec["tokens_per_verifier_call"] == pytest.approx(spec["acceptance_length"] + 1)


# --- the openai client ---------------------------------------------------------------------------


def test_openai_client_non_streaming_with_statistics(client):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=GREEDY)
    assert result.object == "chat.completion" and result.model == MODEL
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert result.usage.completion_tokens <= 6 and result.usage.prompt_tokens > 0
    body = result.model_dump()
    assert_blocks_consistent(body, 6)
    assert body["speculative"]["method"] == "sps" and body["speculative"]["lossless"] is True
    assert body["speculative"]["delta"] is None and body["speculative"]["kl_mean"] == 0.0


def test_openai_client_streaming_with_include_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 6
    assert all(c.usage is None for c in chunks[:-1])  # OpenAI's: usage only on the last chunk
    last = chunks[-1].model_dump()
    assert_blocks_consistent(last, 6)
    assert "speculative" in finish[0].model_dump() and "timings" in finish[0].model_dump()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    same = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=GREEDY)
    assert text == same.choices[0].message.content  # greedy: streaming changes nothing


def test_extra_body_chooses_the_acceptance_rule(client):
    settings = {
        "temperature": 0.6,
        "seed": 7,
        "speculative": {"method": "cactus", "delta": 0.5, "n_draft": 2, "kl_budget": 0.25},
    }
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=settings)
    spec = result.model_dump()["speculative"]
    assert spec["method"] == "cactus" and spec["delta"] == 0.5 and spec["lossless"] is False
    assert spec["kl_budget"] == 0.25 and spec["kl_total"] <= 0.25 + 1.0
    assert set(spec["draft_length_histogram"]) <= {"0", "1", "2"}
    assert_blocks_consistent(result.model_dump(), 5)
    exact = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_body={"speculative": {"method": "exact"}}
    )
    assert exact.model_dump()["speculative"]["method"] == "exact"


def test_completions_endpoint_streaming_and_not(client):
    result = client.completions.create(model=MODEL, prompt="the water is", max_tokens=4, extra_body=GREEDY)
    assert result.object == "text_completion" and result.choices[0].text
    assert_blocks_consistent(result.model_dump(), 4)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="the water is", max_tokens=4, stream=True, extra_body=GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == result.choices[0].text
    assert chunks[-1].choices[0].finish_reason == result.choices[0].finish_reason


def test_stop_strings_never_leak_into_the_stream(client):
    text = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, extra_body=GREEDY)
    text = text.choices[0].message.content
    assert len(text) >= 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, stop=[stop], stream=True, extra_body=GREEDY
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[: text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_conversation_reuses_the_cached_prefix(http):
    first = http.post(CHAT, json=chat_body(max_tokens=3, **GREEDY)).json()
    reply = first["choices"][0]["message"]["content"]
    follow_up = [*MESSAGES, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then"}]
    second = http.post(CHAT, json=chat_body(messages=follow_up, max_tokens=2, **GREEDY)).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == second["timings"]["cache_n"] >= first["usage"]["prompt_tokens"] - 1
    assert second["timings"]["prompt_n"] == second["usage"]["prompt_tokens"] - cached


def test_stream_order_on_the_wire(http):
    body = chat_body(stream=True, stream_options={"include_usage": True}, **GREEDY)
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    role, *content, finish, usage, _ = events
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert all(
        set(e["choices"][0]["delta"]) == {"content"} and e["choices"][0]["finish_reason"] is None
        for e in content
    )
    assert finish["choices"][0]["finish_reason"] in ("stop", "length") and finish["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] <= 4
    for block in ("timings", "stats", "speculative"):
        assert block in finish and block in usage


def test_models_and_health(http, server):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["meta"]["n_ctx"] == 512
    meta = models["data"][0]["meta"]
    assert meta["target_device"] == "CPU" and meta["draft_device"] in ("CPU", None)  # where each runs
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert http.get("/health", headers={"Authorization": ""}).json() == {"status": "ok"}


# --- one shape for the Python facade and the server -------------------------------------------------


def key_tree(value):
    """A response's keys at every level, each value only as "null" or "value" (ids, times and
    counts differ between two runs of the same generation; which keys there are must not)."""
    if isinstance(value, dict):
        return {key: key_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [key_tree(item) for item in value]
    return "null" if value is None else "value"


def served_json(client, **options):
    """The server's answer as it came over the wire, through the openai client: the body, or
    the data of every stream event but [DONE]."""
    create = client.chat.completions.with_streaming_response.create
    with create(model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=GREEDY, **options) as response:
        if not options.get("stream"):
            return response.json()
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def reply_text(answer) -> str:
    if isinstance(answer, dict):
        return answer["choices"][0]["message"]["content"]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in answer if c["choices"])


@pytest.mark.parametrize(
    "options",
    [{}, {"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}],
    ids=["complete", "stream", "stream with usage"],
)
def test_the_python_facade_and_the_server_answer_in_the_same_shapes(client, engine, options):
    """One generation (tiny pair, greedy, fixed seed) through create_chat_completion and through
    the server with the real openai client over 127.0.0.1: the same keys at every level, in the
    body or in every chunk, and the same text."""
    served = served_json(client, **options)
    local = create_chat_completion(engine, MESSAGES, model=MODEL, max_tokens=6, **GREEDY, **options)
    local = list(local) if options.get("stream") else local
    assert key_tree(local) == key_tree(served)
    assert reply_text(local) == reply_text(served)


# --- errors: status + envelope, then the server keeps serving ------------------------------------

LONG = [{"role": "user", "content": "the water is hot and " * 200}]
CHAT = "/v1/chat/completions"
ERROR_CASES = [
    # (name, method, path, kwargs, status, param, code)
    ("malformed JSON", "POST", CHAT, {"content": b'{"messages": ['}, 400, None, "invalid_json"),
    ("not an object", "POST", CHAT, {"json": [1, 2]}, 400, None, "invalid_json"),
    ("wrong type", "POST", CHAT, {"json": chat_body(temperature="hot")}, 400, "temperature", None),
    ("out of range", "POST", CHAT, {"json": chat_body(top_p=2.0)}, 400, "top_p", None),
    ("bad delta", "POST", CHAT, {"json": chat_body(speculative={"delta": -1})}, 400, "speculative.delta",
     None),
    ("n > 1", "POST", CHAT, {"json": chat_body(n=2)}, 400, "n", "unsupported_parameter"),
    ("logprobs", "POST", CHAT, {"json": chat_body(logprobs="yes")}, 400, "logprobs", None),
    ("tools", "POST", CHAT, {"json": chat_body(tools=[{"type": "function"}])}, 400, "tools", None),
    ("no messages", "POST", CHAT, {"json": {"model": MODEL}}, 400, "messages", None),
    ("bad prompt", "POST", "/v1/completions", {"json": {"prompt": 5}}, 400, "prompt", None),
    ("unknown ids", "POST", "/v1/completions", {"json": {"prompt": [10**6]}}, 400, "prompt", "invalid_value"),
    ("context", "POST", CHAT, {"json": chat_body(messages=LONG)}, 400, "messages", "context_length_exceeded"),
    ("unknown model", "POST", CHAT, {"json": chat_body(model="gpt-4o")}, 404, "model", "model_not_found"),
    ("unknown route", "GET", "/v1/embeddings", {}, 404, None, "unknown_url"),
    ("wrong method", "GET", CHAT, {}, 405, None, "method_not_allowed"),
    ("too large", "POST", CHAT, {"content": b"x" * (65 * 1024)}, 413, None, "request_too_large"),
    ("chunked", "POST", CHAT, {"content": iter([b"x" * 40_000] * 2)}, 413, None, "request_too_large"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "method", "path", "kwargs", "status", "param", "code"),
    ERROR_CASES,
    ids=[c[0] for c in ERROR_CASES],
)
def test_errors_use_the_envelope_and_the_server_keeps_serving(
    http, name, method, path, kwargs, status, param, code
):
    response = http.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if code:
        assert error["code"] == code
    if name == "context":
        assert "512" in error["message"] and "tokens" in error["message"]
    assert_normal_request_works(http)


@pytest.mark.parametrize(
    "refusal, path, status, param, code",
    [
        (InvalidSettingError("no draft here", param="drafter"), CHAT, 400, "speculative.drafter",
         "invalid_value"),
        (InvalidSettingError("no such id", param="prompt"), "/v1/completions", 400, "prompt",
         "invalid_value"),
        (ContextLengthError("too long for 512"), CHAT, 400, "messages", "context_length_exceeded"),
    ],
)  # fmt: skip
def test_the_engine_checks_each_request_and_the_server_adds_openais_names(
    server, http, monkeypatch, refusal, path, status, param, code
):
    """The server asks Engine.check_request before queueing a request, and keeps its message:
    it only adds the status, the code and the request's name for the field."""
    checked = []

    def check_request(prompt_tokens, config):
        checked.append(config)
        raise refusal

    monkeypatch.setattr(server.app.engine, "check_request", check_request)
    body = chat_body() if path == CHAT else {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}
    response = http.post(path, json=body)
    assert response.status_code == status and len(checked) == 1
    assert response.json()["error"] == {"message": str(refusal), "type": "invalid_request_error",
                                        "param": param, "code": code}  # fmt: skip
    monkeypatch.undo()
    assert_normal_request_works(http)


def test_an_unexpected_error_is_a_500_without_details(server, http, monkeypatch):
    def broken_stream(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(
        server.app.scheduler, "engine", type("Broken", (), {"stream": staticmethod(broken_stream)})
    )
    response = http.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 500
    error = response.json()["error"]
    assert (
        error["type"] == "server_error" and "secret" not in response.text and "Traceback" not in response.text
    )
    monkeypatch.undo()
    assert_normal_request_works(http)
    # A bug in the request path itself (here: tokenizing) is a 500 envelope too.
    monkeypatch.setattr(server.app.engine, "tokenize_chat", broken_stream)
    response = http.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal"
    assert "secret" not in response.text
    monkeypatch.undo()
    assert_normal_request_works(http)


# --- security -------------------------------------------------------------------------------------


def test_api_key_is_required(server, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        with httpx.Client(base_url=server.url, headers=headers, timeout=WAIT) as anonymous:
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
                response = anonymous.request(method, path, json=chat_body())
                assert response.status_code == 401, (headers, path)
                assert response.json()["error"]["code"] == "invalid_api_key"
            assert anonymous.get("/health").status_code == 200  # open: a launcher polls it
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", timeout=WAIT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert_normal_request_works(http)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8765", "127.0.0.1.evil.example", "[::2]:1"])
def test_foreign_host_headers_are_refused(http, host):
    response = http.post("/v1/chat/completions", json=chat_body(), headers={"Host": host})
    assert response.status_code == 403 and response.json()["error"]["code"] == "host_not_allowed"
    assert_normal_request_works(http)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1:9", "[::1]:8765", "LOCALHOST"])
def test_loopback_host_headers_are_accepted(http, host):
    assert http.get("/v1/models", headers={"Host": host}).status_code == 200


def test_cors_only_for_configured_origins(http):
    refused = http.post("/v1/chat/completions", json=chat_body(), headers={"Origin": "http://evil.example"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in refused.headers
    plain = http.get("/v1/models")
    assert "access-control-allow-origin" not in plain.headers  # no Origin, no CORS headers
    allowed = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-credentials" not in allowed.headers
    preflight = http.options(
        "/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Authorization": ""},
    )
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == ORIGIN


# --- disconnects -----------------------------------------------------------------------------------


def cancelled(server) -> int:
    return server.app.metrics.generations["cancelled"]


def test_disconnect_mid_stream_cancels_and_the_next_request_equals_a_fresh_engine(gated, tiny_pair):
    engine, start = gated
    engine.pace, server = 0.02, start()  # 400 tokens take 8 s: far longer than noticing the hang-up
    engine.gate.set()
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        before, completed_before = cancelled(server), server.app.metrics.completion_tokens
        body = chat_body(max_tokens=400, stream=True, temperature=0.6, seed=1, speculative={"n_draft": 3})
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if '"content": "' in line and '"role"' not in line:
                    break  # one content chunk seen: hang up mid-stream
        wait_until(lambda: cancelled(server) == before + 1, "the generation to be cancelled")
        assert server.app.metrics.completion_tokens - completed_before < 400
        wait_until(lambda: server.app.scheduler.running == 0, "the slot to free")
        served = http.post("/v1/chat/completions", json=chat_body(max_tokens=8, **GREEDY)).json()
        config = GenerationConfig(method="sps", n_draft=3, temperature=0, seed=0, max_tokens=8)
        with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512) as fresh:
            expected = fresh.chat(MESSAGES, config)
        assert served["choices"][0]["message"]["content"] == expected.text
        assert served["usage"]["completion_tokens"] == len(expected.tokens)


# --- the queue: a gate holds the engine, so nothing depends on timing -------------------------------


class GatedEngine:
    """The real engine; each stream records its prompt when it starts and then waits for ``gate``.
    With ``pace`` each event also waits that many seconds, so a long generation cannot finish
    before the server notices a client that hung up (the tiny model makes hundreds of tokens a
    second)."""

    def __init__(self, engine, pace: float = 0.0):
        self.engine, self.pace = engine, pace
        self.gate = threading.Event()
        self.started: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, prompt, config, cancel=None, timeout=None):
        events = self.engine.stream(prompt, config, cancel=cancel, timeout=timeout)

        def gated():
            self.started.append(list(prompt))
            if not self.gate.wait(WAIT):
                raise TimeoutError("the test never opened the gate")
            for event in events:
                time.sleep(self.pace)
                yield event

        return gated()


@pytest.fixture
def gated(engine):
    gated = GatedEngine(engine)
    servers = []

    def start(**settings):
        server = create_server(gated, ServerSettings(port=0, model_name=MODEL, **settings))
        server.start()
        servers.append(server)
        return server

    yield gated, start
    gated.gate.set()
    for server in servers:
        assert server.stop(timeout=WAIT)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class StreamingClient(threading.Thread):
    """One streaming chat request in its own thread; ``first_content`` is set at the first content chunk."""

    def __init__(self, url: str, messages: list[dict], max_tokens: int = 2, model: str = MODEL):
        super().__init__(daemon=True)
        self.url, self.messages, self.max_tokens, self.model = url, messages, max_tokens, model
        self.status, self.events, self.error, self.retry_after = None, [], None, None
        self.first_content = threading.Event()

    def run(self):
        body = chat_body(
            messages=self.messages, max_tokens=self.max_tokens, model=self.model, stream=True, **GREEDY
        )
        try:
            with (
                httpx.Client(timeout=WAIT) as http,
                http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response,
            ):
                self.status = response.status_code
                if response.status_code != 200:
                    response.read()
                    self.events = [response.json()]
                    self.retry_after = response.headers.get("retry-after")
                    return
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        if len(self.events) == 2:
                            self.first_content.set()
        except BaseException as error:  # reported by the test
            self.error = error

    def finish_chunks(self) -> list[dict]:
        return [e for e in self.events if e != "[DONE]" and e["choices"] and e["choices"][0]["finish_reason"]]


def test_eight_streaming_clients_complete_in_arrival_order(gated):
    engine, start = gated
    server = start()
    holder = StreamingClient(server.url, user("hold the engine"))
    holder.start()
    wait_until(lambda: len(engine.started) == 1, "the first request to run")
    clients = []
    for index in range(8):
        client = StreamingClient(server.url, user(f"client {index}"))
        client.start()
        clients.append(client)
        wait_until(lambda n=index + 1: server.app.scheduler.waiting == n, f"client {index} to queue")
    models = httpx.get(f"{server.url}/v1/models", timeout=5)  # never waits behind a generation
    assert models.status_code == 200 and httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    engine.gate.set()
    for client in [holder, *clients]:
        client.join(WAIT)
        assert not client.is_alive() and client.error is None and client.status == 200
        assert client.events[-1] == "[DONE]"
        assert len(client.finish_chunks()) == 1
    expected = [engine.tokenize_chat(user(f"client {index}")) for index in range(8)]
    assert engine.started[1:] == expected


def test_max_queue_overflow_gets_503_and_only_the_overflow(gated):
    engine, start = gated
    server = start(max_queue=2)
    running = StreamingClient(server.url, user("running"))
    running.start()
    wait_until(lambda: len(engine.started) == 1, "the first request to run")
    waiting = [StreamingClient(server.url, user(f"waiting {i}")) for i in range(2)]
    for index, client in enumerate(waiting):
        client.start()
        wait_until(lambda n=index + 1: server.app.scheduler.waiting == n, "a request to queue")
    overflow = [StreamingClient(server.url, user(f"overflow {i}")) for i in range(2)]
    for client in overflow:
        client.start()
        client.join(WAIT)
        assert client.status == 503 and client.retry_after
        assert client.events[0]["error"]["code"] == "queue_full"
    # A full queue refuses before reading the body (issue 23): even a request that could never
    # run gets 503, since finding that out (parsing, tokenizing) is the work the queue bounds.
    for body in (chat_body(messages=LONG), chat_body(model="gpt-4o")):
        response = httpx.post(f"{server.url}{CHAT}", json=body, timeout=10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "queue_full"
    engine.gate.set()
    for client in [running, *waiting]:
        client.join(WAIT)
        assert client.error is None and client.status == 200 and client.events[-1] == "[DONE]"
    assert len(engine.started) == 3


def test_a_request_the_engine_refuses_is_answered_at_once_in_its_words(gated):
    """The server asks Engine.check_request before queueing, instead of checking the prompt
    itself: a prompt too long for the context gets its 400 while another generation holds the
    engine, with the engine's own message and OpenAI's code and field."""
    engine, start = gated
    server = start()
    holder = StreamingClient(server.url, user("hold the engine"))
    holder.start()
    wait_until(lambda: len(engine.started) == 1, "the first request to run")
    with pytest.raises(ContextLengthError) as refused:
        engine.check_request(engine.tokenize_chat(LONG), GenerationConfig())
    response = httpx.post(f"{server.url}{CHAT}", json=chat_body(messages=LONG), timeout=10)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": str(refused.value), "type": "invalid_request_error",
                                        "param": "messages", "code": "context_length_exceeded"}  # fmt: skip
    engine.gate.set()
    holder.join(WAIT)
    assert holder.status == 200 and len(engine.started) == 1  # the refused one never queued


def test_disconnect_while_waiting_for_a_full_response_cancels(gated):
    engine, start = gated
    engine.pace = 0.02  # 400 tokens take 8 s: far longer than noticing the hang-up
    server = start()
    with pytest.raises(httpx.ReadTimeout):  # the gate holds the generation: the client gives up
        httpx.post(f"{server.url}{CHAT}", json=chat_body(max_tokens=400, **GREEDY), timeout=1.0)
    assert len(engine.started) == 1
    engine.gate.set()
    wait_until(lambda: server.app.metrics.generations["cancelled"] == 1, "the generation to be cancelled")
    assert server.app.metrics.completion_tokens < 400
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        assert_normal_request_works(http)


def test_health_is_503_while_loading_and_generation_waits_for_the_model():
    running = Server(ServerApp(None, ServerSettings(port=0)))
    running.start()
    try:
        health = httpx.get(f"{running.url}/health", timeout=WAIT)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        response = httpx.post(f"{running.url}/v1/chat/completions", json=chat_body(model=None), timeout=WAIT)
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_loading"
        assert response.headers["retry-after"]
    finally:
        assert running.stop(timeout=WAIT)


def test_unix_socket(tmp_path):
    path = tmp_path / "cactus.sock"
    server = Server(ServerApp(None, ServerSettings(uds=str(path))))
    server.start()
    try:
        assert path.stat().st_mode & 0o077 == 0  # only this user may connect
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), timeout=WAIT) as http:
            assert http.get("http://localhost/health").json()["status"] == "loading"
    finally:
        assert server.stop(timeout=WAIT)
    assert not path.exists()


# --- the command ------------------------------------------------------------------------------------


# `cactus-edge serve` as `python -m cactus_edge.cli.main` runs it, except that a request's generation
# pauses after its first visible text until it is cancelled (or HELD s pass): the tiny model makes
# hundreds of tokens a second, so unpaced, a 300-token stream could end before SIGTERM arrives.
HELD = 2 * WAIT
HELD_SERVE = f"""
import runpy
from cactus_edge.engine.engine import Engine

stream = Engine.stream


def held(self, prompt, config=None, *, cancel=None, timeout=None):
    events = stream(self, prompt, config, cancel=cancel, timeout=timeout)
    if cancel is None:  # the warm-up, not a request
        return events

    def until_cancelled():
        paused = False
        for event in events:
            yield event
            if event.text and not paused:
                paused = True
                cancel.wait({HELD})

    return until_cancelled()


Engine.stream = held
runpy.run_module("cactus_edge.cli.main", run_name="__main__", alter_sys=True)
"""


def test_sigterm_mid_stream_exits_0(tiny_pair):
    command = [sys.executable, "-c", HELD_SERVE, "serve", "--draft", str(tiny_pair[0])]
    command += ["--target", str(tiny_pair[1]), "--n-ctx", "512", "--port", "0", "--json"]
    command += ["--threads", str(TEST_THREADS)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
        ready = json.loads(lines.get(timeout=120))
        assert ready["event"] == "listening" and ready["url"] == f"http://127.0.0.1:{ready['port']}"
        assert ready["model"] == "tiny-target"
        assert ready["models"].endswith("-> target tiny-target.gguf · CPU")  # which pair runs, where
        client = StreamingClient(ready["url"], MESSAGES, max_tokens=300, model="tiny-target")
        client.start()
        assert client.first_content.wait(WAIT), (client.status, client.events, client.error)
        begin = time.monotonic()
        process.send_signal(signal.SIGTERM)  # the generation is paused: it is mid-stream
        assert process.wait(timeout=WAIT) == 0, process.stderr.read()
        assert time.monotonic() - begin < WAIT < HELD  # the cancel came from SIGTERM, not the pause's end
        client.join(WAIT)
        assert not client.is_alive()
        finishes = client.finish_chunks()
        assert finishes and client.events[-1] == "[DONE]"
        assert finishes[0]["usage"]["completion_tokens"] < 300  # cancelled, not run to the end
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT)


def test_run_warms_the_engine_up_before_announcing():
    """`serve` calibrates `auto` and builds the grammar tokenizer index before it says it is
    ready, so no request pays for them (the index build would stall the event loop)."""
    from cactus_edge.server import run

    calls = []

    class FakeEngine:
        def warm_up(self, grammars=False):
            calls.append(("warm_up", grammars))

        def close(self, wait=5.0):
            calls.append("close")

    def announce(server):
        calls.append("announce")
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: `run` returns

    run(FakeEngine, ServerSettings(port=0), announce)
    assert calls == [("warm_up", True), "announce", "close"]

    class BrokenEngine(FakeEngine):
        def warm_up(self, grammars=False):
            raise RuntimeError("warm-up failed")

    calls.clear()
    with pytest.raises(RuntimeError, match="warm-up failed"):
        run(BrokenEngine, ServerSettings(port=0), announce)
    assert calls == ["close"]  # the models are freed; nothing was announced


def test_serve_help_lists_the_flags():
    from click.testing import CliRunner

    from cactus_edge.cli.main import main

    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for flag in ("--host", "--port", "--uds", "--api-key", "--cors-origin", "--allowed-host", "--max-queue"):
        assert flag in result.output
    assert "--max-tokens-cap" in result.output and "--metrics" in result.output and "8765" in result.output
    for flag in ("--max-body-bytes", "--model-name", "--json", "--idle-timeout", "--header-timeout"):
        assert flag in result.output
    assert "--body-timeout" in result.output and "--max-connections" in result.output
    assert "--debug" in result.output and "--shutdown-grace" in result.output


def serve_settings(monkeypatch, *args: str) -> tuple[ServerSettings | None, str]:
    """(the ServerSettings `cactus-edge serve ARGS` would run with, its stderr); nothing runs."""
    from click.testing import CliRunner

    from cactus_edge.cli.main import main

    seen = {}
    monkeypatch.setattr("cactus_edge.server.run", lambda load, settings, announce: seen.update(s=settings))
    result = CliRunner().invoke(main, ["serve", *args], env={"CACTUS_EDGE_API_KEY": ""})
    assert result.exit_code == 0, result.output
    return seen.get("s"), result.stderr


def test_serve_flags_are_the_settings_fields(monkeypatch, tiny_args):
    """Every ServerSettings field but the two the shared flags fill (--system and the sampling
    flags) is a `serve` flag; what is not given keeps the field's default."""
    fields = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
    assert {flag.field for flag in setting_flags()} == fields.keys() - {"base_config", "default_system"}
    given = ["--idle-timeout", "2.5", "--debug", "--max-connections", "9", "--system", "be brief"]
    given += ["--cors-origin", "http://a.example", "--cors-origin", "http://b.example", "--method", "sps"]
    settings, _ = serve_settings(monkeypatch, *tiny_args, *given)
    assert (settings.idle_timeout, settings.debug, settings.max_connections) == (2.5, True, 9)
    assert settings.cors_origins == ("http://a.example", "http://b.example")
    assert settings.default_system == "be brief" and settings.base_config.method == "sps"
    assert settings.model_name == "tiny-target" and settings.api_key is None  # an empty key: none
    changed = {"idle_timeout", "debug", "max_connections", "cors_origins", "model_name"}
    for name in fields.keys() - changed - {"base_config", "default_system"}:
        assert getattr(settings, name) == fields[name], name


@pytest.mark.parametrize(
    "host, exposed", [("127.0.0.1", False), ("localhost", False), ("::1", False), ("0.0.0.0", True)]
)
def test_serve_warns_only_off_loopback(monkeypatch, tiny_args, host, exposed):
    settings, stderr = serve_settings(monkeypatch, *tiny_args, "--host", host)
    assert settings.exposed is exposed and ("exposes the model" in stderr) is exposed
    assert not ServerSettings(host=host, uds="/tmp/x.sock").exposed  # a Unix socket never is


def test_metrics_text(http):
    assert_normal_request_works(http)
    text = http.get("/metrics").text
    for name in (
        'cactus_edge_requests_total{status="200"}',
        "cactus_edge_prompt_tokens_total",
        "cactus_edge_completion_tokens_total",
        "cactus_edge_draft_tokens_total",
        "cactus_edge_draft_tokens_accepted_total",
        "cactus_edge_verifier_calls_total",
        "cactus_edge_queue_depth 0",
        'cactus_edge_response_kl_mean_bucket{le="+Inf"}',
    ):
        assert name in text


def _long_conversation(seed: int) -> list[dict]:
    words = ("the", "water", "is", "hot", "and", "cold", "code", "python", "word", "people", "were", "may")
    rng = np.random.default_rng(seed)
    return [{"role": "user", "content": " ".join(rng.choice(words, 60))}]


def test_returning_to_a_conversation_comes_back_from_the_prompt_cache(server, client, http):
    """Over loopback with the OpenAI client: A, B, then A again restores A (cached_tokens), and
    /metrics counts the hit."""
    server.app.engine.prompt_cache.min_tokens = 16
    first, other = _long_conversation(1), _long_conversation(2)
    ask = dict(model=MODEL, max_tokens=3, extra_body=GREEDY)
    cold = client.chat.completions.create(messages=first, prompt_cache_key="first", **ask)
    client.chat.completions.create(messages=other, **ask)
    assert "first" in [entry.key for entry in server.app.engine.prompt_cache.entries()]
    hits_before = server.app.engine.prompt_cache.counters.hits
    again = client.chat.completions.create(messages=first, **ask)
    assert again.choices[0].message.content == cold.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert server.app.engine.prompt_cache.counters.hits == hits_before + 1
    text = http.get("/metrics").text
    for name in ("prompt_cache_hits_total", "prompt_cache_bytes", "prompt_cache_evictions_total"):
        assert f"cactus_edge_{name}" in text
