"""The Textual chat, driven with Pilot: a fake engine streams scripted tokens with their origin.

No test depends on how busy the machine is: a stream that must still be running when the test
acts is held (``hold_after``) until it is cancelled or released, and every wait is for a condition,
capped at PATIENCE seconds (reached only by a broken app)."""

import io
import json
import subprocess
import sys
import threading
import time

import pytest

from cactus_edge.engine.config import GenerationConfig
from cactus_edge.engine.events import StreamEvent
from cactus_edge.engine.stats import GenerationStats, StepStats
from cactus_edge.errors import CactusEdgeError, ContextLengthError
from cactus_edge.tui import CactusChatApp
from cactus_edge.tui import conversations as conversations_module
from cactus_edge.tui.widgets import (
    AssistantMessage,
    Reply,
    StatusBar,
    UserMessage,
    calls_saved,
    fenced_parts,
)

from .conftest import TEST_THREADS

SCRIPT = [("Hello", False), (" there", True), (",", True), (" friend", False), ("!", True)]
TEXT = "Hello there, friend!"
CODE_SCRIPT = [
    ("Here", False),
    (" is code:\n\n", True),
    ("```python\n", True),
    ("def f(x):\n", False),
    ("    return", True),
    (" x + 1\n", False),
    ("```", True),
    ("\n\nDone.", False),
]
PATIENCE = 60.0  # seconds a wait for the app may take at most: Textual and llama.cpp on a busy CPU
HOLD_TIMEOUT = 2 * PATIENCE  # a held stream nobody cancels fails the test instead of hanging it


class FakeEngine:
    """Streams a script of (text, from_draft) pieces; records what it was asked, the cancel event
    of each stream, and its ``close()`` calls. Its statistics count verifier calls as the engine
    does: the prompt's prefill gives the first piece, each later call gives its accepted drafts and
    then one piece of its own, and a call gives the end-of-generation token (not shown) unless it
    ends a run of drafts.

    With ``hold_after=n`` a stream stops before piece n until ``release`` or its cancel event is
    set (then it ends "cancelled", as the engine does at the end of a step), so a test can act while
    a reply streams; ``holding`` tells that a stream got there.
    """

    def __init__(self, script=SCRIPT, error=None, hold_after=None):
        self.script, self.error, self.hold_after = script, error, hold_after
        self.calls, self.cancels = [], []
        self.holding, self.release = threading.Event(), threading.Event()
        self.closed = 0
        self.cancelled_at_close = None

    def close(self, wait=5.0):
        self.closed += 1
        self.cancelled_at_close = [cancel.is_set() for cancel in self.cancels]

    def stream_chat(self, messages, config, cancel=None):
        self.calls.append(([dict(m) for m in messages], config))
        self.cancels.append(cancel)
        hold = self.hold_after  # read once: a test may change it for the next stream
        if self.error:
            raise self.error
        stats = GenerationStats(method=config.method)
        for index, (text, drafted) in enumerate(self.script):
            if index == hold:
                self._hold(cancel)
            if cancel is not None and cancel.is_set():
                stats.finish_reason = "cancelled"
                yield StreamEvent("", None, finish_reason="cancelled", stats=stats)
                return
            if index == 0 or not self.script[index - 1][1]:  # a call starts, recorded before its tokens
                self._call(stats, self._drafts_from(index))
            stats.n_tokens += 1
            yield StreamEvent(text, index, drafted, stats=stats)
        if not self.script or not self.script[-1][1]:
            self._call(stats, 0)  # the call whose token is the end of generation
        stats.finish_reason = "stop"
        yield StreamEvent("", None, finish_reason="stop", stats=stats)

    def _drafts_from(self, index):
        """How many pieces from index on are drafts: the accepted drafts of the call starting there."""
        ends = [j for j in range(index, len(self.script)) if not self.script[j][1]]
        return (ends[0] if ends else len(self.script)) - index

    @staticmethod
    def _call(stats, n_accepted):
        drafter = "model" if n_accepted else "none"
        step = StepStats(n_accepted, n_accepted, 0.0, 0.0, 0.0, drafter=drafter, n_decided=n_accepted)
        stats.record(step, prefill=not stats.steps)

    def _hold(self, cancel):
        self.holding.set()
        deadline = time.monotonic() + HOLD_TIMEOUT
        while not (self.release.is_set() or cancel.wait(0.01)):
            if time.monotonic() > deadline:
                raise TimeoutError("the held stream was never cancelled")


