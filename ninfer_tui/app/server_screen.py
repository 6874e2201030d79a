"""The API server panel: start/stop the background server for the current profile, its URL, key, log, counters."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Log, Static

from engine.server.lifecycle import health, list_servers, stop

from ..serve_cmd import run_dir
from .dialogs import closing_key


def counters(url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=1) as r:
            text = r.read().decode()
    except OSError:
        return "metrics: not answering"
    total: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("ninfer_requests_total", "ninfer_prompt_tokens_total", "ninfer_completion_tokens_total",
                            "ninfer_cached_prompt_tokens_total", "ninfer_running_requests ",
                            "ninfer_pending_requests ")):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0]
            total[key] = total.get(key, 0) + float(value)
    return (f"requests {total.get('ninfer_requests_total', 0):.0f}, running "
            f"{total.get('ninfer_running_requests', 0):.0f}, queued {total.get('ninfer_pending_requests', 0):.0f}, "
            f"prompt tokens {total.get('ninfer_prompt_tokens_total', 0):.0f} "
            f"({total.get('ninfer_cached_prompt_tokens_total', 0):.0f} cached), "
            f"generated {total.get('ninfer_completion_tokens_total', 0):.0f}")


class ServerScreen(ModalScreen[None]):
    """Every call to the server (/health, /metrics, stopping it) runs off the UI thread: a busy server answers
    slowly, and stopping one waits for it, while the app's keys must keep working."""

    BINDINGS = [closing_key("escape")]

    def __init__(self, profile: str) -> None:
        super().__init__()
        self.profile = profile
        self._log_pos = 0
        self._reading = False  # one read of the server's state at a time (they share the log's position)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label(f"API server for profile {self.profile}")
            yield Static("", id="server-state", markup=False)
            yield Static("", id="server-counters", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Start", id="start", variant="primary")
                yield Button("Stop", id="stop", variant="error")
                yield Button("Close", id="close")
            yield Log(id="server-log", max_lines=500)

    def on_mount(self) -> None:
        self.refresh_state()
        self.set_interval(1.0, self.refresh_state)

    def servers(self):
        return list_servers(run_dir())

    def refresh_state(self) -> None:
        if not self._reading:
            self._reading = True
            self.read_state()

    @work(thread=True, group="server-state")
    def read_state(self) -> None:
        try:
            shown = self.state()
        except Exception as exc:  # shown in the panel, never a traceback
            shown = (f"cannot read the server's state: {exc}", "", "")
        self.app.call_from_thread(self.show_state, *shown)

    def state(self) -> tuple[str, str, str]:
        """The state line, the counters line and the log written since the last read."""
        servers = self.servers()
        key = "API key: set (NINFER_API_KEY)" if os.environ.get("NINFER_API_KEY") else "API key: none (loopback only)"
        if not servers:
            return f"not running.  {key}", "", ""
        s = servers[0]
        state = (health(s.url, timeout=0.3) or {}).get("status", "not answering")
        new = ""
        if s.log and Path(s.log).is_file():
            with open(s.log, errors="replace") as f:
                f.seek(self._log_pos)
                new = f.read()
                self._log_pos = f.tell()
        return f"{s.url}  pid {s.pid}  profile {s.profile}  model {s.model}  [{state}]  {key}", counters(s.url), new

    def show_state(self, state: str, numbers: str, new_log: str) -> None:
        self._reading = False
        if not self.is_attached:  # closed meanwhile
            return
        self.query_one("#server-state", Static).update(state)
        self.query_one("#server-counters", Static).update(numbers)
        if new_log:
            self.query_one(Log).write(new_log)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "close":
            self.dismiss()
        elif event.button.id == "start":
            self.start_server()
        elif event.button.id == "stop":
            self.stop_servers()

    @work(thread=True, exclusive=True, group="server")
    def stop_servers(self) -> None:
        for s in self.servers():
            self.app.call_from_thread(self.notify, f"stopping the server {s.pid}…")
            self.app.call_from_thread(self.notify, f"{s.pid}: {stop(s)}")
        self.app.call_from_thread(self.refresh_state)

    @work(thread=True, exclusive=True, group="server")
    def start_server(self) -> None:
        self.app.call_from_thread(self.notify, "starting the server (the model loads in its own process)...")
        proc = subprocess.run([sys.executable, "-m", "ninfer_tui.cli", "serve", "--detach", "--profile",
                               self.profile], capture_output=True, text=True)
        message = (proc.stdout or proc.stderr).strip().splitlines()
        self.app.call_from_thread(self.notify, message[-1] if message else "done",
                                  severity="information" if proc.returncode == 0 else "error")
        self.app.call_from_thread(self.refresh_state)
