"""The ninfer app: chat with streamed Markdown, a sessions sidebar, profile switching, and the server, speed-check,
GPU-cleanup and help screens. The model runs in a worker thread; the UI thread only draws."""
from __future__ import annotations

import argparse
import gc
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from textual import events, on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import Hit, Hits, Provider
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Collapsible, Footer, Input, Label, ListItem, ListView, Markdown, Static, TextArea

from engine.errors import NinferError

from .. import profiles
from ..attachments import Attachment, given_path, pasted_file, read_attachment, with_images, written_text
from ..chat_client import LocalClient, RemoteClient, ReplyEvent
from ..models import display_name
from ..sessions import SessionStore, StreamedReply
from .dialogs import Ask, AttachFile, Confirm, ErrorDialog
from .gpu_clean_screen import GpuCleanScreen
from .help import HelpScreen
from .profiles_screen import ProfilesScreen
from .server_screen import ServerScreen
from .speedcheck_screen import SpeedcheckScreen

DRAW_EVERY_S = 0.08  # redraw the streaming reply at most this often


# The app's keys: each acts from whatever widget of the main screen has focus (no widget there binds them: the text
# widgets below drop them from their own bindings) and shows in the footer, in this order, as far as the width
# allows; F1 lists them all (tooltips). While a dialog is open only its own keys act (and quitting).
APP_BINDINGS = [Binding(key, action, label, id=key_id, tooltip=tooltip) for key, action, label, key_id, tooltip in [
    ("f1", "help", "Help", "help", "this help"),
    ("f3", "profiles", "Profiles", "profiles", "profiles: switch, see what fits here"),
    ("f4", "server", "Server", "server", "API server"),
    ("f5", "speedcheck", "Speed", "speedcheck", "speed check"),
    ("f6", "gpu_clean", "GPU clean", "gpu-clean", "GPU cleanup"),
    ("escape", "stop", "Stop", "stop", "stop the reply being generated"),
    ("ctrl+o", "attach", "Attach", "attach", "attach an image or video file to the next message"),
    ("ctrl+n", "new_session", "New", "new", "new session"),
    ("f2", "rename", "Rename", "rename", "rename the session"),
    ("ctrl+r", "regenerate", "Regenerate", "regenerate", "regenerate the last reply"),
    ("ctrl+e", "edit_last", "Edit last", "edit", "edit the last message and send it again"),
    ("ctrl+y", "copy_last", "Copy", "copy", "copy the last reply"),
    ("ctrl+d", "delete", "Delete", "delete", "delete the session"),
    ("ctrl+f", "search", "Search", "search", "search sessions"),
]] + [Binding("ctrl+q", "quit", "Quit", id="quit", priority=True, tooltip="quit")]  # as Textual's own: everywhere
APP_KEYS = {b.key for b in APP_BINDINGS}
# Keys handled by the message box itself, listed in the help beside the bindings.
EDITOR_KEYS = [("Enter", "send the message"), ("Ctrl+J / Shift+Enter", "new line in the message"),
               ("/image, /video PATH", "attach an image or a video to the next message; alone: drop them"),
               ("a pasted file path", "an image's or video's path (a dragged file) is offered as an attachment"),
               ("Ctrl+P", "command palette (switch profile, screens)")]


def key_name(binding: Binding) -> str:
    """A key as the help writes it: F1, Esc, Ctrl+N (the footer keeps Textual's shorter f1, esc, ^n)."""
    return {"escape": "Esc"}.get(binding.key) or binding.key.replace("ctrl+", "Ctrl+").title()


def without_app_keys(widget: type) -> list[Binding]:
    """A text widget's own bindings less the app's keys, so that those reach the app while the widget has focus
    (a TextArea binds F6, Ctrl+E, Ctrl+D and Ctrl+Y itself; an Input Ctrl+D and Ctrl+E)."""
    return [b for b in Binding.make_bindings(widget.BINDINGS) if b.key not in APP_KEYS]


class SearchInput(Input, inherit_bindings=False):
    BINDINGS = without_app_keys(Input)


