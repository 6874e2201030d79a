"""Help: every key of the app (the app passes its bindings, so the list is never out of step with them)."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from .dialogs import closing_key


class HelpScreen(ModalScreen[None]):
    BINDINGS = [closing_key("escape"), closing_key("f1"), closing_key("q")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        rows = "\n".join(f"[b]{k:22s}[/b] {v}" for k, v in self.keys)
        with VerticalScroll(classes="dialog wide"):
            yield Static("[b]ninfer — keys[/b]\n\n" + rows + "\n\nEsc closes this screen.", id="help-text")
