"""The Textual app through Pilot: chat, stop, sessions, restart, profile switching, keys, dialogs at 80x24, errors;
the session store."""
import asyncio
import dataclasses
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pytest
from textual import events

from ninfer_tui import profiles
from ninfer_tui.app.app import ChatInput, MessageView, NinferApp
from ninfer_tui.app.dialogs import Ask, AttachFile, Confirm, ErrorDialog
from ninfer_tui.app.gpu_clean_screen import GpuCleanScreen
from ninfer_tui.app.help import HelpScreen
from ninfer_tui.app.profiles_screen import ProfilesScreen
from ninfer_tui.app.server_screen import ServerScreen
from ninfer_tui.app.speedcheck_screen import SpeedcheckScreen
from ninfer_tui.attachments import Attachment, pasted_file
from ninfer_tui.sessions import SessionStore

from .conftest import ROOT, make_video

_ENGINES: dict[str, object] = {}  # one engine per engine configuration, for every test of the app


@pytest.fixture(autouse=True)
def shared_engines(monkeypatch):
    """Loading the model is most of an app test's time: the app still builds its engine through
    `engine_from_profile`, which hands out one engine per engine configuration (profiles that differ only in
    sampling share it). Errors (a missing model, a bad device) come from the real function, unchanged."""
    from ninfer_tui import launch
    from ninfer_tui.models import resolve

    real = launch.engine_from_profile

    def shared(profile, announce=True):
        try:
            config = profile.engine_config(resolve(profile.model, announce=False))
        except Exception:
            return real(profile, announce=announce)
        key = repr(dataclasses.replace(config, kernel_cache="", held_dir=""))
        if key not in _ENGINES:
            _ENGINES[key] = real(profile, announce=announce)
        return _ENGINES[key]

    monkeypatch.setattr(launch, "engine_from_profile", shared)
    monkeypatch.setattr("ninfer_tui.chat.engine_from_profile", shared)


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


def screen_lines(app) -> list[str]:
    """The characters on the terminal, row by row, as the user sees them (the active screen over the ones below)."""
    return ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]


def visible_text(app, widget) -> str:
    """What the user can read of `widget`: the terminal's characters inside its region, clipped to its dialog (the
    widget's container on a modal screen), rows joined, frames dropped and runs of spaces collapsed."""
    region = widget.region
    dialog = next((w for w in widget.ancestors_with_self if w.has_class("dialog")), None)
    if dialog is not None:
        region = region.intersection(dialog.content_region)
    rows = [line[region.x:region.right] for line in screen_lines(app)[region.y:region.bottom]]
    return " ".join(" ".join(rows).translate(FRAMES).split())


FRAMES = str.maketrans({c: " " for c in "▔▁▊▎█▀▄▌▐│─╭╮╰╯"})  # borders of buttons and boxes, not text


async def send(pilot, app, text: str) -> None:
    box = app.query_one(ChatInput)
    box.text = text
    box.focus()
    await pilot.press("enter")


async def chat_once(pilot, app, text: str) -> None:
    """Wait for the model, send one message, wait for the whole reply."""
    await wait_for(pilot, lambda: app.client is not None)
    n = len(app.messages)
    await send(pilot, app, text)
    await wait_for(pilot, lambda: not app.busy and len(app.messages) == n + 2)


def test_chat_streams_a_reply_and_saves_it(quick_profile):
    async def run():
        app = NinferApp(quick_profile, attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await chat_once(pilot, app, "Name a fruit.")
            views = app.query(MessageView)
            assert [v.role for v in views] == ["user", "assistant"] and views[1].content
            # At 80 columns the status bar shows the model's name (not its cache path), the profile, the device
            # and the speed.
            status = screen_lines(app)[-2]
            assert status.split(" | ")[:3] == [" smollm2-135m", "profile quick", "cpu"] and "tok/s" in status
            stored = app.store.messages(app.session.id)
            assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content == views[1].content
            assert not stored[1].interrupted
            assert app.store.get(app.session.id).title == "Name a fruit."
            # regenerate replaces the last reply (in its own row); edit puts the last message back into the input
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: not app.busy and len(app.messages) == 2)
            again = app.store.messages(app.session.id)
            assert [m.id for m in again] == [m.id for m in stored] and not again[1].interrupted
            await pilot.press("ctrl+e")
            assert app.query_one(ChatInput).text == "Name a fruit." and app.messages == []

    asyncio.run(run())