class ChatInput(TextArea, inherit_bindings=False):
    """Enter sends; Ctrl+J or Shift+Enter adds a new line; pasted text that is the path of an image or video file
    is offered as an attachment. The app's keys win over the editor's own."""

    BINDINGS = without_app_keys(TextArea)

    class Submit(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class FilePasted(Message):
        """Pasted text that is all a path of an image or video file (a terminal pastes a dragged file so), kept out
        of the box until the user says whether it is an attachment or text."""

        def __init__(self, text: str, path: str, kind: str) -> None:
            super().__init__()
            self.text, self.path, self.kind = text, path, kind

    async def _on_paste(self, event: events.Paste) -> None:
        found = pasted_file(event.text)
        if found is None:
            return  # TextArea's own handler, next in the MRO, inserts it
        event.prevent_default()
        event.stop()
        self.post_message(self.FilePasted(event.text, *found))

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
    def __init__(self, role: str, content: str = "", reasoning: str = "", interrupted: bool = False,
                 attachments: Sequence[Attachment] = ()) -> None:
        super().__init__(classes=f"message {role}")
        self.role, self.content, self.reasoning, self.interrupted = role, content, reasoning, interrupted
        self.attachments = list(attachments)

    def compose(self) -> ComposeResult:
        yield Label(self.role_text(), classes="role")
        if self.attachments:  # a chip for each image and video that goes to the model with the message
            with Horizontal(classes="attachments"):
                for attachment in self.attachments:
                    yield Label(attachment.chip, classes="attachment", markup=False)
        with Collapsible(title="thinking", collapsed=True, classes="thinking") as c:
            c.display = bool(self.reasoning)
            yield Static(self.reasoning, classes="reasoning", markup=False)
        yield Markdown(self.content, classes="content")

    def role_text(self) -> str:
        return "you" if self.role == "user" else "assistant" + (" (interrupted)" if self.interrupted else "")

    def show(self, content: str, reasoning: str) -> None:
        self.content, self.reasoning = content, reasoning
        self.query_one(".content", Markdown).update(content)
        if reasoning:
            self.query_one(Collapsible).display = True
            self.query_one(".reasoning", Static).update(reasoning)

    def mark_interrupted(self, interrupted: bool) -> None:
        self.interrupted = interrupted
        self.query_one(".role", Label).update(self.role_text())


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
    BINDINGS = APP_BINDINGS

    def __init__(self, profile_name: str | None = None, store: SessionStore | None = None,
                 attach: bool = True) -> None:
        super().__init__()
        self.store = store or SessionStore()
        self.profile_name = profile_name
        self.profile = None  # the profile of the model chatted with (the one loading, before any is up)
        self.attach_to_servers = attach
        self.client = None
        self.model_label = ""
        self.session = None
        self.messages: list[dict] = []
        self.attached: list[Attachment] = []  # images and videos for the next message (Ctrl+O, /image, /video)
        self.views: list[MessageView] = []
        self.reply = None
        self.stop_requested = threading.Event()
        self.busy = False
        self.stats = ""
        self.note = ""  # a load in progress or a failed switch, after the model's own status
        self.load_seq = 0  # the newest load; an older one that ends later is dropped

    # ---- layout ----
    def compose(self) -> ComposeResult:
        with Horizontal():
            with Vertical(id="sidebar"):
                yield SearchInput(placeholder="search sessions", id="search")
                yield ListView(id="sessions")
            with Vertical(id="main"):
                yield VerticalScroll(id="conversation")
                yield Static(id="attached", markup=False)  # what goes with the next message (hidden when none)
                yield ChatInput(id="input", soft_wrap=True, show_line_numbers=False)
        yield Static("starting…", id="status", markup=False)
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

    def on_unmount(self) -> None:
        self.action_stop()  # a reply being written ends now, saved as interrupted

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
                self.model_label = display_name(s.model)
                self.update_status()
            else:
                self.load_backend()

        self.push_screen(Confirm(f"A ninfer server is running at {s.url} (profile {s.profile}, model "
                                 f"{display_name(s.model)}). Chat through it instead of loading a second copy of "
                                 "the model?", "Attach"), chosen)

    def load_backend(self, profile=None) -> None:
        """Load `profile` (default: the current one). The model chatted with so far stays until the new one is up;
        a failure leaves it in place and says why."""
        profile = profile or self.profile
        self.load_seq += 1
        self.note = f"loading {display_name(profile.model)} (profile {profile.name})…"
        self.update_status()
        self._load(profile, self.load_seq)

    @work(thread=True, exclusive=True, group="load")
    def _load(self, profile, seq: int) -> None:
        from ..launch import check_device, engine_from_profile
        from ..models import resolve

        previous_profile = self.profile
        free_first = holds_gpu(self.client)
        released = False
        try:
            check_device(profile)
            resolve(profile.model, announce=False)  # a missing model fails here, with the current one untouched
            if free_first:  # reloaded below should the new one fail
                self.call_from_thread(self.release_backend)
                released = True
            client = LocalClient(engine_from_profile(profile, announce=False), profile.name)
        except Exception as exc:  # shown in the app with what to do, never as a traceback
            if not isinstance(exc, NinferError):
                exc = NinferError(f"{type(exc).__name__}: {exc}", "set NINFER_DEBUG=1 and run `ninfer chat`")
            restored = None
            if released:
                try:
                    restored = LocalClient(engine_from_profile(previous_profile, announce=False),
                                           previous_profile.name)
                except Exception:  # the failure reported is the new profile's; the status says none is loaded
                    restored = None
            self.call_from_thread(self.load_failed, profile, exc, seq, restored, previous_profile)
            return
        self.call_from_thread(self.loaded, profile, client, seq)

    def loaded(self, profile, client, seq: int) -> None:
        if seq != self.load_seq:
            return
        self.profile, self.client, self.note = profile, client, ""
        self.model_label = display_name(profile.model)
        self.update_status()

    def load_failed(self, profile, exc: NinferError, seq: int, restored, previous_profile) -> None:
        if seq != self.load_seq:
            return
        if restored is not None:
            self.loaded(previous_profile, restored, seq)
        if self.client is None:
            self.note = ""
            self.push_screen(ErrorDialog(f"profile {profile.name}: {exc}", exc.hint))
            self.query_one("#status", Static).update(f"no model loaded (profile {profile.name} failed); F3 picks "
                                                     "another profile")
            return
        self.note = f"profile {profile.name} failed: {exc}"
        self.notify(f"{exc}" + (f"\nhint: {exc.hint}" if exc.hint else "") + f"\nStill on profile "
                    f"{self.client.profile}.", title=f"profile {profile.name} not loaded", severity="error",
                    timeout=20, markup=False)
        self.update_status()

    def release_backend(self) -> None:
        self.client = None
        free_memory()
        self.query_one("#status", Static).update(self.note or "model unloaded")

    def status_text(self) -> str:
        """What the status bar says, most important first: an 80-column terminal cuts the end."""
        engine = getattr(self.client, "engine", None)
        if engine is None:
            where = f"via {self.client.url}"
        elif engine.device.type == "cuda":
            import torch

            where = f"{engine.device} {torch.cuda.memory_allocated(engine.device) / 2**30:.1f} GiB"
        else:
            where = engine.device.type
        parts = [self.model_label, f"profile {self.client.profile}", where, self.stats, self.note]
        return " | ".join(p for p in parts if p)

    def update_status(self) -> None:
        if self.client is not None:
            self.query_one("#status", Static).update(self.status_text())
        elif self.note:
            self.query_one("#status", Static).update(self.note)

    # ---- sessions ----
    def refresh_sessions(self, search: str | None = None) -> None:
        if search is None:
            search = self.query_one("#search", Input).value
        lv = self.query_one("#sessions", ListView)
        lv.clear()
        for s in self.store.list(search):
            item = ListItem(Label(s.title, markup=False, classes="title"))
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
            self.add_view(m.role, m.content, m.reasoning, m.interrupted, m.attachments)
        self.query_one(ChatInput).focus()

    def clear_conversation(self) -> None:
        self.query_one("#conversation").remove_children()
        self.views = []

    def add_view(self, role: str, content: str = "", reasoning: str = "", interrupted: bool = False,
                 attachments: Sequence[Attachment] = ()) -> MessageView:
        view = MessageView(role, content, reasoning, interrupted, attachments)
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
        command, _, path = text.partition(" ")
        if command in ("/image", "/video"):
            if not path.strip():
                self.drop_attached()
            elif self.attach_file(path, command):
                self.query_one(ChatInput).clear()
            return
        if (found := pasted_file(text)) is not None:  # a path typed alone, or pasted and sent
            self.offer(*found, "sends it as text", partial(self.send, text), self.query_one(ChatInput).clear)
            return
        self.send(text)

    def send(self, text: str) -> None:
        if self.busy:
            self.notify("a reply is still being written (Esc stops it)", severity="warning")
            return
        if self.client is None:
            self.notify("the model is not loaded yet", severity="warning")
            return
        attached, self.attached = self.attached, []
        self.show_attached()
        images = [a.data for a in attached]
        try:  # an image the model refuses is never kept: every later turn would resend it and fail
            self.client.check_images(self.messages, images)
        except NinferError as exc:
            self.notify(str(exc) + (f"\nhint: {exc.hint}" if exc.hint else "") + "\n(the images are dropped; the "
                        "message is still in the box)", title="not sent", severity="error", timeout=15, markup=False)
            return
        self.query_one(ChatInput).clear()
        if self.session is None:
            self.session = self.store.create(model=self.profile.model, profile=self.client.profile)
        # The message and its reply's row in one transaction (the reply marked interrupted until it finishes): a
        # process killed at any point leaves the session whole, never two user turns in a row.
        _, reply_id = self.store.add_turn(self.session.id, text, images, [a.name for a in attached])
        self.messages.append(with_images(text, images))
        self.add_view("user", text, attachments=attached)
        self.refresh_sessions()
        self.generate(reply_id, new_turn=True)

    # ---- attachments ----
    def read_attachment(self, path: str, where: str) -> Attachment:
        """The file at `path` (typed, quoted, a file:// URL) within the profile's bounds on an image or a video;
        the model checks the rest when the message goes."""
        limits = self.profile or profiles.Profile  # the defaults while none has loaded
        return read_attachment(given_path(path), where, limits.image_max_mib, limits.video_max_mib)

    def attach_file(self, path: str, where: str) -> bool:
        """Attach the file at `path` to the next message; False when it cannot be (a notification says why, naming
        `where`, the command or key that gave the path)."""
        try:
            self.add_attachment(self.read_attachment(path, where))
        except NinferError as exc:
            self.notify(str(exc) + (f"\nhint: {exc.hint}" if exc.hint else ""), title="nothing attached",
                        severity="error", markup=False)
            return False
        return True

    def add_attachment(self, attachment: Attachment | None) -> None:
        if attachment is None:  # the attach dialog cancelled
            return
        self.attached.append(attachment)
        self.show_attached()
        self.notify(f"{attachment.chip} attached: it goes with your next message (/image alone drops the "
                    "attachments)", markup=False)

    def drop_attached(self) -> None:
        self.query_one(ChatInput).clear()
        n, self.attached = len(self.attached), []
        self.show_attached()
        self.notify(f"{n} attachment{'s' * (n != 1)} dropped", markup=False)

    def show_attached(self) -> None:
        """The files waiting for the next message, over the message box (hidden when none)."""
        line = self.query_one("#attached", Static)
        line.update("next message: " + ", ".join(a.chip for a in self.attached) + " (/image alone drops them)")
        line.display = bool(self.attached)

    def action_attach(self) -> None:
        self.push_screen(AttachFile(partial(self.read_attachment, where="attach")), self.add_attachment)

    def offer(self, path: str, kind: str, declined: str, decline: Callable[[], object],
              accepted: Callable[[], object] = lambda: None) -> None:
        """Ask whether the image or video at `path`, pasted or typed, goes with the next message (then `accepted`)
        or is text after all (`decline`, which the dialog says it `declined`)."""
        def chosen(yes: bool | None) -> None:
            if not yes:
                decline()
            elif self.attach_file(path, "attach"):
                accepted()

        self.push_screen(Confirm(f"Attach the {kind} {Path(path).name} to your next message?\n{path}\n(Cancel "
                                 f"{declined}.)", "Attach"), chosen)

    @on(ChatInput.FilePasted)
    def file_pasted(self, event: ChatInput.FilePasted) -> None:
        self.offer(event.path, event.kind, "pastes it as text", partial(self.query_one(ChatInput).insert, event.text))

    def generate(self, reply_id: int, new_turn: bool = False) -> None:
        view = self.add_view("assistant")
        self.busy = True
        self.stop_requested.clear()
        self._generate(list(self.messages), view, reply_id, new_turn)

    @work(thread=True, exclusive=True, group="generate")
    def _generate(self, messages: list[dict], view: MessageView, reply_id: int, new_turn: bool) -> None:
        """Stream one reply into `view` (redrawn every DRAW_EVERY_S) and into its stored row (StreamedReply saves
        it as it comes, marked interrupted until it finishes). A `new_turn` the model refuses before its reply
        begins is not kept (`_unsend`)."""
        from ..launch import sampling_from_args

        params = sampling_from_args(argparse.Namespace(), self.profile)
        streamed, error, last_draw = StreamedReply(self.store, reply_id), None, 0.0

        def draw(ev: ReplyEvent) -> None:
            nonlocal last_draw
            now = time.monotonic()
            if now - last_draw > DRAW_EVERY_S:
                last_draw = now
                self.call_from_thread(self._draw, view, streamed.text, streamed.reasoning, streamed.tokens,
                                      streamed.tok_s)

        began = False
        try:
            self.reply = self.client.reply(messages, params)
            began = True
            if self.stop_requested.is_set():  # Esc came while the request was being sent
                self.reply.cancel()
            streamed.follow(self.reply, draw)
        except Exception as exc:  # shown in the reply's place, never as a traceback
            error = exc
        finally:
            self.reply = None
            if error is not None and new_turn and not began:
                self.call_from_thread(self._unsend, error)
            else:
                self.call_from_thread(self._finished, view, streamed, error)

    def _draw(self, view: MessageView, text: str, reasoning: str, tokens: int, tok_s: float) -> None:
        view.show(text, reasoning)
        self.stats = f"{tok_s:.1f} tok/s, {tokens} tokens"
        self.update_status()
        self.query_one("#conversation", VerticalScroll).scroll_end(animate=False)

    def _unsend(self, error: Exception) -> None:
        """A new turn refused before its reply began (a bad image, too long a prompt): as the line chat does,
        neither it nor its reply row is kept, nor the session it opened; its text goes back to the box."""
        self.busy = False
        ids = self.store.message_ids(self.session.id)
        self.store.delete_message(ids[-1])  # the reply's row
        self.views.pop().remove()
        box = self.query_one(ChatInput)
        box.text = written_text(self._drop_last())
        box.focus()
        if len(ids) == 2:  # the turn was the session's first
            self.store.delete(self.session.id)
            self.session = None
        self.refresh_sessions()
        hint = getattr(error, "hint", None)
        self.notify(str(error) + (f"\nhint: {hint}" if hint else "") + "\n(not sent: the message is back in the box)",
                    title="the reply failed", severity="error", timeout=15, markup=False)
        self.update_status()

    def _finished(self, view: MessageView, streamed: StreamedReply, error: Exception | None) -> None:
        text, reasoning, final = streamed.text, streamed.reasoning, streamed.final
        self._draw(view, text, reasoning, streamed.tokens, streamed.tok_s)
        self.busy = False
        self.messages.append({"role": "assistant", "content": text})
        view.mark_interrupted(streamed.interrupted)
        if error is not None:
            view.show(text + f"\n\n*(error: {error})*", reasoning)
            hint = getattr(error, "hint", None)
            self.notify(str(error) + (f"\nhint: {hint}" if hint else ""), title="the reply failed",
                        severity="error", timeout=15, markup=False)
        if final is not None:
            cached = f" ({final.cached_tokens} cached)" if final.cached_tokens else ""
            stopped = " (stopped)" if final.finish_reason == "cancelled" else ""
            self.stats = (f"{final.tok_s:.1f} tok/s, {final.completion_tokens} tokens, "
                          f"prompt {final.prompt_tokens}{cached}{stopped}")
        self.update_status()

    def action_stop(self) -> None:
        self.stop_requested.set()
        if self.reply is not None:
            self.reply.cancel()

    def action_regenerate(self) -> None:
        if self.busy or not self.messages or self.messages[-1]["role"] != "assistant":
            return
        # The new reply streams into the old one's row: the session never ends in a user message meanwhile.
        reply_id = self.store.message_ids(self.session.id)[-1]
        self.views.pop().remove()
        self.messages.pop()
        self.store.update(reply_id, "", interrupted=True)
        self.generate(reply_id)

    def _drop_last(self) -> dict:
        stored = self.store.message_ids(self.session.id)
        if stored:
            self.store.delete_message(stored[-1])
        self.views.pop().remove()
        return self.messages.pop()

    def action_edit_last(self) -> None:
        if self.busy or not self.messages:
            return
        if self.messages[-1]["role"] == "assistant":
            self._drop_last()
        if self.messages and self.messages[-1]["role"] == "user":
            self.attached = list(self.views[-1].attachments)  # attached again, to go with the edited text
            self.show_attached()
            text = written_text(self._drop_last())
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
        self.push_screen(HelpScreen(EDITOR_KEYS + [(key_name(b), b.tooltip) for b in APP_BINDINGS]))

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
        self.load_backend(profile)  # the conversation stays; the next message goes to the new model once it is up

    def action_server(self) -> None:
        self.push_screen(ServerScreen(self.profile.name))

    def action_speedcheck(self) -> None:
        self.push_screen(SpeedcheckScreen(self.profile))

    def action_gpu_clean(self) -> None:
        self.push_screen(GpuCleanScreen())


def holds_gpu(client) -> bool:
    """Whether the client's model is on a GPU, where a second model may not fit beside it (so a switch frees it
    first); on the CPU the old model keeps answering until the new one is up."""
    return isinstance(client, LocalClient) and client.engine.device.type == "cuda"


def free_memory() -> None:
    """Give an unloaded model's memory back (its GPU blocks too, for the next model to use)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_app(profile: str | None = None) -> int:
    NinferApp(profile).run()
    return 0
