"""Help: every key binding of the app."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = [
    ("Enter", "send the message"), ("Ctrl+J / Shift+Enter", "new line in the message"),
    ("Esc", "stop the reply being generated"), ("Ctrl+R", "regenerate the last reply"),
    ("Ctrl+E", "edit the last message and send it again"), ("Ctrl+Y", "copy the last reply"),
    ("Ctrl+N", "new session"), ("F2", "rename the session"), ("Ctrl+D", "delete the session"),
    ("Ctrl+F", "search sessions"), ("Ctrl+P", "command palette (switch profile, screens)"),
    ("F3", "profiles"), ("F4", "API server"), ("F5", "speed check"), ("F6", "GPU cleanup"), ("F1", "this help"),
    ("Ctrl+Q", "quit"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape", "dismiss", "Close"), ("f1", "dismiss", "Close"), ("q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        rows = "\n".join(f"[b]{k:22s}[/b] {v}" for k, v in KEYS)
        with VerticalScroll(classes="dialog wide"):
            yield Static("[b]ninfer — keys[/b]\n\n" + rows + "\n\nEsc closes this screen.", id="help-text")
