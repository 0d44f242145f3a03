"""``ssd-chat demo --headless --record F --simulate PROFILE``: the real decoders with padded forwards, a
recording that says it is a simulation (and the panel and title that show it), the shipped recordings by
name, and the usage it refuses."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from ssd_chat.chat import recordings
from ssd_chat.cli import app as cli_app
from ssd_chat.engine.events import Done, Round, Token
from ssd_chat.engine.model import simulate
from ssd_chat.chat.recorder import Recorder, read

from helpers.tui import ready, ssd_events


@pytest.mark.parametrize("args, says", [
    (["demo", "--simulate", "h100-70b-1b"], "use it with --headless --record FILE"),
    (["demo", "--headless", "--simulate", "h100-70b-1b"], "use it with --headless --record FILE"),
    (["demo", "--replay", "x.jsonl", "--simulate", "h100-70b-1b"], "use it with --headless --record FILE"),
    (["demo", "--headless", "--record", "x.jsonl", "--simulate", "nope"], "unknown profile 'nope'"),
    (["demo", "--headless", "--record", "x.jsonl", "--simulate", "h100-70b-1b", "--slow-motion", "0.5"], "must be >= 1"),
])
def test_simulate_without_a_recording_is_refused_in_one_line(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli_app, args)
    assert r.exit_code == 2, r.output
    assert says in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.jsonl").exists()


def test_a_slow_motion_recording_is_written_at_full_speed(tmp_path):
    """Times are divided by the scale, rates multiplied; everything else is left as it was."""
    events = ssd_events(["a", "b", "c"], hits=[True, False])
    with Recorder(tmp_path / "r.jsonl", {"mode": "ssd"}, time_scale=4.0) as rec:
        rec.turn("p")
        for ev in events:
            rec.event(ev)
    back = read(tmp_path / "r.jsonl").turns[0].events
    for was, now in zip(events, back):
        assert type(now) is type(was)
        if isinstance(was, (Token, Round)):
            assert now.t_s == pytest.approx(was.t_s / 4)
        if isinstance(was, Round):
            assert now.verify_s == pytest.approx(was.verify_s / 4) and now.accepted == was.accepted
        if isinstance(was, Done):
            assert now.stats.tok_per_s == pytest.approx(was.stats.tok_per_s * 4)
            assert now.stats.elapsed_s == pytest.approx(was.stats.elapsed_s / 4)
            assert now.stats.new_tokens == was.stats.new_tokens and now.text == was.text


@pytest.fixture
def tiny_engine(monkeypatch, tmp_path, tiny_target):
    """The headless demo on the tiny test model (AR, the compact core), in place of the packaged one."""
    from ssd_chat.chat import loading
    from ssd_chat.engine.engine import Engine, EngineConfig

    class AnyText(type(tiny_target.tokenizer)):  # the session's plain chat format has more than a..z
        def __call__(self, text, add_special_tokens=True):  # noqa: ARG002
            return {"input_ids": [ord(c) % self.vocab_size for c in text]}

    tiny_target.tokenizer = AnyText(tiny_target.tokenizer.vocab_size)
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setattr(loading, "load_engine", lambda values, **kw: Engine(EngineConfig(mode="ar", compile="off"), tiny_target, None))
    yield
    simulate.deactivate()


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_a_simulated_recording_pads_every_forward_and_says_so(tmp_path, tiny_engine, scale, capsys):
    from ssd_chat.chat.demo import run_headless
    from ssd_chat.cli.options import settings

    prof = tmp_path / "slow.json"
    prof.write_text(json.dumps({"name": "slow", "title": "a slow test machine", "target": {"step_ms": 40.0},
                                "draft": {"step_ms": 5.0}, "k": 2, "fan_out": "uniform:2", "acceptance": 0.7,
                                "acceptance_source": "a test"}))
    values = settings({"mode": "ar", "max_new_tokens": 5, "temperature": 0.0, "record": str(tmp_path / "r.jsonl")})
    assert run_headless(values, ["hello", "again"], str(prof), scale) == 0
    rec = read(tmp_path / "r.jsonl")
    assert rec.info["simulated"] == str(prof) and "(simulated" in rec.info["target_device"]
    assert rec.info["time_scale"] == scale and all(t.settings["simulated"] == str(prof) for t in rec.turns)
    for turn in rec.turns:
        times = [e.t_s for e in turn.events if isinstance(e, Token)]
        assert len(times) == 5
        # each token after the first is one padded target forward: at least the modelled 40 ms apart
        assert all(b - a >= 0.040 - 1e-6 for a, b in zip(times, times[1:])), times
        done = turn.events[-1]
        assert isinstance(done, Done) and done.stats.tok_per_s <= 1000 / 40 + 1e-6
    err = capsys.readouterr().err
    assert re.search(r"verifier target: \d+ forwards padded", err) and "overran it" in err and f"SIMULATED {prof}" in err
    assert ("3x slow motion" in err) == (scale == 3.0)
    assert simulate.active() is None  # the padding ends with the session


@pytest.mark.asyncio
async def test_the_replay_of_a_simulated_recording_says_so_in_the_panel_and_title(tmp_path):
    from ssd_chat.chat.backend import ReplayBackend
    from ssd_chat.chat.demo import simulated_info
    from ssd_chat.tui.app import ChatApp
    from helpers.tui import plain

    info = {"mode": "ssd", "k": 2, "target": "smollm2-135m-gguf", **simulated_info("h100-70b-1b", 40.0)}
    with Recorder(tmp_path / "r.jsonl", info) as rec:
        rec.turn("hi", None, info)
        for ev in ssd_events(["Yes", "."]):
            rec.event(ev)
    app = ChatApp(ReplayBackend(read(tmp_path / "r.jsonl"), speed=100))
    async with ready(app, size=(150, 45)) as pilot:
        setup = " ".join(plain(app.chat_view.panel.query_one("#setup")).split())
        assert "SIMULATED h100-70b-1b" in setup and "40x slow motion" in setup
        assert "padded to h100-70b-1b (simulated, 40x slow motion)" in setup
        assert "SIMULATED h100-70b-1b" in app.sub_title
        await pilot.press("ctrl+c")


def test_shipped_recordings_are_listed_and_found_by_name(tmp_path):
    r = CliRunner().invoke(cli_app, ["demo", "--list"])
    assert r.exit_code == 0
    names = [p.stem for p in recordings.shipped()]
    assert "ssd_smollm2_cpu" in names and "ssd_h100_70b_1b_simulated" in names
    assert all(n in r.output for n in names) and "SIMULATED on h100-70b-1b" in r.output
    assert recordings.resolve("h100").name == "ssd_h100_70b_1b_simulated.jsonl"
    assert recordings.resolve("ssd_smollm2_cpu").name == "ssd_smollm2_cpu.jsonl"
    own = tmp_path / "h100.jsonl"
    own.write_text("")
    assert recordings.resolve(str(own)) == own  # a file that exists is that file
    with pytest.raises(ValueError, match="several"):
        recordings.resolve("ssd")
    r = CliRunner().invoke(cli_app, ["demo", "--replay", "nothing-like-it"])
    assert r.exit_code == 1 and "no recording at nothing-like-it" in r.output and "ssd-chat demo --list" in r.output
