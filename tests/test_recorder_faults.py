"""Recording and replay under bad conditions: a recording that cannot be written stops with one
notice while the chat goes on; a damaged recording is refused up front, naming its line."""

from __future__ import annotations

import json
import resource
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ssd_chat.cli import app as cli_app
from ssd_chat.chat.recorder import Recorder, RecordingError, read

from helpers.history import WORDS, make_recording, shipped
from helpers.tui import FakeBackend, ready, replies_text, ssd_events, submit

needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")


# -- recording ----------------------------------------------------------------------------------
@needs_dev_full
def test_recording_to_a_full_device_is_refused_at_the_start(tmp_path):
    with pytest.raises(RecordingError, match="cannot write the recording /dev/full: No space left on device"):
        Recorder("/dev/full")
    r = CliRunner().invoke(cli_app, ["--record", "/dev/full", "--db", str(tmp_path / "h.db")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr == "ssd-chat: error: cannot write the recording /dev/full: No space left on device\n"


@needs_dev_full
@pytest.mark.asyncio
async def test_a_recording_that_fails_mid_session_stops_with_one_notice(tmp_path):
    from ssd_chat.tui.app import ChatApp

    rec = Recorder(tmp_path / "s.jsonl", {"mode": "ssd"})
    replies = [ssd_events(["one"]), ssd_events(WORDS), ssd_events(["three"])]
    app = ChatApp(FakeBackend(replies, delay=0.002), recorder=rec)
    async with ready(app, size=(120, 40)) as pilot:
        await submit(pilot, app, "first")
        rec._f.close()
        rec._f = open("/dev/full", "w")  # noqa: SIM115 - the disk is full from now on
        await submit(pilot, app, "second")
        await submit(pilot, app, "third")
        assert replies_text(app) == ["one", "".join(WORDS), "three"]
        stopped = [n.text for n in app.query(".notice") if "recording stopped" in n.text]
        assert stopped == [f"warning: recording stopped: cannot write {tmp_path / 's.jsonl'} (No space left on device); "
                           "the chat goes on"]
        await pilot.press("ctrl+c")
    assert app.return_code == 0
    assert [t.prompt for t in read(tmp_path / "s.jsonl").turns] == ["first"]  # what was written stays readable


def test_a_disk_that_fills_mid_session_in_a_real_terminal(tmp_path):
    """The real app replaying a shipped session while recording it, with the process's file size
    limit (RLIMIT_FSIZE) as the full disk: the replay plays to the end, the recording stops once."""
    pytest.importorskip("pexpect")
    from helpers.pty import App, app_env

    source = next(p for p in shipped() if len(read(p).turns) >= 2)
    out_file = tmp_path / "copy.jsonl"
    limit = 3000  # the header and part of the first turn fit

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    turns = len(read(source).turns)
    with App(["--db", str(tmp_path / "h.db"), "demo", "--replay", str(source), "--speed", "50", "--type-delay", "0",
              "--record", str(out_file)], app_env(tmp_path, SSD_CHAT_DATA_DIR=str(tmp_path / "data"), HF_HUB_OFFLINE="1"),
             120, preexec_fn=small_disk) as app:
        def every_reply_ended() -> bool:  # the panel went from "streaming…" to "last reply" once per turn
            so_far = "".join(app.raw)
            return so_far.count("last reply") >= turns and so_far.rfind("last reply") > so_far.rfind("streaming…")

        # The panel redraws "last reply" more than once a turn, so the count can be reached before the last turn
        # starts: the replay has ended when no reply starts for 3 s (the demo pauses under 1 s between turns).
        deadline = time.monotonic() + 120
        while app.until(every_reply_ended, max(0.0, deadline - time.monotonic()), poll=0.5) and time.monotonic() < deadline:
            mark = len(app.raw)
            app.pump(3.0)
            if "streaming…" not in app.screen(mark):
                break
        app.quit(30)
        app.raw.append(app.child.before or "")
    text = "".join(app.raw)
    assert "recording stopped" in text and "File too large" in text, text[-3000:]
    assert "Traceback" not in text
    assert text.rfind("last reply") > text.rfind("streaming…")  # no reply was left frozen mid-stream
    assert app.child.exitstatus == 0, text[-3000:]
    assert out_file.stat().st_size <= limit


# -- replay -------------------------------------------------------------------------------------
def _lines(tmp_path: Path) -> list[dict]:
    make_recording(tmp_path / "good.jsonl", [("first", ssd_events(WORDS)), ("second", ssd_events(["Yes"]))])
    return [json.loads(x) for x in (tmp_path / "good.jsonl").read_text().splitlines()]


def _write(tmp_path: Path, rows: list[dict]) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def _first(rows: list[dict], kind: str) -> int:
    return next(i for i, r in enumerate(rows) if r["type"] == kind)


@pytest.mark.parametrize("value, needle", [
    ("soon", "field 't_s' must be a number, got 'soon'"),
    (1e300, "t_s must be between 0 and 3600 seconds"),
    (-1, "t_s must be between 0 and 3600 seconds"),
    (None, "field 't_s' must be a number, got None"),
])
def test_a_bad_time_is_refused_with_its_line(tmp_path, value, needle):
    rows = _lines(tmp_path)
    i = _first(rows, "Token")
    rows[i]["t_s"] = value
    with pytest.raises(RecordingError, match=f"line {i + 1}: .*{needle}"):
        read(_write(tmp_path, rows))


def test_bad_fields_are_refused_with_their_line(tmp_path):
    rows = _lines(tmp_path)
    i = _first(rows, "Round")
    rows[i]["predicted"] = [[0, "x"]]
    with pytest.raises(RecordingError, match=f"line {i + 1}: Round field 'predicted'"):
        read(_write(tmp_path, rows))
    rows = _lines(tmp_path)
    i = _first(rows, "Done")
    del rows[i]["stats"]["new_tokens"]
    with pytest.raises(RecordingError, match=f"line {i + 1}: Stats has no 'new_tokens'"):
        read(_write(tmp_path, rows))


@pytest.mark.parametrize("kind, field, value, needle", [
    ("Token", "id", True, "Token field 'id' must be an integer, got True"),
    ("Token", "id", 1.0, "Token field 'id' must be an integer, got 1.0"),
    ("Token", "source", "oracle", "Token field 'source' must be 'target' or 'draft', got 'oracle'"),
    ("Round", "drafted", [1, "2"], r"Round field 'drafted'\[1\] must be an integer, got '2'"),
    ("Done", "stats", 5, "Done field 'stats' must be an object, got 5"),
    ("Turn", "prompt", ["hi"], "Turn field 'prompt' must be a string"),
])
def test_a_value_of_the_wrong_type_is_named_with_its_line(tmp_path, kind, field, value, needle):
    rows = _lines(tmp_path)
    i = _first(rows, kind)
    rows[i][field] = value
    with pytest.raises(RecordingError, match=f"line {i + 1}: {needle}"):
        read(_write(tmp_path, rows))


def test_not_a_number_is_refused_and_unknown_keys_are_not(tmp_path):
    rows = _lines(tmp_path)
    i = _first(rows, "Round")
    rows[i]["verify_s"] = float("nan")
    with pytest.raises(RecordingError, match=f"line {i + 1}: NaN is not a finite number"):
        read(_write(tmp_path, rows))
    rows[i]["verify_s"] = 0.5
    rows[i]["from_a_newer_version"] = {"x": 1}  # a newer ssd-chat may add fields: they are skipped
    assert read(_write(tmp_path, rows)).turns[0].events


def test_a_turn_without_its_end_is_refused_naming_the_turn(tmp_path):
    rows = _lines(tmp_path)
    done = [i for i, r in enumerate(rows) if r["type"] == "Done"][1]
    second_turn = [i for i, r in enumerate(rows) if r["type"] == "Turn"][1]
    path = _write(tmp_path, rows[:done] + rows[done + 1:])  # the second reply's Done is gone
    with pytest.raises(RecordingError, match=f"line {second_turn + 1}: this turn has no Done or Error event"):
        read(path)
    path = _write(tmp_path, rows[:second_turn + 1])  # cut right after a Turn line
    with pytest.raises(RecordingError, match=f"line {second_turn + 1}: this turn has no Done"):
        read(path)


def test_demo_replay_of_a_damaged_recording_is_one_line(tmp_path):
    rows = _lines(tmp_path)
    i = _first(rows, "Token")
    rows[i]["t_s"] = 1e300
    r = CliRunner().invoke(cli_app, ["demo", "--replay", str(_write(tmp_path, rows))])
    assert r.exit_code == 1 and "Traceback" not in r.output and r.stderr.count("\n") == 1
    assert f"line {i + 1}" in r.stderr
