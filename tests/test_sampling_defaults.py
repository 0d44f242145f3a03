"""Sampling defaults: the model's generation_config, else the chat default; the penalty options on the
command line, in the environment and the config file; what `ask --json` reports."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from helpers.models import tiny_llama
from ssd_chat.chat import settings as config
from ssd_chat.cli import app
from ssd_chat.engine.load import gen_defaults
from ssd_chat.engine.params import SamplingParams


def write_gen(folder, data) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data), encoding="utf-8")


@pytest.mark.parametrize("data, want", [
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, {"temperature": 0.6, "top_p": 0.9}),  # Llama-3 instruct
    ({"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20},  # Qwen2.5 instruct
     {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}),
    ({"do_sample": False, "temperature": 0.6}, {"temperature": 0.0}),  # declared greedy
    ({"do_sample": True}, {"temperature": 1.0}),
    ({"repetition_penalty": 1.2}, {"repetition_penalty": 1.2}),
])
def test_a_declared_generation_config_is_used(tmp_path, data, want):
    write_gen(tmp_path, {"bos_token_id": 1, **data})
    got, source = gen_defaults.for_model(tmp_path)
    assert got == want and "generation_config" in source
    SamplingParams(**got)  # in range


@pytest.mark.parametrize("data", [None, {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2},
                                  {"bos_token_id": 1}, "not json"])
def test_a_model_that_declares_nothing_gets_the_chat_default(tmp_path, data):
    if data == "not json":
        (tmp_path / "generation_config.json").write_text("{", encoding="utf-8")
    elif data is not None:
        write_gen(tmp_path, data)
    got, source = gen_defaults.for_model(tmp_path)
    assert got == gen_defaults.CHAT_DEFAULT and "declares none" in source
    assert gen_defaults.for_model(None)[0] == gen_defaults.CHAT_DEFAULT
    p = config.sampling({}).over(got)
    assert p.temperature > 0 and p.repetition_penalty > 1.0


def test_set_values_win_over_the_model_defaults_and_bench_keeps_greedy():
    model = {"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}
    p = config.sampling({"temperature": 0.0, "frequency_penalty": 0.5}).over(model)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.frequency_penalty) == (0.0, 0.8, 1.05, 0.5)
    values, _ = config.resolve({})
    plain = config.sampling(values)  # what bench / compare build: no model defaults
    assert plain == SamplingParams() and plain.temperature == 0.0 and plain.repetition_penalty == 1.0


def test_penalties_from_flag_env_and_file(tmp_path, monkeypatch):
    (tmp_path / "config.toml").write_text("repetition_penalty = 1.2\nfrequency-penalty = 0.5\n", encoding="utf-8")
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("SSD_CHAT_PRESENCE_PENALTY", "0.25")
    values, sources = config.resolve({"frequency_penalty": 0.75})
    assert (values["repetition_penalty"], sources["repetition_penalty"]) == (1.2, "file")
    assert (values["frequency_penalty"], sources["frequency_penalty"]) == (0.75, "cli")
    assert (values["presence_penalty"], sources["presence_penalty"]) == (0.25, "env")


@pytest.mark.parametrize("args, code, needle", [
    (["ask", "--repetition-penalty", "0", "hi"], 2, "repetition-penalty must be a finite number > 0"),
    (["ask", "--frequency-penalty", "2.5", "hi"], 2, "frequency-penalty must be in [-2, 2]"),
    (["ask", "--presence-penalty", "nan", "hi"], 2, "presence-penalty must be in [-2, 2]"),
    (["--repetition-penalty", "inf", "ask", "hi"], 2, "repetition-penalty must be a finite number > 0"),
])
def test_bad_penalties_are_one_line_usage_errors(args, code, needle):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == code, r.output
    assert needle in r.stderr and "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


def test_a_bad_penalty_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("SSD_CHAT_REPETITION_PENALTY", "-1")
    r = CliRunner().invoke(app, ["ask", "hi"])
    assert r.exit_code == 1 and "(repetition_penalty from environment variable SSD_CHAT_REPETITION_PENALTY)" in r.stderr


@pytest.fixture(scope="module")
def plain_chat_dir(tmp_path_factory, smol_tokenizer):
    """A tiny chat model whose generation_config declares nothing (as the packaged GGUF's)."""
    folder = tmp_path_factory.mktemp("plain") / "plain-chat"
    model = tiny_llama(vocab_size=len(smol_tokenizer.get_vocab()), seed=0, dtype=torch.float32)
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


def _ask_json(*args):
    from helpers.cli import cli

    r = cli("ask", "--json", "--no-server", "--mode", "ar", "-n", "8", *args, "hi")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_ask_json_reports_the_sampling_it_used(plain_chat_dir, tiny_chat_dir):  # noqa: F811
    out = _ask_json("--target", str(plain_chat_dir), "--seed", "3")
    assert out["sampling"] == {**{"top_k": 0, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0},
                               **gen_defaults.CHAT_DEFAULT, "seed": 3}
    out = _ask_json("--target", str(plain_chat_dir), "--temperature", "0", "--repetition-penalty", "1", "--presence-penalty", "0.5")
    assert out["sampling"]["temperature"] == 0.0 and out["sampling"]["repetition_penalty"] == 1.0
    assert out["sampling"]["presence_penalty"] == 0.5 and out["sampling"]["top_k"] == 40
    assert _ask_json("--target", str(tiny_chat_dir))["sampling"]["temperature"] == 0.0  # it declares do_sample: false


@pytest.mark.asyncio
async def test_the_panel_shows_the_sampling_and_the_reply_uses_it():
    """The panel's sampling line: the backend's model defaults under the settings the user set; a reply is
    sent with exactly those; /temp 0 changes both."""
    from helpers.tui import FakeBackend, plain, ready, ssd_events, wait_until
    from ssd_chat.tui.app import ChatApp

    class ModelDefaults(FakeBackend):
        def sampling_defaults(self):
            return dict(gen_defaults.CHAT_DEFAULT)

        def stream(self, messages, params, stop):
            self.params = params
            return super().stream(messages, params, stop)

    backend = ModelDefaults([ssd_events(["a"]), ssd_events(["b"])])
    app = ChatApp(backend, settings={"sampling": SamplingParams.given({"frequency_penalty": 0.3})})
    async with ready(app, size=(140, 40)) as pilot:
        assert "sampling T 0.8 top-p 0.9 top-k 40 rep 1.1 freq 0.3" in plain(app.chat_view.panel.query_one("#setup"))
        await app.chat_view.submit("hi")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        p = backend.params
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.frequency_penalty) == (0.8, 0.9, 40, 1.1, 0.3)
        await app.chat_view.submit("/temp 0")
        assert "sampling greedy rep 1.1 freq 0.3" in plain(app.chat_view.panel.query_one("#setup"))
        await app.chat_view.submit("again")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished and backend.params.temperature == 0.0)


def test_ask_through_a_server_sends_the_penalties_it_was_given(monkeypatch, capsys):
    """`ask` answered by a running server forwards the sampling settings the user set, penalties included."""
    import io

    from ssd_chat.server import client as server_client

    sent = {}
    done = {"choices": [{"delta": {"content": "ok"}, "token_ids": [5], "finish_reason": "stop"}], "ssd_stats": {}}

    def fake_request(url, body, timeout=None):
        sent.update(body)
        return io.BytesIO(f"data: {json.dumps(done)}\n\ndata: [DONE]\n".encode())

    monkeypatch.setattr(server_client, "_request", fake_request)
    server = server_client.Server("http://127.0.0.1:9", {"id": "m", "ssd": {"config": {"target": "m"}}}, None)
    values = {"sampling": config.sampling({"max_new_tokens": 8, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": -0.5})}
    assert server_client.answer(server, "hi", values, set(), False, None) == 0
    assert (sent["repetition_penalty"], sent["frequency_penalty"], sent["presence_penalty"]) == (1.3, 0.5, -0.5)
    assert "top_k" not in sent and sent["max_tokens"] == 8 and capsys.readouterr().out == "ok\n"
