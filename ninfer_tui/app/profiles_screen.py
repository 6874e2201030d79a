"""Profiles: built-in and user profiles with their key settings and the memory-fit verdict for this machine. The
table holds each profile's verdict; the highlighted profile's description and the verdict's reasons are shown in
full under it, wrapped to the dialog's width."""
from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label, Static

from engine.errors import NinferError

from .. import profiles
from ..profiles_cmd import fit_report
from .dialogs import closing_key


def fit_verdict(profile) -> tuple[str, str]:
    """A short verdict for the table and the full reasons for the details."""
    try:
        r = fit_report(profile, None)
    except NinferError as exc:
        return "n/a", f"fit here: n/a: {exc}" + (f" (hint: {exc.hint})" if exc.hint else "")
    verdict = "fits" if r["fits"] else "does not fit"
    reasons = (f"fit here: {verdict}: needs {r['need_bytes'] / 2**30:.1f} GiB of {r['available_bytes'] / 2**30:.1f} "
               f"GiB ({r['against']})")
    if not r["fits"] and r.get("advice"):
        reasons += f"; {r['advice']}"
    return verdict, reasons


def profile_row(name: str, current: str) -> tuple[tuple[str, ...], str]:
    """The table's cells for a profile, and the text shown under the table while it is highlighted."""
    try:
        p = profiles.load(name)
    except NinferError as exc:
        return (name, "-", "-", "-", "-", "invalid"), f"{name}: invalid: {exc}"
    verdict, reasons = fit_verdict(p)
    cells = (p.name + (" *" if name == current else ""), p.model, str(p.max_context), p.kv_dtype,
             p.spec + (f" K={p.draft_tokens}" if p.spec != "none" else ""), verdict)
    source = "built-in" if p.builtin else p.source
    return cells, f"{p.name} ({source}): {p.description or 'no description'}\n{reasons}"


class ProfilesScreen(ModalScreen[str | None]):
    """Pick a profile; dismisses with its name (the app loads it, keeping the current model until it is up)."""

    BINDINGS = [closing_key("escape", "dismiss(None)")]

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current
        self.details: dict[str, str] = {}  # profile name -> the text under the table

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label(f"Profiles (current: {self.current}). Enter switches; Esc closes.")
            yield DataTable(id="profiles", cursor_type="row")
            yield Static("checking what fits here…", id="profile-details", markup=False)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("name", "model", "context", "KV", "spec", "fit here")
        self.load_rows()

    @work(thread=True, exclusive=True)
    def load_rows(self) -> None:
        """The memory plans read model headers (and the GPU): off the UI thread."""
        names = sorted({*profiles.builtin_files(), *profiles.user_files()})
        rows = [(name, *profile_row(name, self.current)) for name in names]
        self.app.call_from_thread(self.show_rows, rows)

    def show_rows(self, rows: list[tuple[str, tuple[str, ...], str]]) -> None:
        table = self.query_one(DataTable)
        self.details.update((name, details) for name, _, details in rows)
        for name, cells, _ in rows:
            table.add_row(*cells, key=name)
        if self.current in self.details:
            table.move_cursor(row=table.get_row_index(self.current))
        self.query_one("#profile-details", Static).update(self.details[rows[table.cursor_row][0]])

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.query_one("#profile-details", Static).update(self.details.get(event.row_key.value, ""))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)
