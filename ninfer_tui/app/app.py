"""The ninfer app: chat with streamed Markdown, a sessions sidebar, profile switching, and the server, speed-check,
GPU-cleanup and help screens. The model runs in a worker thread; the UI thread only draws."""
from __future__ import annotations

import argparse
import gc
import time
from functools import partial

from textual import events, on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import Hit, Hits, Provider
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Collapsible, Footer, Input, Label, ListItem, ListView, Markdown, Static, TextArea

from engine.errors import NinferError

from .. import profiles
from ..chat_client import LocalClient, RemoteClient
from ..sessions import SessionStore
from .dialogs import Ask, Confirm, ErrorDialog
from .gpu_clean_screen import GpuCleanScreen
from .help import HelpScreen
from .profiles_screen import ProfilesScreen
from .server_screen import ServerScreen
from .speedcheck_screen import SpeedcheckScreen

DRAW_EVERY_S = 0.08  # redraw the streaming reply at most this often
SAVE_EVERY_S = 0.5  # and save it to the session store this often


class ChatInput(TextArea):
    """Enter sends; Ctrl+J or Shift+Enter adds a new line. The app's Ctrl keys win over the editor's own."""

    BINDINGS = [
        Binding("ctrl+e", "app.edit_last", "Edit last", show=False),
        Binding("ctrl+y", "app.copy_last", "Copy", show=False),
        Binding("ctrl+d", "app.delete", "Delete", show=False),
        Binding("ctrl+f", "app.search", "Search", show=False),
        Binding("ctrl+r", "app.regenerate", "Regenerate", show=False),
        Binding("ctrl+n", "app.new_session", "New", show=False),
        Binding("escape", "app.stop", "Stop", show=False),
    ]

    class Submit(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.prevent_default()
            event.stop()
            self.post_message(self.Submit(self.text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.prevent_default()
            event.stop()
            self.insert("\n")
            return
        await super()._on_key(event)


class MessageView(Vertical):
    def __init__(self, role: str, content: str = "", reasoning: str = "") -> None:
        super().__init__(classes=f"message {role}")
        self.role, self.content, self.reasoning = role, content, reasoning

    def compose(self) -> ComposeResult:
        yield Label("you" if self.role == "user" else "assistant", classes="role")
        with Collapsible(title="thinking", collapsed=True, classes="thinking") as c:
            c.display = bool(self.reasoning)
            yield Static(self.reasoning, classes="reasoning")
        yield Markdown(self.content, classes="content")

    def show(self, content: str, reasoning: str) -> None:
        self.content, self.reasoning = content, reasoning
        self.query_one(".content", Markdown).update(content)
        if reasoning:
            self.query_one(Collapsible).display = True
            self.query_one(".reasoning", Static).update(reasoning)


class ProfileCommands(Provider):
    async def search(self, query: str) -> Hits:
        app = self.app
        matcher = self.matcher(query)
        entries = [(f"Profile: switch to {name}", partial(app.switch_profile, name))
                   for name in sorted({*profiles.builtin_files(), *profiles.user_files()})]
        entries += [("Screen: profiles", app.action_profiles), ("Screen: API server", app.action_server),
                    ("Screen: speed check", app.action_speedcheck), ("Screen: GPU cleanup", app.action_gpu_clean),
                    ("Session: new", app.action_new_session), ("Help", app.action_help)]
        for text, callback in entries:
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), callback)


class NinferApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "ninfer"
    COMMANDS = App.COMMANDS | {ProfileCommands}
    BINDINGS = [
        Binding("escape", "stop", "Stop", id="stop"),
        Binding("ctrl+n", "new_session", "New", id="new"),
        Binding("f2", "rename", "Rename", id="rename"),
        Binding("ctrl+d", "delete", "Delete", id="delete"),
        Binding("ctrl+f", "search", "Search", id="search"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="regenerate"),
        Binding("ctrl+e", "edit_last", "Edit last", id="edit"),
        Binding("ctrl+y", "copy_last", "Copy", id="copy"),
        Binding("f3", "profiles", "Profiles", id="profiles"),
        Binding("f4", "server", "Server", id="server"),
        Binding("f5", "speedcheck", "Speed", id="speedcheck"),
        Binding("f6", "gpu_clean", "GPU clean", id="gpu-clean"),
        Binding("f1", "help", "Help", id="help"),
        Binding("ctrl+q", "quit", "Quit", id="quit"),
    ]

    def __init__(self, profile_name: str | None = None, store: SessionStore | None = None,
                 attach: bool = True) -> None:
        super().__init__()
        self.store = store or SessionStore()
        self.profile_name = profile_name
        self.profile = None
        self.attach_to_servers = attach
        self.client = None
        self.session = None
        self.messages: list[dict] = []
        self.views: list[MessageView] = []
        self.reply = None
        self.busy = False
        self.stats = ""

    # ---- layout ----
    def compose(self) -> ComposeResult:
        with Horizontal():
            with Vertical(id="sidebar"):
                yield Input(placeholder="search sessions", id="search")
                yield ListView(id="sessions")
            with Vertical(id="main"):
                yield VerticalScroll(id="conversation")
                yield ChatInput(id="input", soft_wrap=True, show_line_numbers=False)
        yield Static("starting…", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_sessions()
        self.query_one(ChatInput).focus()
        try:
            self.profile = profiles.select(self.profile_name, announce=lambda m: self.notify(m, timeout=8))
        except NinferError as exc:
            self.push_screen(ErrorDialog(str(exc), exc.hint))
            self.profile = profiles.load(profiles.FIRST_RUN_CPU)
        self.start_backend()

    def start_backend(self) -> None:
        from engine.server.lifecycle import health, list_servers

        from ..serve_cmd import run_dir

        ready = [s for s in list_servers(run_dir()) if (health(s.url, 0.5) or {}).get("status") == "ready"] \
            if self.attach_to_servers else []
        if not ready:
            self.load_backend()
            return
        s = ready[0]

        def chosen(yes: bool | None) -> None:
            if yes:
                import os

                self.client = RemoteClient(s.url, s.model, s.profile, os.environ.get("NINFER_API_KEY"))
                self.update_status()
            else:
                self.load_backend()

        self.push_screen(Confirm(f"A ninfer server is running at {s.url} (profile {s.profile}, model {s.model}). "
                                 "Chat through it instead of loading a second copy of the model?", "Attach"), chosen)

    def load_backend(self) -> None:
        self.query_one("#status", Static).update(f"loading {self.profile.model} (profile {self.profile.name})…")
        self._load(self.profile)

    @work(thread=True, exclusive=True, group="load")
    def _load(self, profile) -> None:
        from ..launch import engine_from_profile

        try:
            client = LocalClient(engine_from_profile(profile, announce=False), profile.name)
        except NinferError as exc:
            self.call_from_thread(self.load_failed, profile, exc)
            return
        except Exception as exc:  # shown in the app with what to do, never as a traceback
            self.call_from_thread(self.load_failed, profile, NinferError(f"{type(exc).__name__}: {exc}",
                                                                        "set NINFER_DEBUG=1 and run `ninfer chat`"))
            return
        self.call_from_thread(self.loaded, client)

    def loaded(self, client) -> None:
        self.client = client
        self.update_status()

    def load_failed(self, profile, exc: NinferError) -> None:
        self.push_screen(ErrorDialog(f"profile {profile.name}: {exc}", exc.hint))
        self.query_one("#status", Static).update(f"no model loaded (profile {profile.name} failed); F3 picks "
                                                 "another profile")

    def release_backend(self) -> None:
        self.client = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
        self.query_one("#status", Static).update("model unloaded")

    def engine_max_context(self) -> int | None:
        engine = getattr(self.client, "engine", None)
        return None if engine is None else engine.max_context

    def update_status(self) -> None:
        if self.client is None:
            return
        gpu = "-"
        engine = getattr(self.client, "engine", None)
        if engine is not None and engine.device.type == "cuda":
            import torch

            gpu = f"{torch.cuda.memory_allocated(engine.device) / 2**30:.1f} GiB"
        self.query_one("#status", Static).update(
            f"{self.client.label} | profile {self.client.profile} | GPU mem {gpu}" + (f" | {self.stats}"
                                                                                      if self.stats else ""))

    # ---- sessions ----
    def refresh_sessions(self, search: str | None = None) -> None:
        if search is None:
            search = self.query_one("#search", Input).value
        lv = self.query_one("#sessions", ListView)
        lv.clear()
        for s in self.store.list(search):
            item = ListItem(Label(s.title))
            item.session_id = s.id
            lv.append(item)

    @on(Input.Changed, "#search")
    def search_changed(self, event: Input.Changed) -> None:
        self.refresh_sessions(event.value)

    @on(ListView.Selected, "#sessions")
    def session_selected(self, event: ListView.Selected) -> None:
        self.open_session(event.item.session_id)

    def open_session(self, session_id: int) -> None:
        if self.busy:
            self.notify("stop the reply first (Esc)", severity="warning")
            return
        self.session = self.store.get(session_id)
        stored = self.store.messages(session_id)
        self.messages = [m.as_chat() for m in stored]
        self.clear_conversation()
        for m in stored:
            self.add_view(m.role, m.content, m.reasoning)
        self.query_one(ChatInput).focus()

    def clear_conversation(self) -> None:
        self.query_one("#conversation").remove_children()
        self.views = []

    def add_view(self, role: str, content: str = "", reasoning: str = "") -> MessageView:
        view = MessageView(role, content, reasoning)
        self.views.append(view)
        conv = self.query_one("#conversation", VerticalScroll)
        conv.mount(view)
        conv.scroll_end(animate=False)
        return view

    def action_new_session(self) -> None:
        if self.busy:
            self.action_stop()
        self.session, self.messages = None, []
        self.clear_conversation()
        self.query_one(ChatInput).focus()

    def action_rename(self) -> None:
        if self.session is None:
            self.notify("no session yet: send a message first")
            return
        sid = self.session.id

        def done(title: str | None) -> None:
            if title:
                self.store.rename(sid, title)
                self.refresh_sessions()

        self.push_screen(Ask("New title:", self.session.title), done)

    def action_delete(self) -> None:
        if self.session is None:
            return
        sid, title = self.session.id, self.session.title

        def done(yes: bool | None) -> None:
            if yes:
                self.store.delete(sid)
                self.action_new_session()
                self.refresh_sessions()

        self.push_screen(Confirm(f"Delete the session {title!r} and all its messages?", "Delete"), done)

    def action_search(self) -> None:
        self.query_one("#search", Input).focus()

    # ---- chatting ----
    @on(ChatInput.Submit)
    def submitted(self, event: ChatInput.Submit) -> None:
        text = event.text.strip()
        if not text:
            return
        if self.busy:
            self.notify("a reply is still being written (Esc stops it)", severity="warning")
            return
        if self.client is None:
            self.notify("the model is not loaded yet", severity="warning")
            return
        self.query_one(ChatInput).clear()
        if self.session is None:
            self.session = self.store.create(model=self.profile.model, profile=self.client.profile)
        self.store.add(self.session.id, "user", text)
        self.messages.append({"role": "user", "content": text})
        self.add_view("user", text)
        self.refresh_sessions()
        self.generate()

    def generate(self) -> None:
        view = self.add_view("assistant")
        message_id = self.store.add(self.session.id, "assistant", "")
        self.busy = True
        self._generate(list(self.messages), view, message_id)

    @work(thread=True, exclusive=True, group="generate")
    def _generate(self, messages: list[dict], view: MessageView, message_id: int) -> None:
        from ..launch import sampling_from_args

        params = sampling_from_args(argparse.Namespace(), self.profile)
        text, reasoning, last_draw, last_save, tokens, tok_s = "", "", 0.0, time.monotonic(), 0, 0.0
        final = None
        try:
            self.reply = self.client.reply(messages, params)
            for ev in self.reply:
                if ev.kind == "text":
                    text += ev.text
                elif ev.kind == "reasoning":
                    reasoning += ev.text
                else:
                    final = ev
                tokens, tok_s = ev.completion_tokens or tokens, ev.tok_s or tok_s
                now = time.monotonic()
                if now - last_draw > DRAW_EVERY_S:
                    last_draw = now
                    self.call_from_thread(self._draw, view, text, reasoning, tokens, tok_s)
                if now - last_save > SAVE_EVERY_S:
                    last_save = now
                    self.store.update(message_id, text, reasoning, tokens)
        except Exception as exc:
            text += f"\n\n*(error: {exc})*"
        finally:
            self.reply = None
            self.store.update(message_id, text, reasoning, tokens)
            self.call_from_thread(self._finished, view, text, reasoning, tokens, tok_s, final)

    def _draw(self, view: MessageView, text: str, reasoning: str, tokens: int, tok_s: float) -> None:
        view.show(text, reasoning)
        self.stats = f"{tokens} tokens, {tok_s:.1f} tok/s"
        self.update_status()
        self.query_one("#conversation", VerticalScroll).scroll_end(animate=False)

    def _finished(self, view, text, reasoning, tokens, tok_s, final) -> None:
        self._draw(view, text, reasoning, tokens, tok_s)
        self.busy = False
        self.messages.append({"role": "assistant", "content": text})
        if final is not None:
            cached = f", {final.cached_tokens} cached" if final.cached_tokens else ""
            stopped = " (stopped)" if final.finish_reason == "cancelled" else ""
            self.stats = (f"prompt {final.prompt_tokens}{cached}, {final.completion_tokens} tokens, "
                          f"{final.tok_s:.1f} tok/s{stopped}")
        self.update_status()

    def action_stop(self) -> None:
        if self.reply is not None:
            self.reply.cancel()

    def action_regenerate(self) -> None:
        if self.busy or not self.messages or self.messages[-1]["role"] != "assistant":
            return
        self._drop_last()
        self.generate()

    def _drop_last(self) -> dict:
        stored = self.store.messages(self.session.id)
        if stored:
            self.store.delete_message(stored[-1].id)
        self.views.pop().remove()
        return self.messages.pop()

    def action_edit_last(self) -> None:
        if self.busy or not self.messages:
            return
        if self.messages[-1]["role"] == "assistant":
            self._drop_last()
        if self.messages and self.messages[-1]["role"] == "user":
            text = self._drop_last()["content"]
            box = self.query_one(ChatInput)
            box.text = text
            box.focus()

    def action_copy_last(self) -> None:
        last = next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), None)
        if last:
            self.copy_to_clipboard(last)
            self.notify("copied the last reply")

    # ---- screens ----
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_profiles(self) -> None:
        self.push_screen(ProfilesScreen(self.profile.name), lambda name: name and self.switch_profile(name))

    def switch_profile(self, name: str) -> None:
        try:
            profile = profiles.load(name)
            profile.engine_config(profile.model)
        except NinferError as exc:
            self.push_screen(ErrorDialog(str(exc), exc.hint))
            return
        if self.busy:
            self.action_stop()
        self.profile = profile
        self.release_backend()
        self.load_backend()  # the conversation stays; the next message goes to the new model

    def action_server(self) -> None:
        self.push_screen(ServerScreen(self.profile.name))

    def action_speedcheck(self) -> None:
        self.push_screen(SpeedcheckScreen(self.profile))

    def action_gpu_clean(self) -> None:
        self.push_screen(GpuCleanScreen())


def run_app(profile: str | None = None) -> int:
    NinferApp(profile).run()
    return 0
