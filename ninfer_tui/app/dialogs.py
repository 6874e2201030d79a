"""Small modal dialogs: confirm, ask for text, ask for a file to attach, show an error with its fix. Their text
wraps to the dialog's width (never cut at 80 columns) and is shown as written (a title with [brackets] is not
markup)."""
from __future__ import annotations

from collections.abc import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from engine.errors import NinferError

from ..attachments import Attachment


def closing_key(key: str, action: str = "dismiss", description: str = "Close") -> Binding:
    """A key that closes a dialog. It acts as soon as it is read (a priority binding), before the next key is
    dispatched: otherwise a key typed right after it would be sent into the closing dialog and lost with it."""
    return Binding(key, action, description, priority=True)


class Confirm(ModalScreen[bool]):
    BINDINGS = [closing_key("escape", "dismiss(False)", "Cancel"), closing_key("y", "dismiss(True)", "Yes"),
                closing_key("n", "dismiss(False)", "No")]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, id="question", markup=False)
            with Horizontal(classes="buttons"):
                yield Button(self.yes, id="yes", variant="primary")
                yield Button("Cancel", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class Ask(ModalScreen[str | None]):
    BINDINGS = [closing_key("escape", "dismiss(None)", "Cancel")]

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__()
        self.question, self.value = question, value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, id="question", markup=False)
            yield Input(self.value, id="answer")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)


class AttachFile(ModalScreen[Attachment | None]):
    """A file's path asked for and the file read (by `read`) before the dialog closes with it: one that cannot be
    attached (none there, neither an image nor a video, too large) is said in the dialog, which stays open for
    another path."""

    BINDINGS = [closing_key("escape", "dismiss(None)", "Cancel")]

    def __init__(self, read: Callable[[str], Attachment]) -> None:
        super().__init__()
        self.read = read

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("Attach an image or a video to your next message: its file's path (Esc cancels)",
                         id="question", markup=False)
            yield Input(placeholder="~/Pictures/screenshot.png", id="answer")
            yield Static(id="attach-error", markup=False)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if not event.value.strip():
            self.dismiss(None)
            return
        try:
            attachment = self.read(event.value)
        except NinferError as exc:
            error = self.query_one("#attach-error", Static)
            error.update(str(exc) + (f"\nhint: {exc.hint}" if exc.hint else ""))
            error.display = True
            return
        self.dismiss(attachment)


class ErrorDialog(ModalScreen[None]):
    BINDINGS = [closing_key("escape"), closing_key("enter")]

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__()
        self.message, self.hint = message, hint

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog error"):
            yield Label("[b]error[/b]")
            yield Static(self.message, id="error-message", markup=False)
            if self.hint:
                yield Static(f"hint: {self.hint}", id="error-hint", markup=False)
            yield Button("Close", id="close")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss()