async def wait_for(pilot, condition, timeout=PATIENCE):
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


async def enter(pilot, text):
    pilot.app.screen.query_one("#prompt").value = text
    await pilot.press("enter")


async def say(pilot, text, timeout=PATIENCE):
    await enter(pilot, text)
    await wait_for(pilot, lambda: not pilot.app.generating, timeout)


async def start_streaming(pilot, engine, text):
    """Send text and wait until the engine holds its reply mid-stream."""
    engine.holding.clear()
    await enter(pilot, text)
    await wait_for(pilot, engine.holding.is_set)
    assert pilot.app.generating


def shown(app):
    """The conversation on screen: (role, text) per message widget, top to bottom."""
    return [
        ("user", str(widget.content)) if isinstance(widget, UserMessage) else ("assistant", widget.reply.text)
        for widget in app.conversation.children
    ]


async def assert_conversation(pilot, *turns):
    """The app holds exactly these (role, text) turns: in messages, in replies and on screen."""
    app = pilot.app
    assert app.messages == [{"role": role, "content": text} for role, text in turns]
    assert [reply.text for reply in app.replies] == [text for role, text in turns if role == "assistant"]
    deadline = time.monotonic() + PATIENCE
    while shown(app) != list(turns) and time.monotonic() < deadline:  # widgets mount and unmount
        await pilot.pause(0.02)
    assert shown(app) == list(turns)


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


@pytest.mark.parametrize(
    ("script", "n_draft", "figures"),
    [
        # k = 0: the prefill's call and one call per later token, end token included; as plain decoding.
        ([("Hello", False), (" there", False), ("!", False)], "auto", "k=auto(0) · 0.0 tok/s · AL 0.00"),
        # 3 calls where plain decoding makes 6 (5 tokens and the end token): 3 accepted drafts saved 3.
        (SCRIPT, 4, "k=4 · 0.0 tok/s · AL 1.00"),
    ],
    ids=["no-drafts", "drafts"],
)
async def test_calls_saved_counts_calls_against_plain_decoding(script, n_draft, figures):
    engine = FakeEngine(script)
    app = CactusChatApp(lambda: engine, GenerationConfig(method="sps", n_draft=n_draft))
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hi")
        drafted = sum(from_draft for _, from_draft in script)
        assert app.last_stats.n_verifier_calls == len(script) + 1 - drafted
        status = str(app.screen.query_one(StatusBar).render())
        assert status == f"sps · {figures} · first token 0.0 s · calls saved: {drafted}"


def test_the_status_bar_says_when_the_prompt_came_back_from_memory_and_fits_80_columns():
    bar = StatusBar()
    stats = GenerationStats(method="cactus", lossy=True, prompt_cache="memory", prompt_cache_restore_ms=150.0)
    stats.record(StepStats(0, 0, 0.0, 0.0, 250.0, None, "", 0, 0), prefill=True)
    stats.record(StepStats(4, 3, 10.0, 20.0, 40.0, 0.01234, "model", 4, 0))
    stats.n_tokens = 5
    config = GenerationConfig(n_draft="auto")
    shown = []
    bar.update = shown.append
    bar.show(config, stats)
    assert "first token 0.4 s (memory)" in shown[-1] and len(shown[-1]) <= 80
    bar.show(config, stats, streaming=True)
    assert shown[-1].endswith("esc stops") and len(shown[-1]) <= 80
    assert "KL" not in shown[-1]  # the last figure left out to fit


