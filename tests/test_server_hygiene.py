"""`cactus-edge serve` under hostile or broken clients (issue 23): stalled connections, a flood
of sockets, work done before a request is queued, text that is not Unicode, malformed HTTP,
huge values quoted in errors, probing without the key, and the server soak script.

Everything goes over loopback (127.0.0.1) to servers the tests start themselves; every loop is
bounded in count and time. Timeouts are set to 1-2 s so that stalls end quickly; which deadline
closed a socket is read from the server's counters, a socket is never closed before its deadline
(a lower bound, which no load can break), and upper bounds are caps of 30 s that only a socket
never closed, or a server waiting for a 60 s deadline, reaches: no test depends on how busy the
machine is. Where a test needs requests to overlap, it waits for them to be there."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cactus_edge.server import Server, ServerSettings, create_server
from cactus_edge.server.connections import ACCEPT_ERROR, RepeatLimit
from cactus_edge.server.errors import MESSAGE_LIMIT, QUOTE_LIMIT

from .conftest import TEST_THREADS
from .test_server import CHAT, MODEL, WAIT, GatedEngine, StreamingClient, chat_body, user, wait_until

KEY = "hygiene-key"
ORIGIN = "http://app.example"
SLACK = 30.0  # seconds a stalled socket may outlive its timeout: a cap, below the 60 s deadlines here
EARLY = 0.05  # seconds asyncio may run a timer early (its clock resolution, rounded up)
FAST = {"idle_timeout": 1.0, "header_timeout": 1.5, "body_timeout": 2.0}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def serve():
    """start(engine, **settings) -> a started Server on 127.0.0.1, stopped at the end."""
    servers = []

    def start(engine=None, **settings):
        server = create_server(engine, ServerSettings(port=0, model_name=MODEL, **settings))
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        assert server.stop(timeout=WAIT)


# --- raw sockets ------------------------------------------------------------------------------------


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)


def read_until_closed(sock: socket.socket, limit: float) -> tuple[bool, float, bytes]:
    """(closed by the server, seconds waited, bytes received), waiting at most ``limit`` s."""
    sock.settimeout(0.25)
    begin, data = time.monotonic(), b""
    while time.monotonic() - begin < limit:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, time.monotonic() - begin, data
        if not chunk:
            return True, time.monotonic() - begin, data
        data += chunk
    return False, time.monotonic() - begin, data


def read_one_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer on a connection that stays open: its head, then its Content-Length body. Each
    read waits at most the socket's timeout, and a closed connection fails the test."""
    data = b""
    while True:
        _, found, body = data.partition(b"\r\n\r\n")
        if found and len(body) >= int(parse_response(data)[1].get("content-length", "0")):
            return parse_response(data)
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; got {data[:200]!r}"
        data += chunk


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def exchange_raw(server: Server, request: bytes, limit: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` on a new connection; the whole answer once the server closes."""
    with connect(server) as sock:
        sock.sendall(request)
        closed, _, data = read_until_closed(sock, limit)
    assert closed, f"the server kept the connection open for {limit} s; got {data[:200]!r}"
    return parse_response(data)


def assert_envelope(body: bytes, code: str) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def open_sockets(port: int, count: int, partial_headers_every: int = 0) -> list[socket.socket]:
    """``count`` connections, some with partial headers. Paced (20 ms every 32 connections):
    faster, the server's accept queue overflows and the kernel drops connects for a second each,
    which throttles a flood as it should but makes a slow test."""
    sockets = []
    try:
        for index in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            sockets.append(sock)
            if partial_headers_every and index % partial_headers_every == 0:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            if index % 32 == 31:
                time.sleep(0.02)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def raise_fd_limit(needed: int) -> None:
    """Raise this process's soft RLIMIT_NOFILE to ``needed`` (within the hard limit) or skip."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


# --- 1. stalled connections ---------------------------------------------------------------------------

STALLS = {
    # name: (bytes sent, then nothing more; the deadline that must close it; answered with 408)
    "idle, nothing sent": (b"", "idle_timeout", False),
    "partial headers": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", "header_timeout", True),
    "body shorter than its Content-Length": (
        post_head(CHAT, 1000) + b'{"messages": [',
        "body_timeout",
        True,
    ),
}
PHASES = {"idle_timeout": "idle", "header_timeout": "headers", "body_timeout": "body"}  # guard.closed's


@pytest.mark.parametrize("name", list(STALLS))
def test_a_stalled_connection_is_closed_within_its_timeout(serve, engine, name):
    sent, timeout, answered = STALLS[name]
    server = serve(engine, **FAST)
    begin = time.monotonic()  # before the connection, so before any of its deadlines started
    with connect(server) as sock:
        sock.sendall(sent)
        closed, waited, data = read_until_closed(sock, FAST[timeout] + SLACK)
    assert closed, f"{name}: still open after {waited:.1f} s"
    assert time.monotonic() - begin >= FAST[timeout] - EARLY  # not before its deadline
    assert dict(server.guard.closed) == {PHASES[timeout]: 1}  # closed by that deadline, no other
    if answered:
        status, headers, body = parse_response(data)
        assert status == 408 and headers["connection"] == "close"
        assert_envelope(body, "request_timeout")
    # A stalled body gives its queue place back (the client may see the close a moment before).
    wait_until(lambda: server.app.scheduler.reserved == 0, "the stalled request's queue place to come back")
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        assert http.post(CHAT, json=chat_body(max_tokens=1)).status_code == 200


def test_trickled_headers_do_not_extend_the_deadline(serve):
    """One byte every 0.2 s (slowloris): the header deadline counts from the first byte. The
    request is 1,000+ bytes, so a deadline that every byte extended would keep it open for over
    200 s: the server must close it while bytes are still arriving, and by its header deadline."""
    server = serve(**FAST)
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
    begin, ended = time.monotonic(), "every byte sent"
    with connect(server) as sock:
        for byte in request:  # bounded: 1,000+ bytes, and the loop ends at the close
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                ended = "closed by the server"
                break
            if time.monotonic() - begin > FAST["header_timeout"] + SLACK:
                ended = "still open at the cap"
                break
            closed, _, data = read_until_closed(sock, 0.2)
            if closed:
                ended = "closed by the server"
                break
    assert ended == "closed by the server", ended
    assert FAST["header_timeout"] - EARLY <= time.monotonic() - begin < FAST["header_timeout"] + SLACK
    assert server.guard.closed["headers"] == 1


def test_a_kept_alive_connection_is_closed_when_idle(serve):
    server = serve(**FAST)
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        closed, waited, data = read_until_closed(sock, FAST["idle_timeout"] + SLACK)
    assert closed and data.startswith(b"HTTP/1.1 503")  # answered (loading), then closed when idle
    assert server.guard.closed["idle"] == 1 and not server.guard.open


def test_health_answers_while_1000_stalled_sockets_are_held(serve):
    raise_fd_limit(3000)  # 1,000 client sockets + 1,000 server sockets in this one process
    server = serve(max_connections=2000, idle_timeout=60, header_timeout=60)
    sockets = open_sockets(server.port, 1000, partial_headers_every=2)
    try:
        wait_until(lambda: len(server.guard.open) >= 1000, "the server to hold 1,000 sockets", timeout=WAIT)
        with httpx.Client(base_url=server.url, timeout=WAIT) as http:
            for _ in range(20):
                begin = time.monotonic()
                assert http.get("/health").json()["status"] == "loading"
                assert time.monotonic() - begin < SLACK
        assert len(server.guard.open) >= 1000 and not server.guard.closed  # held, none dropped
    finally:
        for sock in sockets:
            sock.close()


CHILD_SERVER = """
import resource, sys, types
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, hard))
from cactus_edge.server import Server, ServerApp, ServerSettings
settings = ServerSettings(port=0, idle_timeout=120, header_timeout=120)
server = Server(ServerApp(types.SimpleNamespace(), settings))  # a stub engine: /health says ok
server.start()
print(server.port, server.guard.cap, flush=True)
sys.stdin.read()  # until the test closes stdin
server.stop()
"""


def test_a_flood_of_stalled_sockets_cannot_exhaust_the_descriptors(tmp_path):
    """The probe's failure on a small scale: a server limited to 512 descriptors, 1,000 stalled
    sockets that never time out during the test. Without the cap it ran out of descriptors,
    /health went silent and asyncio logged its accept error in a loop."""
    raise_fd_limit(1500)
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD_SERVER.format(limit=512)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
        )
    sockets = []
    try:
        port, cap = (int(word) for word in child.stdout.readline().split())
        assert cap <= 512 - 4 * 32  # below the limit by four batches of accepts
        sockets = open_sockets(port, 1000, partial_headers_every=3)
        for _ in range(10):
            response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=SLACK)
            assert response.json() == {"status": "ok"}
    finally:
        for sock in sockets:
            sock.close()
        child.stdin.close()
        try:
            child.wait(WAIT)
        finally:
            if child.poll() is None:
                child.kill()
    assert ACCEPT_ERROR not in log.read_text()


def test_every_connection_busy_refuses_the_next_with_503(engine, serve):
    gated = GatedEngine(engine)
    server = serve(gated, max_connections=3, max_queue=2)
    clients = [StreamingClient(server.url, user(f"busy {i}")) for i in range(3)]
    try:
        for index, client in enumerate(clients):
            client.start()
            wait_until(lambda n=index: len(gated.started) + server.app.scheduler.waiting == n + 1, "queueing")
        with connect(server) as sock:
            closed, _, data = read_until_closed(sock, SLACK)
        status, headers, body = parse_response(data)
        assert closed and status == 503 and headers["retry-after"]
        assert_envelope(body, "too_many_connections")
    finally:
        gated.gate.set()
        for client in clients:
            client.join(WAIT)
    assert all(client.status == 200 for client in clients)


def test_the_accept_error_log_is_rate_limited():
    """asyncio's own path: loop.call_exception_handler, as its accept loop calls it on EMFILE."""
    now = [0.0]
    limit = RepeatLimit(ACCEPT_ERROR, interval=10.0, clock=lambda: now[0])
    asyncio_logger = logging.getLogger("asyncio")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    saved = asyncio_logger.filters[:]
    asyncio_logger.filters[:] = [limit]
    asyncio_logger.addHandler(handler)
    loop = asyncio.new_event_loop()
    try:
        error = OSError(24, "Too many open files")
        for _ in range(10_000):
            loop.call_exception_handler({"message": ACCEPT_ERROR, "exception": error})
        now[0] = 10.0
        loop.call_exception_handler({"message": ACCEPT_ERROR, "exception": error})
        loop.call_exception_handler({"message": "something else"})
    finally:
        loop.close()
        asyncio_logger.removeHandler(handler)
        asyncio_logger.filters[:] = saved
    messages = [record.getMessage() for record in records]
    assert len(messages) == 3, messages[:5]
    assert "9,999 more since the last report" in messages[1] and messages[2] == "something else"


def test_a_server_installs_the_log_limits(serve):
    serve()
    prefixes = {f.prefix for name in ("asyncio", "uvicorn.error") for f in logging.getLogger(name).filters}
    assert ACCEPT_ERROR in prefixes and "Invalid HTTP request received." in prefixes


# --- 2. work before queueing is bounded ----------------------------------------------------------------


def test_a_declared_length_over_the_limit_is_refused_before_the_body(serve, engine):
    server = serve(engine, max_body_bytes=64 * 1024, body_timeout=60)
    status, headers, body = exchange_raw(server, post_head(CHAT, 10_000_000), limit=SLACK)
    assert status == 413 and headers["connection"] == "close"
    assert_envelope(body, "request_too_large")


def test_a_full_queue_refuses_before_the_body_is_read(serve, engine):
    gated = GatedEngine(engine)
    server = serve(gated, max_queue=1, body_timeout=60)
    calls = []
    gated.tokenize_chat = lambda messages, tools=None: (
        calls.append(messages) or engine.tokenize_chat(messages, tools)
    )
    clients = [StreamingClient(server.url, user(f"queued {i}")) for i in range(2)]
    try:
        for client in clients:
            client.start()
        wait_until(lambda: server.app.scheduler.waiting == 1 and len(gated.started) == 1, "a full queue")
        tokenized = len(calls)
        # Headers only: a server that read the body first would wait for it (60 s).
        status, headers, body = exchange_raw(server, post_head(CHAT, 1_000_000), limit=SLACK)
        assert status == 503 and headers["retry-after"] and headers["connection"] == "close"
        assert_envelope(body, "queue_full")
        assert len(calls) == tokenized  # nothing of it was tokenized
    finally:
        gated.gate.set()
        for client in clients:
            client.join(WAIT)


def test_requests_being_read_hold_their_queue_places(serve, engine):
    """Two bodies still arriving fill a queue of one: a third request is refused at once, and the
    places come back when the stalled bodies time out. The refusal must come before their body
    deadline: 5 s, not FAST's 2, so that a busy CPU cannot delay it past that."""
    body_timeout = 5.0
    server = serve(engine, max_queue=1, **{**FAST, "body_timeout": body_timeout})
    stalled = [connect(server) for _ in range(2)]
    try:
        for sock in stalled:
            sock.sendall(post_head(CHAT, 1000) + b"{")
        wait_until(lambda: server.app.scheduler.reserved == 2, "two places taken")
        with httpx.Client(base_url=server.url, timeout=WAIT) as http:
            refused = http.post(CHAT, json=chat_body(max_tokens=1))
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
            for sock in stalled:
                assert read_until_closed(sock, body_timeout + SLACK)[0]
            assert server.guard.closed["body"] == 2  # by their body deadline
            wait_until(lambda: server.app.scheduler.reserved == 0, "the places to come back")
            assert http.post(CHAT, json=chat_body(max_tokens=1)).status_code == 200
    finally:
        for sock in stalled:
            sock.close()


OVERLAP_WINDOW = 2.0  # seconds the first tokenizing waits for a second one, once all four have arrived


def test_prompts_are_tokenized_one_at_a_time(serve, engine):
    """The first prompt's tokenizing holds on until all four requests hold their queue places (so
    the other three are at the tokenizer too, or about to be), then gives a second tokenizing up to
    OVERLAP_WINDOW s to start beside it. One at a time, none does; it would start at once if they
    ran in parallel. A busy CPU can only make this wait longer, never fail it."""
    gated = GatedEngine(engine)
    gated.gate.set()
    server = serve(gated)
    lock, running, most = threading.Lock(), [0], [0]
    overlapped, first = threading.Event(), threading.Event()

    def slow_tokenize(messages, tools=None):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            if running[0] > 1:
                overlapped.set()
            leading = not first.is_set()
            first.set()
        if leading:
            arrived = lambda: overlapped.is_set() or server.app.scheduler.reserved == 4  # noqa: E731
            wait_until(arrived, "all four requests to arrive")
            overlapped.wait(OVERLAP_WINDOW)
        with lock:
            running[0] -= 1
        return engine.tokenize_chat(messages, tools)

    gated.tokenize_chat = slow_tokenize
    clients = [StreamingClient(server.url, user(f"tokenize {i}")) for i in range(4)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(WAIT)
        assert client.status == 200
    assert most[0] == 1


# --- 3. text that is not Unicode --------------------------------------------------------------------

SURROGATE_CASES = [
    # (path, body as bytes, param)
    (CHAT, json.dumps(chat_body(messages=[{"role": "user", "content": "a\ud800b"}])).encode(),
     "messages[0].content"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}], "max_tokens": 1}',
     "messages[0].content"),
    (CHAT, json.dumps(chat_body(messages=[{"role": "us\udfffer", "content": "hi"}])).encode(),
     "messages[0].role"),
    (CHAT, b'{"messages": [{"role": "\xed\xa0\x80", "content": "hi"}], "max_tokens": 1}', "messages[0].role"),
    ("/v1/completions", json.dumps({"prompt": "x\ud800", "max_tokens": 1}).encode(), "prompt"),
    ("/v1/completions", b'{"prompt": "x\xed\xa0\x80", "max_tokens": 1}', "prompt"),
    ("/v1/completions", json.dumps({"prompt": ["\udc00"], "max_tokens": 1}).encode(), "prompt[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "content", "param"), SURROGATE_CASES)
def test_a_lone_surrogate_is_a_400_naming_the_field(serve, engine, path, content, param):
    server = serve(engine)
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        response = http.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_value"
        assert "surrogate" in error["message"]
        assert http.post(CHAT, json=chat_body(max_tokens=1)).status_code == 200


# --- 4. the protocol layer's answers ------------------------------------------------------------------

MALFORMED = {
    "HTTP/1.1 without Host": b"GET /health HTTP/1.1\r\n\r\n",
    "two Host headers": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n",
    "negative Content-Length": post_head(CHAT, -5),
    "TLS ClientHello": bytes.fromhex("160301020001000001fc0303") + bytes(64),
    "garbage": b"\x00\x01\x02 not http at all\r\n\r\n",
    "a path that is not ASCII": b"GET /\xff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_http_gets_the_envelope(serve, name):
    server = serve()
    status, headers, body = exchange_raw(server, MALFORMED[name])
    assert status == 400 and headers["content-type"] == "application/json"
    assert_envelope(body, "invalid_http_request")


def test_a_header_section_over_h11s_limit_gets_the_envelope(serve):
    server = serve()
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        for _ in range(40):  # 40 KiB of one header, never ended: past h11's 16 KiB
            try:
                sock.sendall(b"a" * 1024)
            except (BrokenPipeError, ConnectionResetError):
                break
        closed, _, data = read_until_closed(sock, SLACK)
    status, _, body = parse_response(data)
    assert closed and status == 400
    assert_envelope(body, "invalid_http_request")


def test_head_health_answers_like_get_without_a_body(serve):
    server = serve(api_key=KEY)
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        head = http.head("/health")
        get = http.get("/health")
    assert head.status_code == get.status_code == 503  # no engine: loading
    assert head.content == b"" and head.headers["content-length"] == get.headers["content-length"]


# --- 5. quoted values are capped ---------------------------------------------------------------------


def test_errors_quote_at_most_a_few_hundred_characters_of_a_value(serve, engine):
    """Our messages quote a value through ``quote`` (about 200 characters of it); the library's
    own messages, which quote values whole, are clipped as a whole at MESSAGE_LIMIT."""
    server = serve(engine, max_body_bytes=8 * 1024 * 1024)
    cases = [
        # (request, status, param, a character only the value has, how many of it may show)
        ({"json": chat_body(speculative={"k" * 50_000: 1})}, 400, None, "k", MESSAGE_LIMIT),
        ({"json": chat_body(model="z" * 100_000)}, 404, "model", "z", QUOTE_LIMIT),
        ({"json": chat_body(), "headers": {"Host": "q" * 5_000}}, 403, None, "q", QUOTE_LIMIT),
    ]
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        for kwargs, status, param, filler, most in cases:
            response = http.post(CHAT, **kwargs)
            assert response.status_code == status, response.text[:300]
            error = response.json()["error"]
            assert len(response.content) < 1_000 and "characters cut" in error["message"]
            assert error["message"].count(filler) <= most, (filler, error["message"])
            assert param is None or error["param"] == param
            assert error["param"] is None or len(error["param"]) <= QUOTE_LIMIT


# --- 6. OPTIONS and the API key -----------------------------------------------------------------------


def test_without_the_key_nothing_but_health_says_more_than_401(serve):
    server = serve(api_key=KEY, cors_origins=(ORIGIN,))
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        for method, path, headers in (
            ("GET", "/v1/embeddings", {}),  # unknown route
            ("POST", "/nope", {}),
            ("GET", CHAT, {}),  # wrong method
            ("OPTIONS", "/nope", {}),  # not a preflight
            ("OPTIONS", "/nope", preflight),  # a preflight, but for no route
            ("OPTIONS", CHAT, {}),  # OPTIONS without Origin: not a preflight
        ):
            response = http.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, response.status_code)
            assert response.json()["error"]["code"] == "invalid_api_key"
        answered = http.options(CHAT, headers=preflight)  # browsers send no key on preflights
        assert answered.status_code == 204 and answered.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in answered.headers["access-control-allow-methods"]
        assert http.get("/health").status_code == 503 and http.head("/health").status_code == 503
        with_key = {"Authorization": f"Bearer {KEY}"}
        assert http.get("/v1/embeddings", headers=with_key).status_code == 404
        assert http.get(CHAT, headers=with_key).status_code == 405


def test_no_preflight_without_cors_origins(serve):
    server = serve()
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        plain = http.options(CHAT, headers={"Access-Control-Request-Method": "POST"})
        assert plain.status_code == 405 and plain.headers["allow"] == "POST"
        foreign = http.options(CHAT, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
        assert http.options("/nope").status_code == 404


# --- 7. the cache audit and the soak script --------------------------------------------------------


def test_debug_audits_the_caches_after_every_generation(serve, engine):
    plain = serve(engine)
    assert httpx.get(f"{plain.url}/debug/caches", timeout=WAIT).status_code == 404  # only with debug
    server = serve(engine, debug=True)
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        for index in range(3):
            assert http.post(CHAT, json=chat_body(messages=user(f"audit {index}"))).status_code == 200
        with http.stream("POST", CHAT, json=chat_body(max_tokens=200, stream=True)) as response:
            next(response.iter_lines())  # hang up after the first event
        wait_until(lambda: http.get("/debug/caches").json()["checked"] == 4, "four audits")
        report = http.get("/debug/caches").json()
    assert report["n_problems"] == 0 and report["problems"] == []


def run_soak(tiny_pair, out: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / "soak_server.py"), "--draft", str(tiny_pair[0])]
    command += [
        "--target",
        str(tiny_pair[1]),
        "--n-ctx",
        "512",
        "--threads",
        str(TEST_THREADS),
        "--out",
        str(out),
    ]
    command += ["--idle-timeout", "2", "--header-timeout", "2", "--body-timeout", "2", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.timeout(900)  # the script's own 600 s limit (run_soak) reports first
def test_soak_server_runs_end_to_end_on_the_tiny_pair(tiny_pair, tmp_path):
    # /health's p99 over a few hundred polls is about its 3rd-slowest answer: on a busy 2-core
    # machine a few scheduling hiccups pass the script's 100 ms default (p99 31-61 ms, max 130 ms
    # at load 6). A 1 s bound is kept against a /health that waits on generations; the verdict
    # itself (a p99 over the bound is a violation, exit 1) is the next test's.
    # --cache-ram 1: seven of the tiny models' long conversations (~0.2 MiB each) overflow it, so the
    # switching requests save, restore and evict.
    flags = ("--requests", "80", "--max-health-p99-ms", "1000", "--cache-ram", "1", "--conversations", "8")
    result = run_soak(tiny_pair, tmp_path, *flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "soak_server.json").read_text())
    assert summary["violations"] == [] and summary["requests"] == 80
    cache = summary["cache_audit"]["prompt_cache"]
    assert cache["hits_total"] > 0 and cache["evictions_total"] > 0 and cache["max_bytes"] == 2**20
    assert all(cache_mb <= 1 for _, _, cache_mb in summary["rss_mb"])
    assert summary["cache_audit"]["checked"] > 0 and summary["sigterm"]["exit_code"] == 0
    assert summary["cache_audit"]["finishes"].get("cancelled", 0) > 0  # hang-ups and cancels cancel
    assert "| kind |" in result.stdout and "| burst |" in result.stdout


@pytest.mark.timeout(900)  # the script's own 600 s limit (run_soak) reports first
def test_soak_server_exits_non_zero_on_a_violation(tiny_pair, tmp_path):
    flags = ("--requests", "30", "--max-health-p99-ms", "0", "--max-rss-overhead-mb", "-1000")
    result = run_soak(tiny_pair, tmp_path, *flags)
    assert result.returncode == 1 and "violation: /health p99" in result.stderr, result.stderr[-3000:]
    assert "violation: RSS" in result.stderr and "MiB cache" in result.stderr  # the memory bound


def test_stopping_answers_a_request_still_arriving_at_once(serve, engine):
    """A body still arriving when the server stops is never going to be served: 503 and closed
    right away, not after the grace period with the handler cancelled."""
    server = serve(engine, body_timeout=60, shutdown_grace=2 * SLACK)
    with connect(server) as sock:
        sock.sendall(post_head(CHAT, 1000) + b"{")
        wait_until(lambda: server.app.scheduler.reserved == 1, "the body to be awaited")
        stopper = threading.Thread(target=server.stop, kwargs={"timeout": 3 * SLACK})
        stopper.start()
        closed, _, data = read_until_closed(sock, SLACK)  # well before the grace period ends
        stopper.join(WAIT)
    assert closed, f"still open {SLACK:g} s after the server began to stop; got {data[:200]!r}"
    status, headers, body = parse_response(data)
    assert status == 503 and headers["connection"] == "close"
    assert_envelope(body, "shutting_down")


def test_a_refused_small_body_is_read_first_so_the_answer_is_not_lost(serve, engine):
    """A request refused before its body is read (here a foreign Host) still has its small body read
    and dropped before the answer: closing on unread bytes makes the kernel reset the connection,
    and the client can lose the answer. Read, the connection even stays open for the next request."""
    server = serve(engine)
    body = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * 20_000}])).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with connect(server) as sock:
        sock.sendall(head)
        time.sleep(0.05)  # the body arrives after the refusal was decided
        sock.sendall(body)
        status, headers, _ = read_one_response(sock)
        assert status == 403 and headers.get("connection") != "close"
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode())
        assert read_one_response(sock)[0] == 200  # the same connection answers again
