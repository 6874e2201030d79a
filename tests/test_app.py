"""The Textual app through Pilot: chat, stop, sessions, restart, profile switching, errors; the session store."""
import asyncio
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from ninfer_tui import profiles
from ninfer_tui.app.app import ChatInput, MessageView, NinferApp
from ninfer_tui.app.dialogs import Ask, Confirm, ErrorDialog
from ninfer_tui.app.profiles_screen import ProfilesScreen
from ninfer_tui.sessions import SessionStore

from .conftest import ROOT


async def wait_for(pilot, cond, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await pilot.pause(0.05)
    raise AssertionError("condition not met in time")


def user_profile(name: str, body: str) -> None:
    (profiles.user_dir() / f"{name}.toml").write_text(textwrap.dedent(body))


@pytest.fixture
def quick_profile():
    user_profile("quick", 'extends = "cpu-default"\n[sampling]\ntemperature = 0.0\nmax_tokens = 12\n')
    return "quick"


async def send(pilot, app, text: str) -> None:
    box = app.query_one(ChatInput)
    box.text = text
    box.focus()
    await pilot.press("enter")


async def chat_once(pilot, app, text: str) -> None:
    """Wait for the model, send one message, wait for the whole reply."""
    await wait_for(pilot, lambda: app.client is not None)
    await send(pilot, app, text)
    await wait_for(pilot, lambda: not app.busy and len(app.messages) == 2)


def test_chat_streams_a_reply_and_saves_it(quick_profile):
    async def run():
        app = NinferApp(quick_profile, attach=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await chat_once(pilot, app, "Name a fruit.")
            views = app.query(MessageView)
            assert [v.role for v in views] == ["user", "assistant"] and views[1].content
            assert "tok/s" in str(app.query_one("#status").render())
            stored = app.store.messages(app.session.id)
            assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content == views[1].content
            assert app.store.get(app.session.id).title == "Name a fruit."
            # regenerate replaces the last reply; edit puts the last message back into the input
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: not app.busy and len(app.messages) == 2)
            assert len(app.store.messages(app.session.id)) == 2
            await pilot.press("ctrl+e")
            assert app.query_one(ChatInput).text == "Name a fruit." and app.messages == []
            return app.session.id

    asyncio.run(run())


def test_stop_mid_stream():
    user_profile("long", 'extends = "cpu-default"\n[sampling]\nmax_tokens = 400\n')

    async def run():
        app = NinferApp("long", attach=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.client is not None)
            await send(pilot, app, "Write a very long story about a dragon.")
            await wait_for(pilot, lambda: app.reply is not None and app.views[-1].content)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.busy, timeout=20)
            assert "(stopped)" in str(app.query_one("#status").render())
            saved = app.store.messages(app.session.id)[-1]
            assert saved.role == "assistant" and saved.content == app.views[-1].content

    asyncio.run(run())