def test_calls_saved_leaves_out_drafts_accepted_past_the_end():
    # prefill; a call with 2 accepted drafts; a last call whose 3 accepted drafts are "a <end> c":
    # 5 tokens shown, and plain decoding would have made 6 calls (the end token's included), not 8.
    stats = GenerationStats(method="sps")
    for n_accepted in (0, 2, 3):
        stats.record(
            StepStats(n_accepted, n_accepted, 0, 0, 0, n_decided=n_accepted), prefill=not stats.steps
        )
    stats.n_tokens = 5
    assert calls_saved(stats) == 5  # streaming: every accepted draft so far
    stats.finish_reason = "stop"
    assert calls_saved(stats) == 3


async def test_acceptance_view_shows_fenced_code_as_a_block_with_its_draft_underlines():
    from textual.geometry import Region
    from textual.widgets.markdown import MarkdownFence

    app, _ = make_app(FakeEngine(CODE_SCRIPT))
    async with app.run_test(size=(80, 30)) as pilot:
        await started(pilot)
        await say(pilot, "hi")
        await pilot.pause()
        message = app.screen.query_one(AssistantMessage)
        tokens = message.query_one(".tokens")
        lines = [
            (strip.text.rstrip(), {s.style.bgcolor for s in strip if s.text.strip()}, strip)
            for strip in tokens.render_lines(Region(0, 0, tokens.size.width, tokens.size.height))
        ]
        assert [text for text, _, _ in lines] == [
            "Here is code:",
            "",
            " def f(x):",
            "     return x + 1",
            "",
            "Done.",
        ]
        (prose,), (code,) = lines[0][1], lines[2][1]
        assert code is not None and code != prose and lines[3][1] == {code}  # one background for the block
        underlined = [[seg.text for seg in strip if seg.style.underline] for _, _, strip in lines]
        assert underlined[0] == [" is code:"] and underlined[3] == ["    ", "return"]
        await pilot.press("ctrl+t")  # the markdown view renders fences itself
        await pilot.pause()
        assert len(message.query(MarkdownFence)) == 1


def test_a_reply_with_crlf_line_ends_keeps_its_code_block_in_place():
    from rich.console import Console

    console = Console(width=20, record=True, file=io.StringIO())
    console.print(Reply([("a\r\n```py\r\nx = 1\r\n", True), ("```\r\nb", False)]).rendered())
    assert [line.rstrip() for line in console.export_text().splitlines()] == ["a", "", " x = 1", "", "b"]


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("no code", [(0, 7, None)]),
        ("a\n```py\nx\n```\nb", [(0, 2, None), (8, 10, "py"), (14, 15, None)]),
        ("a\n```\nx", [(0, 2, None), (6, 7, "")]),  # still streaming: the block runs to the end
        ("~~~~ c\n~~~\n~~~~~\n", [(7, 11, "c")]),  # a shorter fence does not close it
        ("  ```js\ny\n  ```", [(8, 10, "js")]),  # indented, as in a list item
        ("say ```x``` and\n```x```", [(0, 23, None)]),  # backticks in the info string: not a fence
    ],
)
def test_fenced_parts(text, parts):
    assert fenced_parts(text) == parts


async def test_stop_mid_reply_keeps_text_and_the_next_turn_works():
    # The reply streams on unpaced while Escape is on its way, but it is held at piece 100 until
    # cancelled: however slow the app is to act, the stop lands mid-reply.
    long_script = [(f" w{i}", i % 2 == 0) for i in range(200)]
    engine = FakeEngine(long_script, hold_after=100)
    app, _ = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        app.screen.query_one("#prompt").value = "go"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.screen.query_one(AssistantMessage).reply.pieces) >= 5)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        assert engine.cancels[0].is_set()
        partial = app.messages[-1]["content"]
        assert app.messages[-1]["role"] == "assistant" and 0 < len(partial.split()) < 200
        engine.script, engine.hold_after = SCRIPT, None
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
            "/budget 2.5",
            "/system be brief",
        ):
            app.screen.query_one("#prompt").value = command
            await pilot.press("enter")
        await say(pilot, "hi")
        messages, config = engine.calls[-1]
        assert (config.method, config.delta, config.n_draft, config.temperature) == ("sps", 0.5, 6, 0.3)
        assert config.drafter == "model+lookup" and config.kl_budget == 2.5
        assert messages[0] == {"role": "system", "content": "be brief"}
        app.screen.query_one("#prompt").value = "/delta -1"
        await pilot.press("enter")
        assert app.config.delta == 0.5  # refused: a ValueError naming delta became a notification
        app.screen.query_one("#prompt").value = "/k auto"
        await pilot.press("enter")
        assert app.config.n_draft == "auto"
        app.screen.query_one("#prompt").value = "/budget off"
        await pilot.press("enter")
        assert app.config.kl_budget is None


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