def test_reply_is_saved_as_it_streams_and_a_stopped_one_stays_marked():
    """What a killed app leaves is what another process reads mid-reply: the user's message and the reply so far,
    marked interrupted (never a user message alone, so never two in a row). Esc keeps what came, still marked."""
    user_profile("long", 'extends = "cpu-default"\n[sampling]\ntemperature = 0.0\nmax_tokens = 400\n')

    async def run():
        app = NinferApp("long", attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.client is not None)
            await send(pilot, app, "Write a very long story about a dragon.")
            other = SessionStore(app.store.path)  # a second connection, as the next process would open it
            await wait_for(pilot, lambda: app.session is not None and len(other.messages(app.session.id)) == 2
                           and other.messages(app.session.id)[1].content)
            assert app.busy
            user, reply = other.messages(app.session.id)
            assert (user.role, user.content) == ("user", "Write a very long story about a dragon.")
            assert reply.role == "assistant" and reply.interrupted
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.busy, timeout=20)
            assert "(stopped)" in str(app.query_one("#status").render())
            saved = other.messages(app.session.id)[-1]
            assert saved.content == app.views[-1].content and saved.interrupted
            assert "interrupted" in str(app.views[-1].query_one(".role").render())
            other.close()

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


def test_switch_profile_keeps_the_old_model_until_the_new_one_is_up(quick_profile, tmp_path, monkeypatch):
    user_profile("other", 'extends = "cpu-default"\n[sampling]\ntemperature = 0.0\nmax_tokens = 4\n')
    missing = tmp_path / "no-such-model.gguf"
    user_profile("unloadable", f'extends = "cpu-default"\nmodel = "{missing}"\n')
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_text("not a model")
    user_profile("corrupt", f'extends = "cpu-default"\nmodel = "{corrupt}"\n')
    user_profile("broken", "max_context = 'huge'\n")

    async def run():
        app = NinferApp(quick_profile, attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await chat_once(pilot, app, "Hi")
            await pilot.press("f3")
            assert isinstance(app.screen, ProfilesScreen)
            table = app.screen.query_one("#profiles")
            await wait_for(pilot, lambda: table.row_count >= 8)
            app.screen.dismiss("other")
            await wait_for(pilot, lambda: app.client is not None and app.client.profile == "other")
            assert app.profile.name == "other" and len(app.messages) == 2
            # A profile whose model cannot load: the model in use stays, and the app says why the new one failed.
            working = app.client
            app.switch_profile("unloadable")
            assert app.client is working  # kept while the new one loads
            await wait_for(pilot, lambda: "unloadable failed" in str(app.query_one("#status").render()))
            assert app.client is working and app.profile.name == "other"
            status = str(app.query_one("#status").render())
            assert status.startswith("smollm2-135m | profile other | cpu") and str(missing) in status
            note = next(n for n in app._notifications if "unloadable" in n.title)
            assert str(missing) in note.message and "hint: known models" in note.message
            assert "Still on profile other" in note.message
            await chat_once(pilot, app, "Still there?")  # and it still answers
            assert len(app.messages) == 4
            # A model that fails as it loads (a file that is not a model): the same.
            app.switch_profile("corrupt")
            await wait_for(pilot, lambda: "corrupt failed" in str(app.query_one("#status").render()))
            assert app.client is working and "neither a GGUF file" in str(app.query_one("#status").render())
            # On a GPU a second model may not fit beside the first: the one in use is freed before the new one
            # loads, and loaded again when that fails.
            monkeypatch.setattr("ninfer_tui.app.app.holds_gpu", lambda client: client is not None)
            released, release = [], app.release_backend
            monkeypatch.setattr(app, "release_backend", lambda: (released.append(app.client), release()))
            app.switch_profile("corrupt")
            await wait_for(pilot, lambda: app.client is not None and app.client is not working)
            assert released == [working] and app.client.profile == "other" and app.profile.name == "other"
            assert "corrupt failed" in str(app.query_one("#status").render())
            await chat_once(pilot, app, "And now?")
            # A profile file that does not validate never starts a load.
            app.switch_profile("broken")
            await pilot.pause()
            assert isinstance(app.screen, ErrorDialog)
            assert "broken.toml: key 'max_context'" in str(app.screen.query_one("#error-message").render())
            assert app.profile.name == "other" and app.client.profile == "other"

    asyncio.run(run())


def test_app_keys_act_from_any_focus_and_after_dialogs(quick_profile):
    """F6 and the other app keys act while the message box (a TextArea, which binds F6 itself) has focus, show in
    the footer there, act right after a dialog closes, and stay off while a dialog is open."""
    async def run():
        app = NinferApp(quick_profile, attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: "f1 Help" in screen_lines(app)[-1], timeout=20)  # the footer is drawn
            assert isinstance(app.focused, ChatInput)
            footer = screen_lines(app)[-1]
            assert all(k in footer for k in ("f1 Help", "f3 Profiles", "f4 Server", "f5 Speed", "f6 GPU clean")), footer
            await pilot.press("f6")
            assert isinstance(app.screen, GpuCleanScreen)
            await pilot.press("f1")  # app keys are off in a dialog: nothing opens over it
            assert isinstance(app.screen, GpuCleanScreen)
            # The first key after closing a dialog acts, even when typed before the dialog is gone (a terminal
            # delivers both at once): it must not be sent into the closing dialog.
            app.post_message(events.Key("escape", None))
            app.post_message(events.Key("f1", None))
            await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), timeout=5)
            text = str(app.screen.query_one("#help-text").render())
            assert "Ctrl+N" in text and "F6" in text and "stop the reply" in text
            await pilot.press("f1", "f5")  # F1 closes the help (its own key), F5 then opens the speed check
            assert isinstance(app.screen, SpeedcheckScreen)
            await pilot.pause()
            assert app.screen.focused.id == "run"  # Enter starts it
            assert not app.screen.query_one("#progress").display  # no animated bar while idle
            await pilot.click("#close")
            await pilot.press("f4")
            assert isinstance(app.screen, ServerScreen)
            await pilot.press("escape", "ctrl+f", "f6")  # from the sessions search box too
            assert isinstance(app.screen, GpuCleanScreen)
            await pilot.press("escape", "f3")
            assert isinstance(app.screen, ProfilesScreen)
            # Text typed right after closing a dialog goes to the message box, not into the dialog's own input.
            await pilot.press("escape")
            session = app.store.create()
            app.store.add(session.id, "user", "hello")
            app.open_session(session.id)
            await pilot.press("f2")
            assert isinstance(app.screen, Ask) and app.screen.focused.id == "answer"
            for key in ("escape", "h", "i"):
                app.post_message(events.Key(key, key if len(key) == 1 else None))
            await wait_for(pilot, lambda: app.query_one(ChatInput).text == "hi", timeout=5)

    asyncio.run(run())


