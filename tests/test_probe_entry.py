"""``auto`` through the real entry points, on a tiny real model: the app and ``serve`` start a measurer process
at the lowest priority when the setup has none, one at a time, that dies with its parent; every entry path
(the app, ``ask``, ``serve``) reads the one record and runs the same mode."""

from __future__ import annotations

import os
import time

import pytest

from ssd_chat.chat.settings import engine_config, resolve
from ssd_chat.engine import Engine, EngineConfig
from ssd_chat.engine.startup import probe
from ssd_chat.engine.startup import probe_store as ps
from ssd_chat.engine.startup import preflight

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the measurer's SSD needs a core for its speculator")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fields_of(cfg: EngineConfig) -> dict:
    pre = preflight.check(cfg)
    return probe.key_fields(pre.config, pre.draft)


def test_a_start_with_no_record_runs_ar_and_measures_in_the_background_once(tiny_chat_dir, cache):  # noqa: F811
    cfg = EngineConfig(target=str(tiny_chat_dir), draft="layers:1", mode="auto", target_device="cpu", dtype="float32")
    fields = fields_of(cfg)
    with Engine.load(cfg, measure="background") as e:
        assert e.config.mode == "ar" and "measuring AR, SD and SSD in the background at low priority" in e.mode_reason
        assert e.measurer is not None and ps.measuring(fields)  # the lock is held from the start
        child = psutil.Process(e.measurer.pid)
        deadline = time.monotonic() + 60
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and child.nice() != 19 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert child.nice() == 19
        with Engine.load(cfg, measure="background") as e2:  # a second start meanwhile: no second measurer
            assert e2.measurer is None and e2.config.mode == "ar" and "another ssd-chat is measuring" in e2.mode_reason
        assert e.measurer.wait(timeout=600) == 0
    rec = ps.read(fields)
    assert rec is not None and rec.load.probe_cores == 2
    with Engine.load(cfg, measure="background") as e3:  # the next start uses the record: nothing measures
        assert e3.measurer is None and (e3.config.mode, e3.mode_reason) == probe.choice(rec, on_cpu=True)
        assert "background" not in e3.mode_reason


def test_the_measurer_dies_with_the_engine_and_stores_nothing(tiny_chat_dir, cache):  # noqa: F811
    cfg = EngineConfig(target=str(tiny_chat_dir), draft="layers:1", mode="auto", target_device="cpu", dtype="float32")
    e = Engine.load(cfg, measure="background")
    child = psutil.Process(e.measurer.pid)
    e.close()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert ps.read(fields_of(cfg)) is None and not ps.measuring(fields_of(cfg))


@pytest.mark.parametrize("figures,mode", [((30.0, 25.0, 36.0), "ssd"), ((47.7, 35.0, 35.8), "ar")])
def test_the_app_ask_and_serve_run_the_mode_the_record_gives(figures, mode, tiny_chat_dir, cache):  # noqa: F811
    from ssd_chat.chat.backend import EngineBackend
    from ssd_chat.chat.loading import load_engine

    values, _ = resolve({"target": str(tiny_chat_dir), "draft": "layers:1", "target_device": "cpu", "dtype": "float32"})
    ar, sd, ssd = figures
    result = probe.Result({"ar": ar, "sd": sd, "ssd": ssd}, 2, {"sd": 1.5, "ssd": 1.6}, {"sd": 1.9, "ssd": 1.9}, 0.5)
    ps.write(fields_of(engine_config(values)), probe.record(result, ps.Load(0.1, 2.0, 2, 2), 1.0))
    seen = {}
    ask = load_engine(values, progress_to_stderr=False)  # ask, compare, the demo
    seen["ask"] = ask.describe()
    ask.close()
    serve = load_engine(values, progress_to_stderr=False, measure="background")  # serve_cmd
    seen["serve"] = serve.describe()
    assert serve.measurer is None
    serve.close()
    app = EngineBackend(values)
    app.load(lambda s, f: None)
    seen["app"] = app.info()
    app.close()
    assert {k: (d["mode"], d["mode_reason"]) for k, d in seen.items()} == dict.fromkeys(seen, (mode, seen["ask"]["mode_reason"]))
    assert seen["ask"]["mode_reason"].startswith(f"{mode.upper()}: measured fastest here (AR {ar}, SD {sd}, SSD {ssd} tok/s)")


def test_config_measure_measures_now_and_config_shows_when_and_under_what_load(tiny_chat_dir, cache, monkeypatch):  # noqa: F811
    from typer.testing import CliRunner

    from ssd_chat.cli import app

    args = ["--target", str(tiny_chat_dir), "--draft", "layers:1", "--dtype", "float32", "--target-device", "cpu"]
    values, _ = resolve({"target": str(tiny_chat_dir), "draft": "layers:1", "target_device": "cpu", "dtype": "float32"})
    fields = fields_of(engine_config(values))
    with ps.lock(fields):  # another process measures: a one-line error, nothing measured
        r = CliRunner().invoke(app, [*args, "config", "measure"])
    assert r.exit_code == 1 and "another ssd-chat is measuring AR, SD and SSD for this setup now" in r.output
    assert "Traceback" not in r.output and ps.read(fields) is None
    r = CliRunner().invoke(app, [*args, "config", "measure"])
    assert r.exit_code == 0, r.output
    rec = ps.read(fields)
    mode, why = probe.choice(rec, on_cpu=True)
    words = f"measured {rec.when()} ({rec.load.words()})"
    assert r.stdout.splitlines() == [f"auto → {mode}", why, words]
    shown = " ".join(CliRunner().invoke(app, [*args, "config"]).stdout.split())
    assert f"mode: {why}" in shown and words in shown
    first = rec.at
    assert CliRunner().invoke(app, [*args, "config", "measure"]).exit_code == 0  # on request, again
    assert ps.read(fields).at > first
