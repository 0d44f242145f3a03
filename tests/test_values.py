"""Values checked before anything loads: sampling ranges (SamplingParams is the one rule for the CLI,
the config file and the app), --dtype, the config file's place, `config set` and a bad config file,
the help texts, and what mode auto and `ssd-chat config` say about a local model folder."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from ssd_chat.cli import ask as ask_module
from ssd_chat.chat import settings as config
from ssd_chat.cli import app
from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.params import SEED_MAX, SamplingParams
from ssd_chat.engine.sampling.sampling import make_generator


@pytest.fixture
def no_load(monkeypatch):
    """Loading weights is a test failure: every check here comes first."""
    def refuse(values):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(ask_module, "load_engine", refuse)


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"top_p": float("nan")}, "top-p must be in (0, 1]"),
    ({"seed": SEED_MAX + 1}, "seed must be a whole number from 0 to"),
    ({"seed": -1}, "seed must be a whole number from 0 to"),
])
def test_sampling_params_refuse_values_that_fail_late(kwargs, needle):
    with pytest.raises(ParamError, match=needle.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_the_largest_seed_and_the_seeds_derived_from_it_fit_torch():
    SamplingParams(seed=SEED_MAX)
    for derived in (SEED_MAX, SEED_MAX + 1, SEED_MAX * 2 + 1):  # the decoders' seed, seed + 1, 2 * seed + 1
        make_generator(derived)


def test_settings_resolve_the_sampling_options_to_one_checked_samplingparams(monkeypatch, tmp_path):
    """Flags, environment and config file give one SamplingParams (no sampling key stays untyped in the
    settings); the model's defaults fill only what the user left unset; every copy is checked again."""
    from dataclasses import replace

    from ssd_chat.cli.options import settings

    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("SSD_CHAT_TOP_K", "7")
    values = settings({"temperature": 0.3, "seed": 5})
    s = values["sampling"]
    assert isinstance(s, SamplingParams) and not set(config.SAMPLING_KEYS) & set(values)
    assert (s.temperature, s.top_k, s.seed, s.max_new_tokens) == (0.3, 7, 5, 512)
    got = s.over({"temperature": 0.9, "top_p": 0.8, "repetition_penalty": 1.1})
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty, got.seed) == (0.3, 0.8, 7, 1.1, 5)
    with pytest.raises(ParamError, match=r"^top-k must be >= 0 \(0 disables it\), got -1$"):
        replace(got, top_k=-1)


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "inf"], "temperature must be a finite number >= 0, got inf (--temperature on the command line)"),
    (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["--top-p", "nan"], "top-p must be in (0, 1], got nan"),
    (["--seed", "99999999999999999999999"], "seed must be a whole number from 0 to 9223372036854775807"),
    (["--dtype", "float8"], "unknown dtype 'float8' (use auto, float32, bfloat16, float16) (--dtype on the command line)"),
])
def test_bad_values_exit_2_in_one_line_before_loading(no_load, args, needle):
    r = CliRunner().invoke(app, ["ask", *args, "-n", "4", "hi"])
    assert r.exit_code == 2, r.output
    assert r.stderr == f"ssd-chat: error: {needle}\n" or (r.stderr.count("\n") == 1 and needle in r.stderr), r.stderr


def test_the_app_refuses_an_infinite_temperature_in_words():
    from helpers.tui import FakeBackend, ssd_events, wait_until

    from ssd_chat.tui.app import ChatApp

    async def run():
        backend = FakeBackend([ssd_events(["a"])])
        app_ = ChatApp(backend)
        async with app_.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: app_.chat_view.ready)
            before = app_.chat_view.params.get("temperature")
            for bad in ("inf", "nan", "1e400"):
                await app_.chat_view.submit(f"/temp {bad}")
            assert app_.chat_view.params.get("temperature") == before
            notices = [n.text for n in app_.query("Notice")]
            assert sum("temperature must be a finite number" in t for t in notices) == 3, notices

    import asyncio

    asyncio.run(run())


# -- the config file's place ----------------------------------------------------------------------
def test_a_config_path_that_is_a_folder_is_named(tmp_path, monkeypatch):
    (tmp_path / "config.toml").mkdir()
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["ask", "hi"])
    assert r.exit_code == 1 and "config.toml is not a file" in r.stderr and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["config"])  # still shows the settings, and says the file is not used
    assert r.exit_code == 1 and "max_new_tokens" in r.stdout and "is not a file" in r.stderr
    file = tmp_path / "plain"
    file.write_text("")
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(file))
    r = CliRunner().invoke(app, ["ask", "hi"])
    assert r.exit_code == 1 and f"the config folder {file} is a file" in r.stderr