async def test_the_app_says_which_models_run_once_they_load():
    notes = []
    app, engine = make_app(describe_models=lambda loaded: f"draft d -> target t ({loaded is engine})")
    app.notify = lambda text, **kw: notes.append(text)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await wait_for(pilot, lambda: notes)
    assert notes == ["draft d -> target t (True)"]


async def test_failed_load_is_shown_not_raised():
    def broken():
        raise CactusEdgeError("model file not found: /nope.gguf")

    app = CactusChatApp(broken, GenerationConfig())
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: "nope.gguf" in str(app.screen.query_one("#loading-text").render()))


async def test_save_load_round_trip_and_export(monkeypatch, tmp_path):
    monkeypatch.setattr(conversations_module, "conversations_dir", lambda: tmp_path)
    app, _ = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hi")
        app.screen.query_one("#prompt").value = "/save first"
        await pilot.press("enter")
        await pilot.press("ctrl+n")
        assert app.messages == [] and not app.screen.query(AssistantMessage)
        await enter(pilot, "/load first")
        await wait_for(pilot, lambda: app.messages)
        await assert_conversation(pilot, ("user", "hi"), ("assistant", TEXT))
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
    from cactus_edge.engine.engine import Engine

    def factory():
        return Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS)

    app = CactusChatApp(factory, GenerationConfig(n_draft=3, max_tokens=24, seed=0))
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hello world", timeout=120)  # llama.cpp on a shared, busy CPU
        assert app.messages[-1]["role"] == "assistant"
        assert app.last_stats.n_tokens > 0 and app.last_stats.n_verifier_calls > 0
        status = str(app.screen.query_one(StatusBar).render())
        assert "tok/s" in status and "AL" in status
    assert app.engine is None  # the app closed it on the way out


async def test_a_saved_conversation_comes_back_with_its_kv_cache_after_a_restart(
    tiny_pair, tmp_path, monkeypatch
):
    """/save keeps the conversation's KV cache in the cache folder; a new app (a restart) that
    /loads it and asks again restores the prompt from disk instead of prefilling it."""
    from cactus_edge.engine.engine import Engine

    monkeypatch.setattr(conversations_module, "conversations_dir", lambda: tmp_path / "saved")

    def factory():
        engine = Engine.load(
            str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=512, n_threads=TEST_THREADS, cache_dir=tmp_path / "kv"
        )
        engine.prompt_cache.min_tokens = 16
        return engine

    config = GenerationConfig(n_draft=3, max_tokens=8, seed=0, temperature=0.0)
    long_message = "the water is hot and the code is cold " * 12
    app = CactusChatApp(factory, config)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, long_message, timeout=120)
        await enter(pilot, "/save kept")
        await wait_for(pilot, lambda: list((tmp_path / "kv").glob("*/*.kvc")), 60)
    restarted = CactusChatApp(factory, config)
    async with restarted.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await enter(pilot, "/load kept")
        await wait_for(pilot, lambda: restarted.messages)
        await say(pilot, "and then", timeout=120)
        assert restarted.last_stats.prompt_cache == "disk"
        assert restarted.last_stats.n_prompt_decoded < 40  # the new turn, not the whole conversation
        assert "(disk)" in str(restarted.screen.query_one(StatusBar).render())


