"""The README's key table says what the app does: the keys it lists for quitting quit from the first
screen (where the prompt box has the focus), and the colour it names for the target's tokens is the
colour they have on screen (the app's theme maps ANSI colours: its "yellow" is drawn orange)."""

from __future__ import annotations

import colorsys
import re
from pathlib import Path

import pytest
from rich.style import Style

from helpers.tui import FakeBackend, ready, wait_until

from ssd_chat.tui.app import ChatApp  # noqa: E402
from ssd_chat.tui.widgets import chat_log  # noqa: E402

README = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")


def key_table() -> dict[str, str]:
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", README, flags=re.M)
    return {keys: action for keys, action in rows if keys not in ("key", "---")}


def quit_keys() -> list[str]:
    (keys,) = [k for k, action in key_table().items() if action.startswith("quit")]
    return [k.strip().strip("`") for k in keys.split(",")]


@pytest.mark.asyncio
@pytest.mark.parametrize("key", quit_keys())
async def test_each_key_the_readme_gives_for_quitting_quits_from_the_first_screen(key):
    app = ChatApp(FakeBackend([]))
    async with ready(app, size=(120, 40)) as pilot:
        assert app.focused is app.chat_view.prompt
        await pilot.press(key.lower())
        await wait_until(pilot, lambda: not app.is_running)
    assert app.return_code == 0


def colour_name(rgb: tuple[int, int, int]) -> str:
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    hue = h * 360
    for name, upto in (("red", 15), ("orange", 45), ("yellow", 70), ("green", 170), ("cyan", 200), ("blue", 260),
                       ("purple", 330), ("red", 360)):
        if hue < upto:
            return name
    return "red"


@pytest.mark.asyncio
async def test_the_readme_names_the_colours_the_tokens_have_on_screen():
    (row,) = [action for keys, action in key_table().items() if keys == "Ctrl+T"]
    named = {who: colour for colour, who in re.findall(r"(\w+) = (accepted draft|the target)", row)}
    app = ChatApp(FakeBackend([]))
    async with ready(app, size=(120, 40)) as pilot:
        theme = app.ansi_theme  # how the app draws the 16 ANSI colours

        def shown(style: str) -> str:
            return colour_name(Style.parse(style).color.get_truecolor(theme))

        assert named.get("accepted draft") == shown(chat_log.DRAFT_STYLE), (row, shown(chat_log.DRAFT_STYLE))
        assert named.get("the target") == shown(chat_log.TARGET_STYLE), (row, shown(chat_log.TARGET_STYLE))
        said: list[str] = []
        app.notify = lambda message, **kw: said.append(message)
        await pilot.press("ctrl+t")  # the notice names them too
        await wait_until(pilot, lambda: said)
        assert f"{shown(chat_log.TARGET_STYLE)} = target" in said[0], said
        await pilot.press("ctrl+c")


def test_the_readme_lists_every_command_the_app_lists():
    from ssd_chat.tui.actions import HELP

    app_commands = set(re.findall(r"/[a-z][a-z-]*", HELP.split("Commands:", 1)[1]))
    para = README.split("The same as commands:", 1)[1].split("\n\n", 1)[0]
    assert app_commands and app_commands - set(re.findall(r"/[a-z][a-z-]*", para)) == set()
