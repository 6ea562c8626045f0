"""The Textual chat, driven with Pilot: a fake engine streams scripted tokens with their origin."""

import time

import pytest

from cactus_edge.engine import Engine, GenerationConfig, GenerationStats, StreamEvent
from cactus_edge.errors import CactusEdgeError, ContextLengthError
from cactus_edge.tui import CactusChatApp
from cactus_edge.tui import app as app_module
from cactus_edge.tui.widgets import AssistantMessage, StatusBar, UserMessage

SCRIPT = [("Hello", False), (" there", True), (",", True), (" friend", False), ("!", True)]


class FakeEngine:
    """Streams a script of (text, from_draft) pieces; records what it was asked."""

    def __init__(self, script=SCRIPT, delay=0.0, error=None):
        self.script, self.delay, self.error = script, delay, error
        self.calls = []

    def stream_chat(self, messages, config, cancel=None):
        self.calls.append(([dict(m) for m in messages], config))
        if self.error:
            raise self.error
        stats = GenerationStats(method=config.method)
        for index, (text, drafted) in enumerate(self.script):
            if cancel is not None and cancel.is_set():
                stats.finish_reason = "cancelled"
                yield StreamEvent("", None, finish_reason="cancelled", stats=stats)
                return
            time.sleep(self.delay)
            stats.n_tokens += 1
            stats.n_verifier_calls += 0 if drafted else 1
            yield StreamEvent(text, index, drafted, stats=stats)
        stats.finish_reason = "stop"
        yield StreamEvent("", None, finish_reason="stop", stats=stats)


async def wait_for(pilot, condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


async def started(pilot):
    await wait_for(
        pilot,
        lambda: (
            pilot.app.engine is not None
            and pilot.app.screen.id != "_default"
            and pilot.app.screen.query("#prompt")
        ),
    )


async def say(pilot, text):
    pilot.app.screen.query_one("#prompt").value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: not pilot.app.generating)


def make_app(engine=None, **kwargs):
    engine = engine or FakeEngine()
    return CactusChatApp(lambda: engine, GenerationConfig(n_draft=4), **kwargs), engine


async def test_sending_a_message_streams_the_reply():
    app, engine = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hi")
        assert [m.renderable if hasattr(m, "renderable") else None for m in app.screen.query(UserMessage)]
        reply = app.screen.query_one(AssistantMessage)
        assert reply.reply.text == "Hello there, friend!"
        assert reply.reply.pieces == [(t, d) for t, d in SCRIPT]
        assert app.messages == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello there, friend!"},
        ]
        assert engine.calls[0][0] == [{"role": "user", "content": "hi"}]


async def test_acceptance_view_toggles():
    app, _ = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hi")
        message = app.screen.query_one(AssistantMessage)
        tokens, markdown = message.query_one(".tokens"), message.query_one(".markdown")
        assert app.acceptance_view and tokens.display and not markdown.display
        styled = message.reply.styled()
        assert [span.style for span in styled.spans if span.style] == ["underline #4fb286"] * 3
        await pilot.press("ctrl+t")
        assert not app.acceptance_view and markdown.display and not tokens.display
        assert not app.screen.query_one("#legend").display
        await pilot.press("ctrl+t")
        assert tokens.display


async def test_stop_mid_reply_keeps_text_and_the_next_turn_works():
    long_script = [(f" w{i}", i % 2 == 0) for i in range(200)]
    engine = FakeEngine(long_script, delay=0.01)
    app, _ = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        app.screen.query_one("#prompt").value = "go"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.screen.query_one(AssistantMessage).reply.pieces) >= 5)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        partial = app.messages[-1]["content"]
        assert app.messages[-1]["role"] == "assistant" and 0 < len(partial.split()) < 200
        engine.script, engine.delay = SCRIPT, 0.0
        await say(pilot, "again")
        assert engine.calls[-1][0][1] == {"role": "assistant", "content": partial}
        assert app.messages[-1]["content"] == "Hello there, friend!"


