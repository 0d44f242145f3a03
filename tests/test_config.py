"""Settings precedence (CLI > env > file > default), their sources, and readable errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ssd_chat.chat import settings as config
from ssd_chat.cli import app


def write(tmp_path, text: str):
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.toml").write_text(text)
    return d


def test_precedence_cli_env_file_default(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(write(tmp_path, 'mode = "sd"\nk = 5\ntemperature = 0.5\nmax-new-tokens = 64\n')))
    monkeypatch.setenv("SSD_CHAT_K", "7")
    monkeypatch.setenv("SSD_CHAT_TEMPERATURE", "0.9")
    values, sources = config.resolve({"temperature": 0.1, "mode": None, "record": "x.jsonl"})
    assert (values["temperature"], sources["temperature"]) == (0.1, "cli")
    assert (values["k"], sources["k"]) == (7, "env")
    assert (values["mode"], sources["mode"]) == ("sd", "file")
    assert (values["max_new_tokens"], sources["max_new_tokens"]) == (64, "file")
    assert (values["target"], sources["target"]) == ("smollm2-135m-gguf", "default")
    assert values["record"] == "x.jsonl"  # non-settings pass through
    assert config.describe_source("k", "env") == "env SSD_CHAT_K"


def test_xdg_location(tmp_path, monkeypatch):
    monkeypatch.delenv("SSD_CHAT_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert config.config_file() == tmp_path / "ssd-chat" / "config.toml"


@pytest.mark.parametrize("text, needle", [
    ("k = 'many'\n", "'k' must be an integer"),
    ("colour_tokens = 3\n", "true or false"),
    ("bogus = 1\n", "unknown setting 'bogus'"),
    ("k = \n", "cannot read config file"),
])
def test_bad_file_values_are_named(tmp_path, monkeypatch, text, needle):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(write(tmp_path, text)))
    with pytest.raises(config.ConfigError) as e:
        config.resolve({})
    assert needle in str(e.value)


def test_bad_env_value_is_named(monkeypatch):
    monkeypatch.setenv("SSD_CHAT_MAX_NEW_TOKENS", "lots")
    with pytest.raises(config.ConfigError, match="SSD_CHAT_MAX_NEW_TOKENS.*must be an integer"):
        config.resolve({})


def test_set_and_unset_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path / "c"))
    config.set_value("mode", "ssd")
    config.set_value("temperature", "0.7")
    config.set_value("system", 'say "hi"\nplease')
    assert config.read_file() == {"mode": "ssd", "temperature": 0.7, "system": 'say "hi"\nplease'}
    config.set_value("mode", None)
    assert "mode" not in config.read_file()
    with pytest.raises(config.ConfigError, match="unknown setting"):
        config.set_value("nope", "1")


def test_config_command_shows_values_and_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(write(tmp_path, "k = 3\n")))
    monkeypatch.setenv("SSD_CHAT_MODE", "sd")
    r = CliRunner().invoke(app, ["--temperature", "0.2", "config", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["temperature"] == {"value": 0.2, "source": "cli"}
    assert {k: data["mode"][k] for k in ("value", "source")} == {"value": "sd", "source": "env"}
    assert data["mode"]["resolved"] == "sd"
    assert data["k"] == {"value": 3, "source": "file"}
    assert data["top_p"]["source"] == "default"
    table = CliRunner().invoke(app, ["config"])
    assert "env SSD_CHAT_MODE" in table.stdout and "file " in table.stdout


def test_config_command_bad_file_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(write(tmp_path, "k = 'x'\n")))
    r = CliRunner().invoke(app, ["config"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "'k' must be an integer" in r.stderr


def test_config_set_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path / "c"))
    r = CliRunner().invoke(app, ["config", "set", "max-new-tokens", "99"])
    assert r.exit_code == 0, r.output
    assert config.read_file()["max_new_tokens"] == 99
    r = CliRunner().invoke(app, ["config", "set", "k", "abc"])
    assert r.exit_code == 1 and "must be an integer" in r.stderr


@pytest.mark.parametrize("args", [["ask", "hi"], []])
def test_bad_env_setting_is_one_line_for_ask_and_the_app(monkeypatch, args):
    monkeypatch.setenv("SSD_CHAT_K", "abc")
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "SSD_CHAT_K: 'k' must be an integer, got 'abc'" in r.stderr


def test_a_value_out_of_range_names_the_file_it_came_from(tmp_path, monkeypatch):
    cfg = write(tmp_path, "k = 99\n")
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(cfg))
    r = CliRunner().invoke(app, ["ask", "hi"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.stderr == f"ssd-chat: error: k must be between 1 and 32, got 99 (k from config file {cfg / 'config.toml'})\n"


def test_a_value_out_of_range_names_the_variable_or_the_flag(monkeypatch):
    monkeypatch.setenv("SSD_CHAT_TOP_P", "0")
    r = CliRunner().invoke(app, ["ask", "hi"])
    assert r.exit_code == 1 and "(top_p from environment variable SSD_CHAT_TOP_P)" in r.stderr
    monkeypatch.delenv("SSD_CHAT_TOP_P")
    r = CliRunner().invoke(app, ["ask", "--mode", "ssd", "--budget", "1000", "hi"])
    assert r.exit_code == 2 and "(at most 256) (--budget on the command line)" in r.stderr


def test_settings_that_clash_are_all_named(monkeypatch):
    monkeypatch.setenv("SSD_CHAT_FAN_OUT", "uniform:2")
    r = CliRunner().invoke(app, ["ask", "--mode", "ssd", "--budget", "7", "hi"])
    assert r.exit_code == 1, r.output
    assert "(fan_out from environment variable SSD_CHAT_FAN_OUT, --budget on the command line)" in r.stderr


@pytest.mark.parametrize("json_out", [False, True])
def test_config_command_shows_invalid_values_and_exits_non_zero(tmp_path, monkeypatch, json_out):
    cfg = write(tmp_path, "max_new_tokens = 0\n")
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(cfg))
    r = CliRunner().invoke(app, ["config", *(["--json"] if json_out else [])])
    assert r.exit_code == 1
    assert "max-new-tokens must be at least 1, got 0 (max_new_tokens from config file" in r.stderr
    if json_out:
        assert json.loads(r.stdout)["max_new_tokens"] == {"value": 0, "source": "file"}
    else:
        assert "max_new_tokens" in r.stdout  # the table is still shown


def test_compile_setting_from_flag_env_and_file(tmp_path, monkeypatch):
    """--compile picks the forward (the compact core eager/compiled, or transformers); `ssd-chat config` shows it."""
    r = CliRunner().invoke(app, ["config", "--json"])
    assert json.loads(r.stdout)["compile"]["in_force"] == "auto"  # the engine's default: compiled where it measured faster
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(write(tmp_path, "compile = 'transformers'\n")))
    r = CliRunner().invoke(app, ["config", "--json"])
    assert {k: json.loads(r.stdout)["compile"][k] for k in ("value", "source")} == {"value": "transformers", "source": "file"}
    monkeypatch.setenv("SSD_CHAT_COMPILE", "auto")
    assert json.loads(CliRunner().invoke(app, ["config", "--json"]).stdout)["compile"]["value"] == "auto"
    r = CliRunner().invoke(app, ["--compile", "on", "config"])
    assert r.exit_code == 0 and "compile" in r.stdout and " on " in r.stdout
    monkeypatch.setenv("SSD_CHAT_COMPILE", "fast")
    r = CliRunner().invoke(app, ["config"])
    assert r.exit_code == 1 and "unknown compile 'fast' (use one of auto, on, off, transformers)" in r.stderr
    r = CliRunner().invoke(app, ["ask", "--compile", "fast", "hi"])
    assert r.exit_code == 2 and "Traceback" not in r.output


@pytest.mark.parametrize("text, needle", [
    ("k = true\n", "'k' must be an integer, got True"),  # a TOML value must already be of the type
    ("k = 4.0\n", "'k' must be an integer, got 4.0"),
    ("trust_remote_code = 1\n", "'trust_remote_code' must be true or false, got 1"),
    ("target = 5\n", "'target' must be a string, got 5"),
    ("temperature = 'warm'\n", "'temperature' must be a number, got 'warm'"),
])
def test_file_values_of_the_wrong_type_are_refused(tmp_path, monkeypatch, text, needle):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(write(tmp_path, text)))
    with pytest.raises(config.ConfigError, match=needle):
        config.resolve({})


def test_text_values_are_parsed_and_toml_values_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(write(tmp_path, "temperature = 1\nk = ' 3 '\nsystem = '  be brief '\n")))
    monkeypatch.setenv("SSD_CHAT_COLOUR_TOKENS", " Yes ")
    monkeypatch.setenv("SSD_CHAT_TOP_P", " 0.9")
    values, _ = config.resolve({})
    assert values["temperature"] == 1.0 and isinstance(values["temperature"], float)
    assert values["k"] == 3 and values["system"] == "  be brief "  # text settings are kept as written
    assert values["colour_tokens"] is True and values["top_p"] == 0.9
    monkeypatch.setenv("SSD_CHAT_COLOUR_TOKENS", "maybe")
    with pytest.raises(config.ConfigError, match="SSD_CHAT_COLOUR_TOKENS: 'colour_tokens' must be true or false, got 'maybe'"):
        config.resolve({})


def test_a_failed_atomic_write_leaves_neither_a_half_file_nor_its_temporary(tmp_path, monkeypatch):
    from ssd_chat.engine.config import write_atomic

    (tmp_path / "probe.json").write_text("old")

    def full_disk(src, dst):
        raise OSError(27, "File too large")

    monkeypatch.setattr("os.replace", full_disk)
    write_atomic(tmp_path / "probe.json", "new")  # a cache that cannot be written is left as it is: no error
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"] and (tmp_path / "probe.json").read_text() == "old"
