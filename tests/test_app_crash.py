"""A crash of the chat app exits non-zero (the shell, a script or CI must see it failed)."""

from __future__ import annotations

import os
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

# The real entry point with one handler made to fail: any unexpected exception inside the app.
CRASHING = """
import sys
import ssd_chat.tui.app as app_module

async def crash(self):
    raise RuntimeError("boom in the app")

app_module.ChatApp.on_mount = crash
from ssd_chat.cli import main
sys.argv = ["ssd-chat", *sys.argv[1:]]
main()
"""


def test_a_crash_in_the_app_exits_non_zero(tmp_path):
    env = dict(os.environ, TERM="xterm-256color", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"),
               SSD_CHAT_DATA_DIR=str(tmp_path / "data"), HF_HUB_OFFLINE="1")
    model = tmp_path / "broken-model"  # a model folder without weights: the app opens, its load would fail
    model.mkdir()
    (model / "config.json").write_text("{}")
    child = pexpect.spawn(sys.executable, ["-c", CRASHING, "--target", str(model), "--db", str(tmp_path / "h.db")],
                          env=env, dimensions=(40, 120), encoding="utf-8", codec_errors="replace", timeout=60)
    out = child.read()
    child.close()
    assert "boom in the app" in out, out[-2000:]
    assert child.exitstatus == 1, (child.exitstatus, out[-2000:])