async def test_slash_commands_change_the_config_passed_to_the_engine():
    app, engine = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        for command in (
            "/method sps",
            "/delta 0.5",
            "/k 6",
            "/temp 0.3",
            "/drafter model+lookup",
            "/system be brief",
        ):
            app.screen.query_one("#prompt").value = command
            await pilot.press("enter")
        await say(pilot, "hi")
        messages, config = engine.calls[-1]
        assert (config.method, config.delta, config.n_draft, config.temperature) == ("sps", 0.5, 6, 0.3)
        assert config.drafter == "model+lookup"
        assert messages[0] == {"role": "system", "content": "be brief"}
        app.screen.query_one("#prompt").value = "/delta -1"
        await pilot.press("enter")
        assert app.config.delta == 0.5  # refused: a ValueError naming delta became a notification
        app.screen.query_one("#prompt").value = "/k auto"
        await pilot.press("enter")
        assert app.config.n_draft == "auto"


async def test_engine_errors_become_notifications(monkeypatch):
    engine = FakeEngine(error=ContextLengthError("the prompt has 5000 tokens but the context holds 4096"))
    app, _ = make_app(engine)
    notes = []
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        monkeypatch.setattr(app, "notify", lambda text, **kw: notes.append((text, kw.get("severity"))))
        await say(pilot, "hi")
        await wait_for(pilot, lambda: notes)
        assert notes[-1][1] == "error" and "/drop" in notes[-1][0] and "ctrl+n" in notes[-1][0]
        assert app.messages == [] and not app.screen.query(AssistantMessage)
        engine.error = None
        await say(pilot, "hi again")  # the app keeps running
        assert app.messages[-1]["content"] == "Hello there, friend!"


async def test_failed_load_is_shown_not_raised():
    def broken():
        raise CactusEdgeError("model file not found: /nope.gguf")

    app = CactusChatApp(broken, GenerationConfig())
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: "nope.gguf" in str(app.screen.query_one("#loading-text").render()))


async def test_save_load_round_trip_and_export(monkeypatch, tmp_path):
    monkeypatch.setattr(app_module, "conversations_dir", lambda: tmp_path)
    app, _ = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hi")
        app.screen.query_one("#prompt").value = "/save first"
        await pilot.press("enter")
        await pilot.press("ctrl+n")
        assert app.messages == [] and not app.screen.query(AssistantMessage)
        app.screen.query_one("#prompt").value = "/load first"
        await pilot.press("enter")
        await pilot.pause()
        assert app.messages[-1]["content"] == "Hello there, friend!"
        assert app.screen.query_one(AssistantMessage).reply.pieces == [(t, d) for t, d in SCRIPT]
        app.screen.query_one("#prompt").value = f"/export {tmp_path / 'chat.md'}"
        await pilot.press("enter")
    assert "### Assistant\n\nHello there, friend!" in (tmp_path / "chat.md").read_text()


async def test_regenerate_replaces_the_last_reply():
    app, engine = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hi")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(engine.calls) == 2 and not app.generating)
        assert len(app.screen.query(AssistantMessage)) == 1
        assert engine.calls[1][0] == [{"role": "user", "content": "hi"}]


async def test_real_engine_on_the_tiny_pair(tiny_pair):
    def factory():
        return Engine(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512)

    app = CactusChatApp(factory, GenerationConfig(n_draft=3, max_tokens=24, seed=0))
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hello world")
        assert app.messages[-1]["role"] == "assistant"
        assert app.last_stats.n_tokens > 0 and app.last_stats.n_verifier_calls > 0
        status = str(app.screen.query_one(StatusBar).render())
        assert "tok/s" in status and "AL" in status
        app.engine.close()


@pytest.mark.parametrize("acceptance_view", [True, False], ids=["acceptance-view", "markdown-view"])
def test_snapshot_of_a_short_conversation(snap_compare, acceptance_view):
    app, _ = make_app()

    async def run_before(pilot):
        await started(pilot)
        await say(pilot, "hi")
        if not acceptance_view:
            await pilot.press("ctrl+t")
        await pilot.pause()

    assert snap_compare(app, run_before=run_before, terminal_size=(80, 24))