def test_the_app_loads_without_llama_cpp():
    """The engine is reached only through the factory: the chat module imports no model library."""
    code = (
        "import sys; sys.modules['llama_cpp'] = None\n"
        "import cactus_edge.tui.app\n"
        "assert 'cactus_edge.engine.engine' not in sys.modules, 'the TUI imported the engine'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- conversation changes while a reply streams: each cancels it first -------------------------


@pytest.mark.parametrize("how", ["ctrl+n", "/new"])
async def test_new_chat_while_a_reply_streams_cancels_it_and_starts_empty(how):
    engine = FakeEngine(hold_after=2)
    app, _ = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await start_streaming(pilot, engine, "first")
        if how == "ctrl+n":
            await pilot.press("ctrl+n")
        else:
            await enter(pilot, how)
        await wait_for(pilot, lambda: not app.generating)
        assert engine.cancels[0].is_set()
        await assert_conversation(pilot)
        engine.hold_after = None
        await say(pilot, "second")  # the old reply's late messages must not land here
        await assert_conversation(pilot, ("user", "second"), ("assistant", TEXT))
        assert engine.calls[-1][0] == [{"role": "user", "content": "second"}]


async def test_load_while_a_reply_streams_cancels_it_and_shows_only_the_loaded_chat(monkeypatch, tmp_path):
    monkeypatch.setattr(conversations_module, "conversations_dir", lambda: tmp_path)
    saved = {
        "system": "be brief",
        "messages": [
            {"role": "user", "content": "old question"},
            {"role": "assistant", "content": "old answer"},
        ],
        "replies": [[["old ", True], ["answer", False]]],
    }
    (tmp_path / "saved.json").write_text(json.dumps(saved))
    engine = FakeEngine(hold_after=2)
    app, _ = make_app(engine)
    notes = []
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        monkeypatch.setattr(app, "notify", lambda text, **kw: notes.append(text))
        await start_streaming(pilot, engine, "go")
        await enter(pilot, "/load missing")  # a failed load leaves the reply streaming
        await wait_for(pilot, lambda: any(note.startswith("/load:") for note in notes))
        assert app.generating and not engine.cancels[0].is_set()
        await enter(pilot, "/load saved")
        await wait_for(pilot, lambda: app.messages and app.messages[0]["content"] == "old question")
        assert engine.cancels[0].is_set() and not app.generating and len(engine.calls) == 1
        await assert_conversation(pilot, ("user", "old question"), ("assistant", "old answer"))
        assert app.replies[0].pieces == [("old ", True), ("answer", False)] and app.system == "be brief"


async def test_drop_while_a_reply_streams_keeps_the_partial_reply_then_drops_the_oldest():
    engine = FakeEngine()
    app, _ = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "one")
        engine.hold_after = 2
        await start_streaming(pilot, engine, "two")
        await enter(pilot, "/drop")
        await wait_for(pilot, lambda: not app.generating and app.messages[0]["content"] == "two")
        assert engine.cancels[1].is_set()
        await assert_conversation(pilot, ("user", "two"), ("assistant", "Hello there"))
        assert app.replies[0].pieces == SCRIPT[:2]


async def test_regenerate_while_a_reply_streams_cancels_it_and_streams_a_new_one():
    engine = FakeEngine(hold_after=2)
    app, _ = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await start_streaming(pilot, engine, "hi")
        engine.hold_after = None
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(engine.calls) == 2 and not app.generating)
        assert engine.cancels[0].is_set() and not engine.cancels[1].is_set()
        assert engine.calls[1][0] == [{"role": "user", "content": "hi"}]
        await assert_conversation(pilot, ("user", "hi"), ("assistant", TEXT))


async def test_stop_before_any_text_withdraws_the_exchange():
    engine = FakeEngine()
    app, _ = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "one")
        engine.hold_after = 0
        await start_streaming(pilot, engine, "two")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        await assert_conversation(pilot, ("user", "one"), ("assistant", TEXT))
        assert app.screen.query_one("#prompt").value == "two"  # given back, not lost


