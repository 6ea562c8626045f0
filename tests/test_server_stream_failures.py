"""A generation that fails after its stream's headers went out: a real server on 127.0.0.1 (port
0) over the tiny pair, read with httpx and with the real `openai` client.

docs/server.md is the contract: "An error after a stream has started arrives as one
`data: {"error": …}` event", in OpenAI's envelope, and nothing after it (no `data: [DONE]`: the
generation did not finish). The response must still end properly (the chunked body's last chunk,
so no client sees an incomplete read), the failure is counted and logged, and the server serves
the next request as before.

Each fault is injected into the target's ``decode`` (the call every step makes) on its
FAIL_AT-th call, and only once the client has read a content chunk: the wrapper waits for the
client's event, bounded by WAIT, so no test depends on timing. The faults: an unexpected exception,
logits that are NaN (the real logits with one entry poisoned), a typed WorkerLostError, and a real
RPC worker killed mid-stream."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import threading

import httpx
import numpy as np
import openai
import pytest

from cactus_edge.engine.engine import Engine
from cactus_edge.errors import WorkerLostError
from cactus_edge.llama.rpc import Endpoint, rpc_supported
from cactus_edge.llama.worker import wait_for_worker, worker_command
from cactus_edge.server import ServerSettings, create_server

from .test_server import CHAT, GREEDY, MESSAGES, MODEL, WAIT, chat_body, wait_until

FAIL_AT = 3  # the target's 3rd decode: the prefill's and one step's tokens were streamed before it
MAX_TOKENS = 48  # far more than two steps make: the fault, not the length, ends the generation
ENVELOPE = {"message", "type", "param", "code"}


class DecodeFault:
    """Replaces ``model.decode``: call FAIL_AT waits until ``delivered`` (set by the client when it
    has read a content chunk), then ``fault(real_decode, tokens, output_rows, copy)`` raises or
    returns poisoned logits. Every other call is the real decode."""

    def __init__(self, model, fault) -> None:
        self.model, self.fault, self.real = model, fault, model.decode
        self.calls = 0
        self.delivered = threading.Event()
        self.fired = False

    def __call__(self, tokens, output_rows=(-1,), *, copy=True):
        self.calls += 1
        if self.calls != FAIL_AT:
            return self.real(tokens, output_rows, copy=copy)
        if not self.delivered.wait(WAIT):
            raise TimeoutError("the client never read a content chunk")
        self.fired = True
        return self.fault(self.real, tokens, output_rows, copy)


def raise_unexpected(real, tokens, output_rows, copy):
    raise RuntimeError("secret internal detail")


def nan_logits(real, tokens, output_rows, copy):
    logits = np.array(real(tokens, output_rows, copy=copy))  # a writable copy of llama.cpp's rows
    logits[-1, 7] = np.nan
    return logits


def worker_lost(real, tokens, output_rows, copy):
    raise WorkerLostError("lost RPC worker 127.0.0.1:9 during 'decode': connection reset", "127.0.0.1:9")


# name: (fault, error type, error code, what the message says, what the server logs)
FAULTS = {
    "engine exception": (
        raise_unexpected, "server_error", "internal", "internal server error (logged on the server)",
        "unexpected error in a generation",
    ),
    "nan logits": (
        nan_logits, "server_error", "generation_failed",
        "the generation failed: llama.cpp returned non-finite logits (NaN or inf) from tiny-target.gguf",
        "generation failed: NonFiniteLogitsError",
    ),
    "worker lost": (
        worker_lost, "server_error", "rpc_worker_lost", "lost RPC worker 127.0.0.1:9 during 'decode'",
        "RPC worker lost: lost RPC worker 127.0.0.1:9",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(engine):
    server = create_server(engine, ServerSettings(port=0, model_name=MODEL, metrics=True, debug=True))
    server.start()
    yield server
    assert server.stop(timeout=WAIT)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=WAIT) as client:
        yield client


@pytest.fixture
def inject(engine):
    """inject(fault) -> the DecodeFault now standing in for the target's decode (until the test ends)."""
    target = engine.target

    def install(fault) -> DecodeFault:
        wrapper = DecodeFault(target, fault)
        target.decode = wrapper
        return wrapper

    yield install
    with contextlib.suppress(AttributeError):
        del target.decode  # the class's method again


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def uvicorn_errors():
    """What uvicorn logs (its loggers do not propagate to pytest's): "ASGI callable returned
    without completing response" is how it reports a response left open."""
    handler = Messages()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


