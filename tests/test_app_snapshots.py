"""Snapshots of the app's main screens (pytest-textual-snapshot; update with --snapshot-update)."""
import textwrap

from ninfer_tui import profiles
from ninfer_tui.app.app import NinferApp

from .test_app import shared_engines  # noqa: F401 (autouse: the app tests' engines are shared with these)


def _app() -> NinferApp:
    (profiles.user_dir() / "snap.toml").write_text(textwrap.dedent(
        'extends = "cpu-default"\n[sampling]\ntemperature = 0.0\nmax_tokens = 8\n'))
    return NinferApp("snap", attach=False)


async def _loaded(pilot) -> None:
    while pilot.app.client is None:
        await pilot.pause(0.05)
    box = pilot.app.query_one("#input")
    box.cursor_blink = False
    box.blur()  # no text cursor: whether it is drawn depends on timing
    await pilot.pause(0.2)
    pilot.app.query_one("#status").update("smollm2-135m | profile snap | cpu")  # no machine-specific numbers


def test_main_screen(snap_compare):
    assert snap_compare(_app(), terminal_size=(110, 30), run_before=_loaded)


def test_help_screen(snap_compare):
    async def before(pilot):
        await _loaded(pilot)
        await pilot.press("f1")

    assert snap_compare(_app(), terminal_size=(110, 34), run_before=before)