@pytest.mark.parametrize("how", ["ctrl+q", "run ends"])
async def test_quit_while_a_reply_streams_cancels_it_then_closes_the_engine(how):
    engine = FakeEngine(hold_after=2)
    app, _ = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await start_streaming(pilot, engine, "go")
        if how == "ctrl+q":
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: app.return_code is not None)
    assert engine.closed == 1 and engine.cancelled_at_close == [True]
    assert app.messages == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Hello there"},
    ]
    assert [reply.pieces for reply in app.replies] == [SCRIPT[:2]]


@pytest.mark.parametrize("how", ["ctrl+q", "run ends"])
async def test_leaving_while_idle_closes_the_engine_once(how):
    app, engine = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await say(pilot, "hi")
        if how == "ctrl+q":
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: app.return_code is not None)
        assert engine.closed == 0
    assert engine.closed == 1
    assert app.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TEXT}]
    assert [reply.text for reply in app.replies] == [TEXT]


async def test_help_over_a_streaming_reply():
    engine = FakeEngine(hold_after=2)
    app, _ = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await start_streaming(pilot, engine, "hi")
        await pilot.press("f1")
        engine.release.set()  # the reply ends behind the help screen
        await wait_for(pilot, lambda: not app.generating)
        await pilot.press("escape")
        await assert_conversation(pilot, ("user", "hi"), ("assistant", TEXT))


@pytest.mark.parametrize(
    ("acceptance_view", "script"),
    [(True, SCRIPT), (False, SCRIPT), (True, CODE_SCRIPT)],
    ids=["acceptance-view", "markdown-view", "code-in-the-acceptance-view"],
)
def test_snapshot_of_a_short_conversation(snap_compare, acceptance_view, script):
    app, _ = make_app(FakeEngine(script))

    async def run_before(pilot):
        await started(pilot)
        pilot.app.screen.query_one("#prompt").cursor_blink = False  # a busy CPU must not catch it off
        await say(pilot, "hi")
        if not acceptance_view:
            await pilot.press("ctrl+t")
        await pilot.pause()

    assert snap_compare(app, run_before=run_before, terminal_size=(80, 24))


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        "{not json",
        json.dumps({"messages": "hi", "replies": []}),
        json.dumps({"messages": [{"role": "system", "content": "x"}], "replies": []}),
        json.dumps({"messages": [{"role": "user"}], "replies": []}),
        json.dumps(
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "replies": [],
            }
        ),
        json.dumps({"messages": [{"role": "assistant", "content": "a"}], "replies": [["a", True]]}),
        json.dumps({"system": 3, "messages": [], "replies": []}),
    ],
)
def test_a_file_that_is_not_a_saved_conversation_is_a_value_error_naming_it(tmp_path, content):
    path = tmp_path / "other.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="other.json is not a saved conversation|Expecting"):
        conversations_module.read_transcript(path)


def test_load_without_a_name_takes_the_most_recent_save(monkeypatch, tmp_path):
    import os

    monkeypatch.setattr(conversations_module, "conversations_dir", lambda: tmp_path)
    for age, name in ((100, "zz-my-own-name"), (10, "20261201-100000")):
        path = tmp_path / f"{name}.json"
        path.write_text("{}")
        os.utime(path, (time.time() - age, time.time() - age))
    assert conversations_module.saved_path().name == "20261201-100000.json"


async def test_loading_a_wrongly_shaped_file_is_a_notification_and_the_chat_goes_on(monkeypatch, tmp_path):
    monkeypatch.setattr(conversations_module, "conversations_dir", lambda: tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"messages": [{"role": "user"}], "replies": []}))
    app, _ = make_app()
    notes = []
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        monkeypatch.setattr(app, "notify", lambda text, **kw: notes.append((text, kw.get("severity"))))
        await say(pilot, "hi")
        await enter(pilot, "/load bad")
        await wait_for(pilot, lambda: notes)
        assert notes == [
            ("/load: bad.json is not a saved conversation: message 0 has no text content", "error")
        ]
        await assert_conversation(pilot, ("user", "hi"), ("assistant", TEXT))