# --- helpers ---------------------------------------------------------------------------------------


def stream_events(response: httpx.Response, fault: DecodeFault) -> list:
    """The data of every SSE event ("[DONE]" stays a string), read as it arrives; sets
    ``fault.delivered`` at the first content chunk. Every event must be complete: a body cut
    mid-event, or a chunked body without its last chunk (httpx raises), fails here."""
    events: list = []
    buffer = b""
    for piece in response.iter_bytes():
        buffer += piece
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            text = block.decode()
            assert text.startswith("data: ") and "\n" not in text, text
            data = text[len("data: ") :]
            event = data if data == "[DONE]" else json.loads(data)
            events.append(event)
            if has_content(event):
                fault.delivered.set()
    assert buffer == b"", f"the stream ended inside an event: {buffer!r}"
    return events


def has_content(event) -> bool:
    if not isinstance(event, dict) or not event.get("choices"):
        return False
    choice = event["choices"][0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def metric(http: httpx.Client, line_start: str) -> float:
    text = http.get("/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start + " ")]
    return values[0] if values else 0.0


FAILED = 'cactus_edge_generations_total{finish_reason="error"}'


def audit(http: httpx.Client) -> dict:
    """The debug cache audit once the engine's worker is idle: a generation is audited after its
    last event went out, so only then has every generation so far been checked."""
    wait_until(lambda: http.get("/debug/caches").json()["running"] == 0, "the engine to be idle")
    report = http.get("/debug/caches").json()
    assert report["waiting"] == 0 and report["running"] == 0, report
    return report


def assert_serves_normally(http: httpx.Client, path: str = CHAT) -> None:
    """A non-streamed request, then a streamed one, both complete."""
    body = chat_body(max_tokens=4, **GREEDY) if path == CHAT else completion_body(max_tokens=4)
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")
    assert choice["message"]["content"] if path == CHAT else choice["text"], choice
    with http.stream("POST", path, json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in line for line in events)
    assert http.get("/health").json() == {"status": "ok"}


def completion_body(**extra) -> dict:
    return {"model": MODEL, "prompt": "the water is hot and", **GREEDY, **extra}


def assert_error_event_ends_the_stream(events: list, error_type: str, code: str, says: str) -> dict:
    """Content first, then exactly one OpenAI-shaped error event, and nothing after it."""
    assert events, "no event at all"
    assert "[DONE]" not in events, events[-3:]
    *chunks, last = events
    assert set(last) == {"error"}, last
    error = last["error"]
    assert set(error) == ENVELOPE and error["type"] == error_type and error["code"] == code, error
    assert error["param"] is None and says in error["message"], error
    assert not any("error" in chunk for chunk in chunks)
    assert sum(has_content(chunk) for chunk in chunks) >= 1, "no content before the error"
    # The generation did not finish: no chunk says it did, and no usage chunk followed.
    for chunk in chunks:
        assert all(choice.get("finish_reason") is None for choice in chunk["choices"]), chunk
        assert chunk.get("usage") is None
    return error


# --- httpx: the bytes on the wire ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "path"),
    [*((name, CHAT) for name in FAULTS), ("engine exception", "/v1/completions")],
    ids=[*FAULTS, "engine exception, completions"],
)
def test_a_failure_mid_stream_ends_it_with_one_error_event(
    server, http, inject, caplog, uvicorn_errors, name, path
):
    fault_function, error_type, code, says, logged = FAULTS[name]
    failed, checked = metric(http, FAILED), audit(http)["checked"]
    fault = inject(fault_function)
    body = chat_body(**GREEDY) if path == CHAT else completion_body()
    body.update(max_tokens=MAX_TOKENS, stream=True)
    with caplog.at_level(logging.ERROR, logger="cactus_edge.server"):
        with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = stream_events(response, fault)
        messages = [record.getMessage() for record in caplog.records if record.name == "cactus_edge.server"]
    assert fault.fired and fault.calls == FAIL_AT  # failed where injected; nothing decoded after it
    if path == CHAT:
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    error = assert_error_event_ends_the_stream(events, error_type, code, says)
    assert "secret" not in json.dumps(error) and "Traceback" not in json.dumps(error)
    assert any(message.startswith(logged) for message in messages), messages
    assert metric(http, FAILED) == failed + 1
    assert_serves_normally(http, path)
    assert uvicorn_errors == []
    report = audit(http)  # the failed generation and the two after it, all consistent
    assert report["checked"] == checked + 3 and report["n_problems"] == 0, report


# --- the openai client -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAULTS))
def test_the_openai_client_raises_apierror_after_the_content(server, http, inject, uvicorn_errors, name):
    """What the `openai` client does with the error event: it raises ``openai.APIError`` (the
    base class itself: neither an APIStatusError, the status was 200, nor an APIConnectionError,
    the connection ended properly) carrying the envelope, after yielding the chunks before it."""
    fault_function, error_type, code, says, _ = FAULTS[name]
    fault = inject(fault_function)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT, max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True, extra_body=GREEDY
    )
    received = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            received.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                fault.delivered.set()
    error = raised.value
    assert type(error) is openai.APIError, repr(error)
    assert error.type == error_type and error.code == code and says in error.message
    assert set(error.body) == ENVELOPE and error.body["message"] == error.message
    assert fault.fired and fault.calls == FAIL_AT
    assert received[0].choices[0].delta.role == "assistant"
    assert any(chunk.choices[0].delta.content for chunk in received)
    assert all(chunk.choices[0].finish_reason is None for chunk in received)
    assert stream.response.is_closed
    follow_up = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=GREEDY
    )
    assert follow_up.choices[0].message.content
    assert follow_up.choices[0].finish_reason in ("length", "stop")
    assert_serves_normally(http)
    assert uvicorn_errors == []  # the response was complete, though the client stopped reading it