# -- config set / config / config unset -----------------------------------------------------------
@pytest.mark.parametrize("key, value, needle", [
    ("mode", "turbo", "unknown mode 'turbo'"),
    ("k", "0", "k must be between 1 and 32, got 0"),
    ("target", "llama-3-9000", "unknown model 'llama-3-9000'"),
    ("draft", "nosuch", "unknown model 'nosuch'"),
    ("temperature", "inf", "temperature must be a finite number"),
    ("top_p", "nan", "top-p must be in (0, 1]"),
    ("seed", "99999999999999999999999", "seed must be a whole number"),
    ("dtype", "float8", "unknown dtype 'float8'"),
    ("budget", "1000", "at most 256"),
    ("target_device", "gpu", "unknown device 'gpu'"),
])
def test_config_set_refuses_what_would_stop_every_command(tmp_path, monkeypatch, no_load, key, value, needle):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["config", "set", key, value])
    assert r.exit_code == 1 and needle in r.stderr and "is unchanged" in r.stderr, r.output
    assert not (tmp_path / "config.toml").exists()
    assert CliRunner().invoke(app, ["config", "--json"]).exit_code == 0


def test_config_set_names_a_clash_with_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    for kv in (("k", "4"), ("fan_out", "3,3,2,2,1")):
        assert CliRunner().invoke(app, ["config", "set", *kv]).exit_code == 0
    r = CliRunner().invoke(app, ["config", "set", "k", "2"])
    assert r.exit_code == 1 and 'k=2 needs k+1 = 3' in r.stderr and '(with fan_out = "3,3,2,2,1" in the file)' in r.stderr
    assert config.read_file() == {"k": 4, "fan_out": "3,3,2,2,1"}


