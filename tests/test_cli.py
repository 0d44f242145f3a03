"""`ssd-chat ask` end to end in a real subprocess: output, exit codes, bad input, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.cli import cli


@pytest.mark.slow
def test_ask_paris_greedy():
    r = cli("ask", "--temperature", "0", "-n", "40", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "\x1b[" not in r.stdout


@pytest.mark.slow
def test_ask_json_and_stdin():
    r = cli("ask", "--json", "--mode", "ar", "-n", "12", "--temperature", "0", "-", input="What is the capital of France?")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "mode", "target", "draft", "stats"}
    assert set(out["stats"]) == {"new_tokens", "rounds", "tok_per_s", "ttft_s", "acceptance_rate", "mean_accepted_length", "cache_hit_rate",
                                 "path"}
    assert out["stats"]["path"] in ("eager", "compiled")
    assert out["mode"] == "ar" and out["draft"] is None and out["stats"]["acceptance_rate"] is None
    assert out["stats"]["new_tokens"] == len(out["token_ids"]) <= 12 and "Paris" in out["text"]


@pytest.mark.slow
def test_ask_json_says_which_forward_ran_and_both_give_the_same_tokens():
    """AR on the compact core (eager) and on transformers' modules: the same tokens, each labelled."""
    outs = {}
    for forward in ("off", "transformers"):
        r = cli("ask", "--json", "--mode", "ar", "-n", "24", "--temperature", "0", "--compile", forward, "What is the capital of France?")
        assert r.returncode == 0, r.stderr
        outs[forward] = json.loads(r.stdout)
    assert outs["off"]["forward"] == "core eager" and outs["transformers"]["forward"] == "transformers"
    assert outs["off"]["token_ids"] == outs["transformers"]["token_ids"] and "Paris" in outs["off"]["text"]


@pytest.mark.slow
@pytest.mark.parametrize("cores", [None, {0}])
def test_ask_json_reports_the_mode_auto_ran(cores):
    """The default mode is auto: with a core for the speculator (and the shipped draft) the mode that measured
    fastest here (engine/startup/probe.py; ask measures nothing: AR until the app, serve or `config measure`
    has), AR on one core."""
    preexec = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    r = subprocess.run([sys.executable, "-m", "ssd_chat", "ask", "--json", "-n", "12", "--temperature", "0", "What is the capital of France?"],
                       capture_output=True, text=True, timeout=300, preexec_fn=preexec)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    if cores is None and len(os.sched_getaffinity(0)) >= 2:  # SSD can run: auto keeps what measured fastest here
        why = out["mode_reason"]
        assert why.startswith(f"{out['mode'].upper()}: measured fastest here (AR ") or (
            out["mode"] == "ar" and ("not measured on this machine yet" in why or "was not trusted" in why)), why
        if out["mode"] == "ar":
            assert out["stats"]["rounds"] == 0 and out["draft"] is None
        else:
            assert out["stats"]["rounds"] > 0 and out["draft"].startswith("trained (")
    else:
        assert out["mode"] == "ar" and out["stats"]["rounds"] == 0 and out["draft"] is None
        assert "1 CPU core" in out["mode_reason"]
    assert "Paris" in out["text"]


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["ask", "   "], 2, "empty"),
        (["ask", "-n", "0", "hi"], 2, "max-new-tokens"),
        (["ask", "-n", "-3", "hi"], 2, "max-new-tokens"),
        (["ask", "--mode", "fast", "hi"], 2, "--mode"),
        (["ask", "--fallback", "slow", "hi"], 2, "--fallback"),
        (["ask", "--target", "no-such-model", "hi"], 1, "unknown model 'no-such-model'"),
        (["ask", "--target", "/nonexistent/dir", "hi"], 1, "does not exist"),
        (["ask", "--target-device", "cuda:7", "hi"], 1, "cuda:7"),
        (["ask", "--target-device", "cpu:64", "hi"], 1, "cores"),
        (["ask", "--target-device", "cpu:0,cpu:1,cpu:99", "hi"], 1, "no core 99"),
        (["ask", "--target-device", "cuda:0-3", "hi"], 1, "no CUDA GPU is available"),
        (["ask", "--temperature", "-1", "hi"], 2, "temperature"),
        (["ask", "--top-p", "0", "hi"], 2, "top-p"),
        (["ask", "--mode", "ssd", "--budget", "1000", "hi"], 2, "at most 256"),
        (["ask", "--mode", "ssd", "--fan-out", "uniform:500", "hi"], 2, "at most 256"),
    ],
)
def test_bad_input_is_a_clear_error(args, code, needle):
    r = cli(*args)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr


# the real entry point in a process where importing torch fails
NO_TORCH = "import sys; sys.modules['torch'] = None; from ssd_chat.cli import main; sys.argv[0] = 'ssd-chat'; main()"


@pytest.mark.parametrize("args", [["ask", "--target", "no-such-model", "hi"], ["--target", "no-such-model"],
                                  ["serve", "--target", "no-such-model", "--port", "0"]], ids=["ask", "app", "serve"])
def test_an_unknown_model_is_refused_before_torch_imports(tmp_path, args):
    """A mistyped name is refused in a fraction of a second, not after the seconds torch takes to import."""
    env = dict(os.environ, SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"), SSD_CHAT_DATA_DIR=str(tmp_path / "data"))
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, env=env, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["ask", "--mode", "ssd", "--draft", "features", "hi"], 2, "is a feature draft"),
    ],
)
def test_a_draft_the_mode_cannot_use_is_a_clear_error(args, code, needle):
    r = cli(*args)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_folder_that_is_not_a_model(tmp_path):
    r = cli("ask", "--target", str(tmp_path), "hi")
    assert r.returncode == 1 and "not a model" in r.stderr and "Traceback" not in r.stderr


def test_no_prompt_on_a_terminal_is_usage_error():
    r = cli("ask", input="")
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_ctrl_c_mid_reply_exits_130_without_traceback():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "ssd_chat", "ask", "-n", "400", "--temperature", "0.8", "--seed", "1",
                          "Write a long story about a llama."],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        first = p.stdout.read(1)  # blocks until the reply starts streaming
        assert first
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and len(first + out) > 1
    # inside a compiled graph's call (most of a step) it must not read as a compiler failure; a fresh
    # cache's "compiling ... in the background" notice is no failure
    assert "Error" not in err and "failed" not in err and "it runs uncompiled" not in err, err


# --- the note when a reply stops at --max-new-tokens ---------------------------------------------------


def test_ask_notes_a_reply_cut_at_max_new_tokens(tiny_dir):
    """A reply that ran out of -n says so on stderr, once, in plain and --json output alike
    (--json's finish_reason is "length" then); stdout stays the reply."""
    for extra in ([], ["--json"]):
        r = cli("ask", "--target", str(tiny_dir), "--mode", "ar", "-n", "3", *extra, "hi")
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("stopped at --max-new-tokens 3; raise -n for more") == 1, r.stderr
        assert "max-new-tokens" not in r.stdout
        if extra:
            assert json.loads(r.stdout)["finish_reason"] == "length"


def test_no_length_note_at_eos_or_a_stop():
    from ssd_chat.server.client import length_note

    assert length_note("length", 64, 64) == "ssd-chat: stopped at --max-new-tokens 64; raise -n for more"
    assert length_note("eos", 10, 64) is None and length_note("stop", 64, 64) is None
    assert length_note("length", 10, 64) is None  # cut short by something else than -n: not this note