# --- a real RPC worker killed mid-stream -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_worker(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        worker_command(port, "--threads", "1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_worker(Endpoint("127.0.0.1", port), WAIT, alive=lambda: process.poll() is None)
    except BaseException:
        stop_worker(process)
        raise
    return process


def stop_worker(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(WAIT)


@pytest.mark.skipif(not rpc_supported(), reason="llama-cpp-python built without GGML_RPC")
def test_a_worker_killed_mid_stream_ends_it_with_rpc_worker_lost(tiny_pair, caplog, uvicorn_errors):
    """The target on a real `cactus-edge worker`, killed (SIGKILL, and reaped) once the client has
    read content, just before the target's next decode: the model process's RPC call fails, the
    worker is named in a `rpc_worker_lost` event, and once the worker is back on its port the
    next request reconnects and answers what it answered before."""
    port = free_port()
    endpoints = {"worker": start_worker(port)}

    def kill_then_decode(real, tokens, output_rows, copy):
        stop_worker(endpoints["worker"])
        return real(tokens, output_rows, copy=copy)

    draft, target = tiny_pair
    engine = Engine.load(draft, target, n_ctx=256, rpc_servers=f"127.0.0.1:{port}", rpc_timeout=5.0)
    server = create_server(engine, ServerSettings(port=0, model_name=MODEL, metrics=True, debug=True))
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT) as http:
            body = chat_body(max_tokens=6, **GREEDY)
            before = http.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
            fault = DecodeFault(engine.target, kill_then_decode)
            engine.target.decode = fault
            streamed = {**body, "max_tokens": MAX_TOKENS, "stream": True}
            with (
                caplog.at_level(logging.ERROR, logger="cactus_edge.server"),
                http.stream("POST", CHAT, json=streamed) as response,
            ):
                assert response.status_code == 200
                events = stream_events(response, fault)
            del engine.target.decode
            assert fault.fired and fault.calls == FAIL_AT
            error = assert_error_event_ends_the_stream(events, "server_error", "rpc_worker_lost", "lost RPC")
            assert f"127.0.0.1:{port}" in error["message"] and "'decode'" in error["message"]
            assert any(r.getMessage().startswith("RPC worker lost: ") for r in caplog.records), caplog.records
            assert metric(http, FAILED) == 1 and not engine.target.connected
            assert http.get("/health").json() == {"status": "ok"}  # still serving
            endpoints["worker"] = start_worker(port)
            again = http.post(CHAT, json=body)
            assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == before
            assert uvicorn_errors == []
            report = audit(http)
            assert report["checked"] == 3 and report["n_problems"] == 0, report
    finally:
        assert server.stop(timeout=WAIT)
        engine.close()
        stop_worker(endpoints["worker"])