def test_dialogs_and_sidebar_show_their_whole_text_at_80x24(quick_profile, monkeypatch):
    from engine.server import lifecycle

    server = SimpleNamespace(url="http://127.0.0.1:8123", model="smollm2-135m", profile="cpu-default", pid=1)
    monkeypatch.setattr(lifecycle, "list_servers", lambda run_dir: [server])
    monkeypatch.setattr(lifecycle, "health", lambda url, timeout=1.0: {"status": "ready"})
    store = SessionStore()
    s = store.create()
    store.add(s.id, "user", "a very long first message about lighthouses, the sea and the ships on it")

    async def run():
        app = NinferApp(quick_profile, store=store)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert isinstance(app.screen, Confirm)
            dialog = visible_text(app, app.screen.query_one(".dialog"))
            assert "running at http://127.0.0.1:8123" in dialog
            assert "Chat through it instead of loading a second copy of the model? Attach Cancel" in dialog
            await pilot.click("#no")  # load a copy here instead
            await wait_for(pilot, lambda: app.client is not None)
            title = screen_lines(app)[3][:31]
            assert title.startswith("a very long first message") and title.endswith("…")  # cut with an ellipsis
            app.open_session(s.id)
            await pilot.press("ctrl+d")
            assert isinstance(app.screen, Confirm)
            dialog = visible_text(app, app.screen.query_one(".dialog"))
            assert dialog.startswith("Delete the session 'a very long first message about lighthouses")
            assert "and all its messages? Delete Cancel" in dialog
            await pilot.press("escape", "f3")
            table = app.screen.query_one("#profiles")
            await wait_for(pilot, lambda: table.row_count >= 6)
            for row in range(table.row_count):  # every profile's fit reasons, whole, under the table
                table.move_cursor(row=row)
                await pilot.pause()
                name = table.coordinate_to_cell_key((row, 0)).row_key.value
                details = app.screen.details[name]
                assert "fit here: " in details or "invalid" in details
                shown = visible_text(app, app.screen.query_one("#profile-details"))
                assert shown.replace(" ", "") == "".join(details.split())  # all of it (long paths fold mid-word)

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
        text = "token "
        s.update(mid, text, tokens=1)
        print("ready", flush=True)  # a piece is in, however slowly a busy machine got here
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


