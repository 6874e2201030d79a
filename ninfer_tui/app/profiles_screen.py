"""Profiles: built-in and user profiles with their key settings and the memory-fit verdict for this machine."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from engine.errors import NinferError

from .. import profiles
from ..profiles_cmd import fit_report


def fit_text(profile) -> str:
    try:
        r = fit_report(profile, None)
    except NinferError as exc:
        return "n/a: " + str(exc).split(":")[0]
    verdict = "fits" if r["fits"] else "does not fit"
    return f"{verdict} ({r['need_bytes'] / 2**30:.1f} of {r['available_bytes'] / 2**30:.1f} GiB)"


class ProfilesScreen(ModalScreen[str | None]):
    """Pick a profile; dismisses with its name (the app reloads the engine)."""

    BINDINGS = [("escape", "dismiss(None)", "Close")]

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label(f"Profiles (current: {self.current}). Enter switches; Esc closes.")
            yield DataTable(id="profiles", cursor_type="row")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("name", "source", "model", "context", "KV", "spec", "fit here")
        for name in sorted({*profiles.builtin_files(), *profiles.user_files()}):
            try:
                p = profiles.load(name)
                row = (p.name + (" *" if name == self.current else ""), "built-in" if p.builtin else "user",
                       p.model, str(p.max_context), p.kv_dtype,
                       p.spec + (f" K={p.draft_tokens}" if p.spec != "none" else ""), fit_text(p))
            except NinferError as exc:
                row = (name, "user", "-", "-", "-", "-", f"invalid: {exc}"[:60])
            table.add_row(*row, key=name)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)