def test_a_bad_file_is_shown_by_config_and_fixed_by_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text('mode = "turbo"\nk = "x"\nbogus = [1, 2]\nsystem = "be brief"\n')
    r = CliRunner().invoke(app, ["config"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "turbo" in r.stdout and "'x', not used" in r.stdout  # the table is shown, with the unusable value
    assert "`ssd-chat config unset mode` removes it" in r.stderr
    assert "'k' must be an integer, got 'x' (not used; `ssd-chat config unset k` removes it)" in r.stderr
    assert "unknown setting 'bogus'" in r.stderr and "`ssd-chat config unset bogus`" in r.stderr
    data = json.loads(CliRunner().invoke(app, ["config", "--json"]).stdout)
    assert data["mode"]["value"] == "turbo" and data["k"]["source"] == "default"
    for key in ("mode", "k", "bogus"):
        r = CliRunner().invoke(app, ["config", "unset", key])
        assert r.exit_code == 0, r.output
    assert CliRunner().invoke(app, ["config"]).exit_code == 0
    assert config.read_file() == {"system": "be brief"}  # the good value stays


@pytest.mark.parametrize("value", [
    "a\x1b]0;X\x07b",  # an OSC title change and a bell
    "nul\x00here", "del\x7f and \x1b[2J", 'say "hi" \\ then \\"', "two\nlines\r\n\ttab\x0c\x08",
    "\\u0041 is not an escape", "caf\u00e9 \u2603 \U0001F600", "'single' '''triple''' \"\"\"",
])
def test_config_set_writes_any_text_so_that_every_command_reads_it_back(tmp_path, monkeypatch, value):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["config", "set", "system", value])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout  # echoed escaped, not obeyed by the terminal
    r = CliRunner().invoke(app, ["config", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["system"] == {"value": value, "source": "file"}
    table = CliRunner().invoke(app, ["config"])
    assert table.exit_code == 0 and "\x1b" not in table.stdout and "\x00" not in table.stdout


def test_config_set_refuses_text_toml_cannot_hold_and_leaves_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    assert CliRunner().invoke(app, ["config", "set", "system", "be brief"]).exit_code == 0
    before = (tmp_path / "config.toml").read_bytes()
    for bad in ("bytes \udcff that were not UTF-8", "\ud800"):  # how undecodable bytes in argv reach Python
        r = CliRunner().invoke(app, ["config", "set", "system", bad])
        assert r.exit_code == 1 and "not valid UTF-8" in r.stderr and "is unchanged" in r.stderr, r.output
        assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1
    assert (tmp_path / "config.toml").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]  # no temporary file left behind


@pytest.mark.parametrize("key, value, needle", [
    ("temperature", "-1", "temperature must be a finite number >= 0, got -1.0"),
    ("top_k", "-3", "top-k must be >= 0"),
    ("seed", "-1", "seed must be a whole number from 0"),
    ("max-new-tokens", "-5", "max-new-tokens must be at least 1"),
])
def test_a_negative_value_reaches_the_range_check(tmp_path, monkeypatch, key, value, needle):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["config", "set", key, value])
    assert r.exit_code == 1 and needle in r.stderr and "No such option" not in r.output, r.output
    assert not (tmp_path / "config.toml").exists()
    r = CliRunner().invoke(app, ["config", "set", "frequency_penalty", "-1.5"])  # in range: written
    assert r.exit_code == 0, r.output
    assert config.read_file() == {"frequency_penalty": -1.5}


def test_config_set_where_the_folder_cannot_be_made_is_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "plain").write_text("")
    env = {**os.environ, "SSD_CHAT_CONFIG_DIR": str(tmp_path / "plain" / "ssd-chat")}
    r = subprocess.run([sys.executable, "-m", "ssd_chat", "config", "set", "k", "3"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"ssd-chat: error: cannot write the config file {tmp_path}/plain/ssd-chat/config.toml: "
                                f"Not a directory ({tmp_path}/plain/ssd-chat); nothing was written")


def test_config_set_on_a_file_it_cannot_write_is_one_line_and_keeps_the_file(tmp_path, monkeypatch):
    """Root writes a read-only file regardless, so the refusal is made where the write fails."""
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    (tmp_path / "config.toml").write_text('mode = "sd"\n')

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    r = CliRunner().invoke(app, ["config", "set", "k", "3"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"cannot write the config file {tmp_path / 'config.toml'}: Permission denied; nothing was written" in r.stderr
    assert (tmp_path / "config.toml").read_text() == 'mode = "sd"\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_config_set_writes_through_a_symlinked_file(tmp_path, monkeypatch):
    real = tmp_path / "dotfiles" / "ssd-chat.toml"
    real.parent.mkdir()
    real.write_text('mode = "sd"\n')
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.toml").symlink_to(real)
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path / "cfg"))
    assert CliRunner().invoke(app, ["config", "set", "k", "3"]).exit_code == 0
    assert (tmp_path / "cfg" / "config.toml").is_symlink()
    assert config.read_file(real) == {"mode": "sd", "k": 3}


# -- help texts -----------------------------------------------------------------------------------
def test_help_texts_are_whole_and_agree(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    r = CliRunner().invoke(app, ["config", "--help"])
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("set "))
    assert "Write KEY = VALUE to the config file (checked first)." in line, line  # not cut at "(e.g."
    r = CliRunner().invoke(app, ["--help"])
    text = " ".join(r.stdout.split())
    assert "a GGUF on the CPU computes in its own quantized blocks" in text


# -- mode auto and `ssd-chat config` on a local model folder --------------------------------------
def test_auto_and_config_say_the_same_about_a_local_folder(tmp_path, monkeypatch):
    from helpers.models import tiny_llama

    folder = tmp_path / "my-model"
    tiny_llama().save_pretrained(folder)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    data = json.loads(CliRunner().invoke(app, ["-t", str(folder), "config", "--json"]).stdout)
    assert data["mode"]["resolved"] == "ar"
    assert "int8 copy (what --mode sd/ssd would use" in data["mode"]["reason"]
    assert data["draft"].get("in_force") is None  # AR loads no draft, so none is listed as in force
    r = CliRunner().invoke(app, ["-t", str(folder), "config"], env={"COLUMNS": "200"})
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in r.stdout.splitlines() if ln.count("│") >= 4}
    assert rows["draft"] == "— (AR loads none)" and rows["mode"] == "auto → ar"
    ssd = json.loads(CliRunner().invoke(app, ["-t", str(folder), "--mode", "ssd", "config", "--json"]).stdout)
    assert ssd["draft"]["in_force"] == "int8"  # what --mode ssd runs with, as the reason says
