"""The speed check inside the app: same library code as `ninfer speedcheck`."""
from __future__ import annotations

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, ProgressBar, Static

from .dialogs import closing_key


class SpeedcheckScreen(ModalScreen[None]):
    BINDINGS = [closing_key("escape")]
    AUTO_FOCUS = "#run"  # Enter starts the check

    def __init__(self, profile) -> None:
        super().__init__()
        self.profile = profile

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            yield Static(f"Speed check: the fixed 8K short-code task on profile {self.profile.name}", markup=False)
            with Horizontal(classes="buttons"):
                yield Label("tokens to generate:")
                yield Input("256", id="tokens", type="integer")
                yield Button("Run", id="run", variant="primary")
                yield Button("Close", id="close")
            bar = ProgressBar(id="progress", show_eta=False)
            bar.display = False  # shown from the first run: an idle bar with no total would animate
            yield bar
            yield Static("", id="result")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "close":
            self.dismiss()
        else:
            try:
                n = int(self.query_one("#tokens", Input).value)
            except ValueError:
                n = 0
            if n < 1:
                self.notify("tokens to generate: a whole number, at least 1", severity="error")
                return
            bar = self.query_one(ProgressBar)
            bar.update(total=n, progress=0)
            bar.display = True
            self.query_one("#result", Static).update("running (the app's model is unloaded meanwhile)...")
            self.run_check(n)

    @work(thread=True, exclusive=True, group="speedcheck")
    def run_check(self, n: int) -> None:
        from ..doctor import diagnose
        from ..speedcheck import plot, run_speedcheck

        app = self.app
        app.call_from_thread(app.release_backend)  # one model on the device at a time
        try:
            bar = self.query_one(ProgressBar)
            report = run_speedcheck(self.profile, n, diagnose(self.profile),
                                    on_token=lambda i: app.call_from_thread(bar.update, progress=i), announce=False)
            lines = [f"decode {report.decode_tok_s:.2f} tok/s, prefill {report.prefill_tok_s:.1f} tok/s, "
                     f"TTFT {report.ttft_s:.3f} s, {report.round_ms:.2f} ms per round",
                     f"prompt {report.prompt_tokens} tokens, generated {report.completion_tokens}"]
            if report.tok_s_series:
                lines.append(plot(report.tok_s_series))
            lines.append(report.verdict)
            if report.spec_advice:
                lines.append(report.spec_advice)
            app.call_from_thread(self.query_one("#result", Static).update, "\n".join(lines))
        except Exception as exc:  # shown in the screen, never a traceback
            app.call_from_thread(self.query_one("#result", Static).update, f"error: {exc}")
        finally:
            app.call_from_thread(app.load_backend)
