"""GPU cleanup inside the app: same library code as `ninfer gpu-clean`; ends only the selected PID, after asking."""
from __future__ import annotations

from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Label

from engine.server.lifecycle import list_servers

from ..gpu_clean import find_holders, plan_actions, terminate
from ..gpu_info import read_nvml
from ..serve_cmd import run_dir
from .dialogs import Confirm, closing_key


class GpuCleanScreen(ModalScreen[None]):
    BINDINGS = [closing_key("escape"), ("r", "refresh", "Refresh")]

    def __init__(self, device_glob: str = "/dev/nvidia*", proc_root: str = "/proc") -> None:
        super().__init__()
        self.device_glob, self.proc_root = device_glob, Path(proc_root)
        self.holders = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label("Processes holding the GPU. Select one and press End; stale ninfer processes are marked.")
            yield DataTable(id="holders", cursor_type="row")
            with Horizontal(classes="buttons"):
                yield Button("End selected", id="end", variant="error")
                yield Button("Refresh", id="refresh")
                yield Button("Close", id="close")

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("pid", "user", "GPU MiB", "kind", "proposed", "command")
        self.action_refresh()

    def action_refresh(self) -> None:
        self.query_one(DataTable).loading = True
        self.find()

    @work(thread=True, exclusive=True, group="gpu-clean")
    def find(self) -> None:
        """Off the UI thread: a listed server that does not answer is checked several times over seconds."""
        holders = plan_actions(find_holders(self.device_glob, self.proc_root, read_nvml(),
                                            list_servers(run_dir())), None)
        self.app.call_from_thread(self.show, holders)

    @work(thread=True, group="gpu-clean-end")
    def end(self, pid: int, created: float) -> None:
        self.app.call_from_thread(self.notify, f"{pid}: {terminate(pid, created)}")
        self.app.call_from_thread(self.action_refresh)

    def show(self, holders: list) -> None:
        table = self.query_one(DataTable)
        table.clear()
        table.loading = False
        self.holders = holders
        for h in self.holders:
            kind = ("ninfer" + (", stale" if h.stale else "")) if h.ninfer else "other"
            table.add_row(str(h.pid), h.user, "-" if h.gpu_mem_mib is None else str(h.gpu_mem_mib), kind,
                          "end" if h.action == "terminate" else "-", h.cmdline[:60], key=str(h.pid))
        if not self.holders:
            self.notify("no process holds the GPU")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "close":
            self.dismiss()
        elif event.button.id == "refresh":
            self.action_refresh()
        elif event.button.id == "end" and self.holders:
            table = self.query_one(DataTable)
            pid = int(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)
            target = plan_actions([h for h in self.holders if h.pid == pid], [pid])[0]
            if target.action != "terminate":
                self.notify(f"{pid}: {target.action}", severity="warning")
                return

            def done(yes: bool | None) -> None:
                if yes:
                    self.end(pid, target.created)

            self.app.push_screen(Confirm(f"End process {pid} ({target.cmdline[:60]})? SIGTERM, then SIGKILL.",
                                         "End it"), done)