def test_sessions_new_rename_search_delete_and_restart(quick_profile):
    store = SessionStore()
    a = store.create()
    store.add(a.id, "user", "tell me about lighthouses")
    b = store.create()
    store.add(b.id, "user", "a recipe for bread")

    async def run():
        app = NinferApp(quick_profile, store=store, attach=False)
        async with app.run_test(size=(120, 40)) as pilot:
            lv = app.query_one("#sessions")
            assert len(lv.children) == 2
            app.open_session(a.id)
            await pilot.pause()
            assert [v.content for v in app.query(MessageView)] == ["tell me about lighthouses"]
            await pilot.press("f2")
            assert isinstance(app.screen, Ask)
            app.screen.query_one("#answer").value = "Lighthouses"
            await pilot.press("enter")
            assert store.get(a.id).title == "Lighthouses"
            await pilot.press("ctrl+f")
            for ch in "bread":
                await pilot.press(ch)
            await pilot.pause()
            assert [item.session_id for item in app.query_one("#sessions").children] == [b.id]
            app.query_one("#search").value = ""
            await pilot.pause()
            app.open_session(b.id)
            await pilot.press("ctrl+d")
            assert isinstance(app.screen, Confirm)
            await pilot.click("#yes")
            await pilot.pause()
            assert store.get(b.id) is None and app.session is None

    asyncio.run(run())

    async def restart():  # a new app on the same database sees what the first one left
        app = NinferApp(quick_profile, store=SessionStore(), attach=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            titles = [str(item.query_one("Label").render()) for item in app.query_one("#sessions").children]
            assert titles == ["Lighthouses"]

    asyncio.run(restart())


def test_switch_profile_keeps_the_conversation_and_bad_profile_shows_error(quick_profile):
    user_profile("other", 'extends = "cpu-default"\nmax_context = 4096\n[sampling]\ntemperature = 0.0\n'
                          'max_tokens = 4\n')
    user_profile("broken", "max_context = 'huge'\n")

    async def run():
        app = NinferApp(quick_profile, attach=False)
        async with app.run_test(size=(140, 40)) as pilot:
            await chat_once(pilot, app, "Hi")
            await pilot.press("f3")
            assert isinstance(app.screen, ProfilesScreen)
            table = app.screen.query_one("#profiles")
            assert table.row_count >= 7
            app.screen.dismiss("other")
            await wait_for(pilot, lambda: app.client is not None and app.client.profile == "other")
            assert app.engine_max_context() == 4096 and len(app.messages) == 2
            app.switch_profile("broken")
            await pilot.pause()
            assert isinstance(app.screen, ErrorDialog)
            assert "broken.toml: key 'max_context'" in str(app.screen.query_one("#error-message").render())
            assert app.profile.name == "other"

    asyncio.run(run())


def test_help_screen_lists_keys(quick_profile):
    async def run():
        app = NinferApp(quick_profile, attach=False)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("f1")
            text = str(app.screen.query_one("#help-text").render())
            assert "Ctrl+N" in text and "stop the reply" in text

    asyncio.run(run())


def test_session_db_survives_kill_9_mid_reply(tmp_path):
    db = tmp_path / "s.db"
    writer = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from ninfer_tui.sessions import SessionStore
        s = SessionStore(__import__('pathlib').Path({str(db)!r}))
        sid = s.create().id
        s.add(sid, "user", "hello")
        mid = s.add(sid, "assistant", "")
        text = ""
        print("ready", flush=True)
        while True:
            text += "token "
            s.update(mid, text, tokens=len(text) // 6)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    os.kill(proc.pid, 9)
    proc.wait()
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    content, tokens = con.execute("SELECT content, tokens FROM messages WHERE role='assistant'").fetchone()
    assert content.startswith("token ") and tokens == len(content) // 6


def test_line_chat_with_a_terminal(quick_profile, capsys):
    """`ninfer chat` on a TTY: prompt_toolkit reads typed lines (its pipe input stands in for the keyboard)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from ninfer_tui.chat import LineChat, _keys, loop
    from ninfer_tui.cli import build_parser

    args = build_parser().parse_args(["chat", "--profile", quick_profile])
    store = SessionStore()
    chat = LineChat(args, store)
    chat.new()
    with create_pipe_input() as inp:
        inp.send_text("Say hello.\r/sessions\r/new\rAnd\x1b\ragain.\r/exit\r")  # Esc+Enter: a new line
        session = PromptSession(input=inp, output=DummyOutput(), multiline=True, key_bindings=_keys())
        assert loop(chat, session) == 0
    sessions = store.list()
    assert [s.title for s in sessions] == ["And again.", "Say hello."]
    assert store.messages(sessions[0].id)[0].content == "And\nagain."
    assert [m.role for m in store.messages(sessions[1].id)] == ["user", "assistant"]
    assert "Say hello." in capsys.readouterr().err  # /sessions listed it