@pytest.fixture
def vl_profile(vl_folder):
    """A profile on the tiny vision-language model (one engine for every test that uses it)."""
    user_profile("vl", f'extends = "cpu-default"\nmodel = "{vl_folder}"\nimage_max_pixels = 4096\n'
                       '[sampling]\ntemperature = 0.0\nmax_tokens = 4\n')
    return "vl"


def write_png(path: Path, colour=(200, 30, 30)) -> Path:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(buf, "PNG")
    path.write_bytes(buf.getvalue())
    return path


def chips(view: MessageView) -> list[str]:
    """A message's attachment chips as the user reads them."""
    return [str(label.render()) for label in view.query(".attachment")]


def test_an_image_attached_goes_with_the_message_and_stays_in_the_session(vl_profile, tmp_path):
    """`/image PATH` in the message box attaches an image; the next message goes with it (a chip in the view) and
    the reopened session still has it; `/image` alone drops those attached; an image the model refuses, checked
    before sending or refused when the reply starts, is not kept, nor its message, and the session goes on."""
    from engine import UserError

    picture = write_png(tmp_path / "shot.png")
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"\x89PNG not really")

    async def run():
        app = NinferApp(vl_profile, attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.client is not None)
            await send(pilot, app, f"/image {tmp_path / 'missing.png'}")
            assert app.attached == []
            await send(pilot, app, f"/image {picture}")
            assert app.attached == [Attachment("shot.png", picture.read_bytes())]
            assert app.query_one(ChatInput).text == ""
            await chat_once(pilot, app, "What colour is it?")
            assert chips(app.query(MessageView)[0]) == ["image shot.png"] and "image shot.png" in " ".join(
                screen_lines(app))
            assert app.attached == [] and app.messages[0]["images"] == [picture.read_bytes()]
            await send(pilot, app, f"/image {picture}")
            await send(pilot, app, "/image")  # drops it
            assert app.attached == []
            await send(pilot, app, f"/image {junk}")  # refused by the model when the message goes: nothing is kept
            await send(pilot, app, "And this one?")
            await pilot.pause()
            assert len(app.messages) == 2 and len(app.store.messages(app.session.id)) == 2 and app.attached == []
            assert app.query_one(ChatInput).text == "And this one?" and not app.busy
            await chat_once(pilot, app, "Fine, no picture.")  # the session goes on
            assert app.messages[-2]["content"] == "Fine, no picture." and len(app.store.messages(app.session.id)) == 4
            reply = app.client.reply

            def refused(messages, params):  # as a server refuses an image the client could not check
                raise UserError("image 1: the image has more than 16384 pixels")

            app.client.reply = refused
            read = []  # the session's messages read with their attachments' files
            app.store.messages = lambda session_id, whole=app.store.messages: read.append(session_id) or whole(
                session_id)
            await send(pilot, app, f"/image {picture}")
            await send(pilot, app, "One more?")
            await wait_for(pilot, lambda: not app.busy)
            assert read == []  # the refused turn's rows go by their ids
            del app.store.messages
            assert len(app.messages) == 4 and len(app.store.messages(app.session.id)) == 4
            assert len(app.query(MessageView)) == 4 and app.query_one(ChatInput).text == "One more?"
            app.client.reply = reply
            return app.session.id

    session_id = asyncio.run(run())

    async def reopen():
        app = NinferApp(vl_profile, attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.client is not None)
            app.open_session(session_id)
            await pilot.pause()
            assert chips(app.query(MessageView)[0]) == ["image shot.png"]
            assert app.messages[0]["images"] == [picture.read_bytes()]

    asyncio.run(reopen())


