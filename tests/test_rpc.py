"""The target on ggml's RPC workers: two `cactus-edge worker`s on loopback, started here, hold the
tiny target; the draft stays in this process. Every fault a worker can have (absent, dead, stopped,
another protocol, garbage answers) must end in WorkerLostError naming it, within seconds, with
consistent caches, and this process (which embeds us, as an app would) must survive each one.

Nothing here depends on how busy this machine is: the engines' rpc_timeout is long enough for a
model process to start under load, and only the stopped-worker test lowers it, once loaded. A
fault is checked against the deadline it must beat (seen as it happens, not at the rpc deadline),
with a wide margin, and a refusal "before any model process starts" counts the model processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.errors import InvalidSettingError, RPCUnavailableError, WorkerLostError
from cactus_edge.llama.rpc import Endpoint, parse_endpoints, rpc_supported
from cactus_edge.llama.worker import wait_for_worker, worker_command
from cactus_edge.server import ServerSettings, create_server

from .conftest import TEST_THREADS
from .test_engine import assert_same_greedy_tokens

pytestmark = pytest.mark.skipif(not rpc_supported(), reason="llama-cpp-python built without GGML_RPC")

WAIT = 30  # seconds: bound for every wait on a worker
RPC_TIMEOUT = 45.0  # rpc_timeout of the engines here: ample for a model process starting on a busy CPU
TIMEOUT = 2.0  # the stopped-worker test's rpc_timeout, set once its engine is loaded
SOON = 30.0  # seconds a fault seen as it happens takes at most, on a busy CPU: below RPC_TIMEOUT
GREEDY = {"temperature": 0.0, "max_tokens": 24, "seed": 0}
PROMPTS = ["the cat sat on", "a dog and a", "the water is hot and"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Worker:
    """One `cactus-edge worker` process on a loopback port."""

    def __init__(self, port: int | None = None, *extra: str) -> None:
        self.port = port or free_port()
        self.process = subprocess.Popen(
            worker_command(self.port, "--threads", "1", *extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for_worker(self.endpoint, WAIT, alive=lambda: self.process.poll() is None)
        except WorkerLostError:
            raise AssertionError(f"worker did not start: {self.process.stderr.read()}") from None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint("127.0.0.1", self.port)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(WAIT)

    def restart(self) -> Worker:
        self.kill()
        return Worker(self.port)


@pytest.fixture
def workers():
    started = [Worker(), Worker()]
    yield started
    for worker in started:
        with contextlib.suppress(Exception):
            os.kill(worker.process.pid, signal.SIGCONT)
        worker.kill()


def rpc_engine(tiny_pair, workers, **settings) -> Engine:
    draft, target = tiny_pair
    servers = ",".join(str(w.endpoint) for w in workers)
    settings = {"rpc_timeout": RPC_TIMEOUT, "n_threads": TEST_THREADS, **settings}
    return Engine.load(draft, target, n_ctx=256, rpc_servers=servers, **settings)


@pytest.fixture
def spawns(monkeypatch) -> list[bool]:
    """One entry per model process started (RemoteLlamaModel's child)."""
    from cactus_edge.llama import remote as remote_model

    started, spawn = [], remote_model._ModelProcess.spawn

    def counted(verbose: bool):
        started.append(verbose)
        return spawn(verbose)

    monkeypatch.setattr(remote_model._ModelProcess, "spawn", staticmethod(counted))
    return started


@pytest.fixture
def local(tiny_pair):
    with Engine.load(*tiny_pair, n_ctx=256, n_threads=TEST_THREADS) as engine:
        yield engine


def greedy(engine: Engine, prompt: str, **settings):
    return engine.generate(engine.tokenize_prompt(prompt), GenerationConfig(**{**GREEDY, **settings}))


def test_the_target_on_two_workers_decodes_what_it_decodes_here(tiny_pair, workers, local):
    with rpc_engine(tiny_pair, workers) as remote:
        assert remote.target.devices == [str(w.endpoint) for w in workers]
        assert remote.draft is not None and not hasattr(remote.draft, "endpoints")  # the draft is local
        for prompt in PROMPTS:
            context = local.tokenize_prompt(prompt)
            for method in ("none", "sps"):
                expected = greedy(local, prompt, method=method, n_draft=3)
                actual = greedy(remote, prompt, method=method, n_draft=3)
                assert_same_greedy_tokens(local.target, context, expected.tokens, actual.tokens)
            assert remote.check_caches() == []


def test_logits_over_rpc_equal_local_logits(tiny_pair, workers, local):
    import numpy as np

    with rpc_engine(tiny_pair, workers) as remote:
        tokens = local.tokenize_prompt(PROMPTS[0])
        remote_rows = remote.target.teacher_forced(tokens, range(len(tokens)))
        local_rows = local.target.teacher_forced(tokens, range(len(tokens)))
        np.testing.assert_allclose(remote_rows, local_rows, atol=1e-3)


def expect_lost(call, endpoint: Endpoint | None, within: float = SOON, after: float = 0.0) -> WorkerLostError:
    """The WorkerLostError ``call`` raises, naming ``endpoint``, after ``after`` s at least and
    ``within`` s at most (a bound the fault must beat by far, so a busy CPU cannot break it)."""
    start = time.monotonic()
    with pytest.raises(WorkerLostError) as raised:
        call()
    waited = time.monotonic() - start
    assert after <= waited < within, f"a fault must be a clear error within seconds, not {waited:.1f} s"
    if endpoint is not None:
        assert raised.value.endpoint == str(endpoint)
        assert str(endpoint) in str(raised.value)
    return raised.value


def test_a_worker_that_dies_is_named_and_the_next_request_reconnects(tiny_pair, workers, local, spawns):
    with rpc_engine(tiny_pair, workers) as remote:
        expected = greedy(local, PROMPTS[1])
        assert greedy(remote, PROMPTS[0]).tokens  # the workers hold the cache now
        workers[1].kill()
        # Seen when the model process dies, not at the rpc deadline (RPC_TIMEOUT > SOON).
        expect_lost(lambda: greedy(remote, PROMPTS[1]), workers[1].endpoint, within=SOON)
        assert remote.check_caches() == []
        assert not remote.target.connected
        # Still absent: refused at once, by the probe, before any model process starts.
        started = len(spawns)
        expect_lost(lambda: greedy(remote, PROMPTS[1]), workers[1].endpoint, within=SOON)
        assert len(spawns) == started and not remote.target.connected
        workers[1] = workers[1].restart()
        again = greedy(remote, PROMPTS[1])  # reloads onto the workers
        assert_same_greedy_tokens(
            local.target, local.tokenize_prompt(PROMPTS[1]), expected.tokens, again.tokens
        )
        assert remote.check_caches() == []


def test_a_stopped_worker_is_declared_lost_after_the_timeout(tiny_pair, workers):
    with rpc_engine(tiny_pair, workers) as remote:
        greedy(remote, PROMPTS[0])
        assert remote.target.timeout == RPC_TIMEOUT  # Engine.load's rpc_timeout reached the model
        remote.target.timeout = TIMEOUT  # loaded: a short deadline from here on
        os.kill(workers[0].process.pid, signal.SIGSTOP)
        try:
            # Lost at the deadline: not before it, and long before the engine's own RPC_TIMEOUT.
            lost = lambda: greedy(remote, PROMPTS[1])  # noqa: E731
            error = expect_lost(lost, workers[0].endpoint, within=SOON, after=TIMEOUT)
            assert "did not answer" in str(error)
            assert remote.check_caches() == []
        finally:
            os.kill(workers[0].process.pid, signal.SIGCONT)
        remote.target.timeout = RPC_TIMEOUT  # a new model process starts: give it a busy CPU's time
        assert greedy(remote, PROMPTS[1]).tokens  # back: the next request reconnects


def test_an_interrupted_call_drops_the_model_process_and_the_next_call_reloads(tiny_pair, workers, local):
    with rpc_engine(tiny_pair, workers) as remote:
        greedy(remote, PROMPTS[0])

        def interrupted(timeout=0.0):
            raise KeyboardInterrupt  # Ctrl-C while the model process decodes

        remote.target._process.connection.poll = interrupted
        with pytest.raises(KeyboardInterrupt):
            greedy(remote, PROMPTS[1])
        assert remote.check_caches() == []
        expected = greedy(local, PROMPTS[1])
        again = greedy(remote, PROMPTS[1])  # a new model process: no stale answer is read
        assert_same_greedy_tokens(
            local.target, local.tokenize_prompt(PROMPTS[1]), expected.tokens, again.tokens
        )


def test_a_worker_absent_at_start_is_a_clear_error(tiny_pair, workers, spawns):
    absent = Endpoint("127.0.0.1", free_port())
    draft, target = tiny_pair
    servers = f"{workers[0].endpoint},{absent}"
    load = lambda: Engine.load(draft, target, n_ctx=256, rpc_servers=servers, rpc_timeout=TIMEOUT)  # noqa: E731
    error = expect_lost(load, absent, within=SOON)
    assert spawns == []  # refused by the probe, before any model process started
    assert "cactus-edge worker" in str(error)  # says how to start one


class FakeWorker:
    """A loopback server that speaks ggml's RPC framing badly: ``hello`` is its HELLO answer
    (bytes after the 8-byte size, or None to hang up at once), and every later command gets
    ``answer``, a reply of the wrong size (malformed data)."""

    def __init__(self, hello: bytes | None, answer: bytes = b"\x03\x00\x00\x00\x00\x00\x00\x00abc") -> None:
        self.hello, self.answer = hello, answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = Endpoint("127.0.0.1", self.listener.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with connection, contextlib.suppress(OSError):
                self._converse(connection)

    def _converse(self, connection: socket.socket) -> None:
        first = True
        while True:
            header = connection.recv(9, socket.MSG_WAITALL)
            if len(header) < 9:
                return
            size = struct.unpack("<Q", header[1:])[0]
            if size:
                connection.recv(size, socket.MSG_WAITALL)
            if first and self.hello is None:
                return
            connection.sendall(struct.pack("<Q", len(self.hello)) + self.hello if first else self.answer)
            first = False

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("hello", [bytes([6, 0, 0, 0]) + bytes(24), bytes([7, 9, 0, 0]) + bytes(24), None])
def test_a_worker_of_another_protocol_version_is_refused_by_name(tiny_pair, hello, spawns):
    fake = FakeWorker(hello)
    try:
        draft, target = tiny_pair
        load = lambda: Engine.load(draft, target, n_ctx=256, rpc_servers=str(fake.endpoint))  # noqa: E731
        error = expect_lost(load, fake.endpoint, within=SOON)
        assert spawns == []  # refused by the probe, before any model process started
        assert "another version of ggml's RPC protocol" in str(error)
    finally:
        fake.close()


def test_a_worker_that_answers_garbage_kills_only_the_model_process(tiny_pair):
    fake = FakeWorker(bytes([7, 0, 0, 0]) + bytes(24))  # a good handshake, then malformed answers
    try:
        draft, target = tiny_pair
        load = lambda: Engine.load(draft, target, n_ctx=256, rpc_servers=str(fake.endpoint))  # noqa: E731
        # Seen when ggml aborts the model process, not at the default rpc deadline (60 s > SOON).
        error = expect_lost(load, fake.endpoint, within=SOON)
        assert "malformed" in str(error)  # ggml's own abort message, relayed
    finally:
        fake.close()
    # This process survived ggml's abort: it still loads and runs models.
    with Engine.load(*tiny_pair, n_ctx=256, n_threads=TEST_THREADS) as engine:
        assert greedy(engine, PROMPTS[0]).tokens


def test_bad_rpc_settings_name_the_setting(tiny_pair):
    for servers in ("nohost:", "host:99999", "a:1,a:1"):
        with pytest.raises(InvalidSettingError) as raised:
            parse_endpoints(servers)
        assert raised.value.param == "rpc_servers"
    assert parse_endpoints("10.0.0.2")[0] == Endpoint("10.0.0.2", 50052)
    with pytest.raises(InvalidSettingError, match="tensor_split"):
        Engine.load(*tiny_pair, n_ctx=256, tensor_split=(1.0, 1.0))


def test_a_build_without_rpc_says_how_to_rebuild(tiny_pair, monkeypatch):
    from cactus_edge.llama import rpc as backend_rpc

    class NoRPC:
        def ggml_backend_reg_by_name(self, name):
            return None

    monkeypatch.setattr(backend_rpc, "_ggml", lambda: NoRPC())
    with pytest.raises(RPCUnavailableError, match="GGML_RPC=ON"):
        Engine.load(*tiny_pair, n_ctx=256, rpc_servers="127.0.0.1:1")


# --- the worker command ----------------------------------------------------------------------------


def run_cli(*args: str, timeout: float = 4 * WAIT) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cactus_edge.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_the_worker_refuses_a_non_loopback_bind():
    refused = run_cli("worker", "--host", "0.0.0.0", "--port", str(free_port()))
    assert refused.returncode == 2
    assert "not loopback" in refused.stderr and "--insecure-bind" in refused.stderr
    assert "no authentication" in refused.stderr
    assert refused.stderr.count("\n") == 1  # one line, no traceback


def test_an_insecure_bind_warns_and_sigterm_exits_0():
    worker = Worker(None, "--host", "0.0.0.0", "--insecure-bind")  # answers on 127.0.0.1 too
    try:
        worker.process.send_signal(signal.SIGTERM)
        _, stderr = worker.process.communicate(timeout=WAIT)
        assert worker.process.returncode == 0
        assert "no authentication" in stderr
    finally:
        worker.kill()


def test_a_port_in_use_is_a_clear_error(workers):
    taken = run_cli("worker", "--port", str(workers[0].port))
    assert taken.returncode == 6
    assert f"cannot listen on 127.0.0.1:{workers[0].port}" in taken.stderr


def test_generate_with_a_lost_worker_exits_with_its_code(tiny_pair):
    draft, target = tiny_pair
    absent = f"127.0.0.1:{free_port()}"
    result = run_cli("generate", "the cat", "--draft", str(draft), "--target", str(target), "--rpc", absent)
    assert result.returncode == WorkerLostError.exit_code == 8
    assert absent in result.stderr and result.stderr.startswith("error: ")


# --- the server ------------------------------------------------------------------------------------


def test_the_server_answers_503_while_a_worker_is_lost_and_serves_again_when_it_is_back(tiny_pair, workers):
    engine = rpc_engine(tiny_pair, workers)
    server = create_server(engine, ServerSettings(port=0, model_name="tiny"))
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=WAIT, max_retries=0)
        messages = [{"role": "user", "content": PROMPTS[0]}]

        def ask():
            return client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0
            )

        first = ask().choices[0].message.content
        workers[0].kill()
        with pytest.raises(openai.APIStatusError) as raised:
            ask()
        assert raised.value.status_code == 503
        body = raised.value.response.json()["error"]
        assert body["code"] == "rpc_worker_lost" and str(workers[0].endpoint) in body["message"]
        assert httpx.get(f"{server.url}/health", timeout=WAIT).status_code == 200  # still serving
        workers[0] = workers[0].restart()
        assert ask().choices[0].message.content == first
        assert engine.check_caches() == []
    finally:
        assert server.stop(timeout=WAIT)
        engine.close()