def test_the_attach_key_and_a_pasted_or_typed_path_attach_files(vl_profile, tmp_path):
    """Ctrl+O asks for a path and reads the file before closing (a path that is not there, or not an image or a
    video, is said in the dialog, which stays open); pasted text that is all an image's path (file:// or quoted, as
    terminals paste a dragged file) is offered as an attachment, and pasted as text when declined; a path typed
    alone is offered too. The message goes with them all, a chip for each."""
    shot, dragged = write_png(tmp_path / "shot one.png"), write_png(tmp_path / "dragged.png", (20, 200, 30))
    notes = tmp_path / "notes.png"
    notes.write_text("not a picture")

    async def run():
        app = NinferApp(vl_profile, attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.client is not None)
            await pilot.press("ctrl+o")
            assert isinstance(app.screen, AttachFile)
            missing = tmp_path / "missing.png"
            for path, message in ((missing, f"attach: cannot read {missing} (No such file or directory)"),
                                  (notes, f"attach: {notes} is not an image or a video")):
                app.screen.query_one("#answer").value = str(path)
                await pilot.press("enter")
                assert isinstance(app.screen, AttachFile)
                shown = visible_text(app, app.screen.query_one("#attach-error")).replace(" ", "")
                assert shown == (message + "hint: give the path of a PNG, JPEG, WebP, GIF or BMP image, or of an "
                                 "MP4/MOV, WebM/MKV or AVI video").replace(" ", "")  # all of it (paths fold)
            app.screen.query_one("#answer").value = f"'{shot}'"
            await pilot.press("enter")
            assert not isinstance(app.screen, AttachFile)
            assert app.attached == [Attachment("shot one.png", shot.read_bytes())]
            assert visible_text(app, app.query_one("#attached")).startswith("next message: image shot one.png")
            box = app.query_one(ChatInput)
            assert app.focused is box
            app.post_message(events.Paste("file://" + quote(str(dragged))))  # as the terminal sends it
            await wait_for(pilot, lambda: isinstance(app.screen, Confirm)
                           and visible_text(app, app.screen.query_one(".dialog")), timeout=5)  # and drawn
            offer = visible_text(app, app.screen.query_one(".dialog")).replace(" ", "")
            assert offer == (f"Attach the image dragged.png to your next message? {dragged} (Cancel pastes it as "
                             "text.) Attach Cancel").replace(" ", "")
            await pilot.press("y")
            assert [a.name for a in app.attached] == ["shot one.png", "dragged.png"] and box.text == ""
            app.post_message(events.Paste(str(dragged)))
            await wait_for(pilot, lambda: isinstance(app.screen, Confirm), timeout=5)
            await pilot.press("n")  # declined: it is text after all
            await wait_for(pilot, lambda: box.text == str(dragged), timeout=5)
            box.text = ""
            app.post_message(events.Paste(str(notes)))  # not an image: pasted as text at once
            await wait_for(pilot, lambda: box.text == str(notes), timeout=5)
            assert not isinstance(app.screen, Confirm)
            await send(pilot, app, str(dragged))
            await wait_for(pilot, lambda: isinstance(app.screen, Confirm), timeout=5)
            await pilot.press("y")
            assert len(app.attached) == 3 and box.text == "" and not app.messages
            await chat_once(pilot, app, "Compare them.")
            assert chips(app.views[0]) == ["image shot one.png", "image dragged.png", "image dragged.png"]
            assert app.messages[0]["images"] == [shot.read_bytes()] + [dragged.read_bytes()] * 2
            assert not app.query_one("#attached").display

    asyncio.run(run())


def test_a_video_attaches_as_a_video_chip_and_the_reopened_session_shows_the_chips(vl_profile, tmp_path):
    from engine import VIDEO_MARKER

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(make_video(4, 32, 32, 2))
    shot = write_png(tmp_path / "shot.png")

    async def run():
        app = NinferApp(vl_profile, attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.client is not None)
            await send(pilot, app, f"/image {shot}")
            await send(pilot, app, f"/video {clip}")
            assert [a.kind for a in app.attached] == ["image", "video"]
            await chat_once(pilot, app, "What happens?")
            assert chips(app.views[0]) == ["image shot.png", "video clip.mp4"]
            assert "video clip.mp4" in " ".join(screen_lines(app))
            assert app.messages[0]["content"].endswith(VIDEO_MARKER + "What happens?")
            return app.session.id

    session_id = asyncio.run(run())

    async def reopen():
        app = NinferApp(vl_profile, attach=False)
        async with app.run_test(size=(80, 24)) as pilot:
            app.open_session(session_id)
            await pilot.pause()
            assert chips(app.views[0]) == ["image shot.png", "video clip.mp4"]
            assert app.messages[0]["images"] == [shot.read_bytes(), clip.read_bytes()]

    asyncio.run(reopen())


def test_a_path_is_told_as_terminals_paste_a_dragged_file(tmp_path):
    shot = write_png(tmp_path / "my shot.png")
    escaped = str(shot).replace(" ", "\\ ")
    for text in (str(shot), f"'{shot}' ", f'"{shot}"', escaped, "file://" + quote(str(shot)),
                 "file://localhost" + quote(str(shot))):
        assert pasted_file(text) == (str(shot), "image"), text
    for text in (str(tmp_path), f"{shot}\nand more", str(tmp_path / "none.png"), "file://host" + str(shot), ""):
        assert pasted_file(text) is None, text
