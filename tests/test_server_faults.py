"""Server faults over real HTTP: values the engine cannot take, oversized bodies and prompts, the key
checked before the body, and SSD that survives speculator failures (and /health saying when it does not)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading

import pytest

from helpers.server import engine, get, MSG, post, running, wait_until
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.server.app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")
psutil = pytest.importorskip("psutil")


@pytest.fixture(scope="module")
def sd_server(loaded):
    app = create_app(engine(loaded), SamplingParams(max_new_tokens=64), max_body_mb=1)
    with running(app) as url:
        yield url, app


def chat_raw(body: str) -> bytes:
    return ('{"messages": [{"role": "user", "content": "hi"}], ' + body + "}").encode()


@pytest.mark.parametrize("raw,param", [
    (chat_raw('"temperature": 1e999'), "temperature"),  # Python's JSON reads 1e999 as inf
    (chat_raw('"temperature": NaN'), "temperature"),
    (chat_raw('"top_p": Infinity'), "top_p"),
    (chat_raw('"top_p": NaN'), "top_p"),
    (chat_raw('"seed": 9223372036854775808'), "seed"),  # 2**63: the decoders also seed with 2 * seed + 1
    (chat_raw('"seed": 18446744073709551616'), "seed"),  # 2**64
    (chat_raw('"seed": -1'), "seed"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}', "messages.0.content.0.text"),
    (chat_raw('"stop": ["\\ud800"]'), "stop.0"),
])
def test_values_the_engine_cannot_take_are_400_naming_the_field(sd_server, raw, param):
    url, _ = sd_server
    status, _h, out = post(f"{url}/v1/chat/completions", None, raw=raw)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"
    assert "internal error" not in out["error"]["message"] and "Traceback" not in json.dumps(out)


def test_a_lone_surrogate_in_a_completion_prompt_is_400(sd_server):
    url, _ = sd_server
    status, _h, out = post(f"{url}/v1/completions", None, raw=b'{"prompt": "x\\ud800"}')
    assert status == 400 and out["error"]["param"] == "prompt" and "surrogate" in out["error"]["message"]


def post_big(url: str, body: bytes) -> tuple[int, dict]:
    """POST the head and the body's first KB on a raw socket: the server answers 413 from the
    Content-Length without reading the rest (and closes, so sending all of it would break the pipe)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body[:1024])
        head, _, rest = sock.makefile("rb").read().partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


def test_an_oversized_body_is_413_and_health_keeps_answering(sd_server):
    url, _ = sd_server
    big = json.dumps({"messages": [{"role": "user", "content": "word " * 400_000}]}).encode()  # 2 MB > 1 MB
    status, out = post_big(url, big)
    assert status == 413 and "--max-body-mb" in out["error"]["message"] and out["error"]["code"] == "body_too_large"
    status, _h, health = get(f"{url}/health")
    assert status == 200 and health["limits"]["max_body_mb"] == 1 and health["limits"]["context"] == 4096


def test_a_chunked_body_is_counted_as_it_arrives(sd_server):
    """No Content-Length: the body is counted chunk by chunk; the last of 4 x 300 KB passes 1 MB."""
    import http.client

    host, port = sd_server[0].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    chunks = [b'{"prompt": "' + b"x" * 300_000] + [b"x" * 300_000] * 3
    conn.request("POST", "/v1/completions", body=iter(chunks), headers={"Content-Type": "application/json"}, encode_chunked=True)
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    assert r.status == 413 and out["error"]["code"] == "body_too_large" and "--max-body-mb" in out["error"]["message"]


def test_a_prompt_past_the_context_is_refused_before_it_is_tokenized(sd_server, monkeypatch):
    url, app = sd_server
    api_tokenizer_calls = []
    from ssd_chat.server import app as server_app

    real = server_app.prompt_ids
    monkeypatch.setattr(server_app, "prompt_ids", lambda *a: api_tokenizer_calls.append(1) or real(*a))
    # 4096 tokens x the longest SmolLM2 token (81 characters) < 400,000 characters: cannot fit
    status, _h, out = post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 400_000}]})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded" and "characters" in out["error"]["message"]
    assert api_tokenizer_calls == []
    status, _h, out = post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]})
    assert status == 400 and "tokens" in out["error"]["message"] and api_tokenizer_calls == [1]  # counted exactly


def test_prompts_are_tokenized_off_the_event_loop(sd_server, monkeypatch):
    url, _ = sd_server
    from ssd_chat.server import app as server_app

    threads, real = [], server_app.prompt_ids
    monkeypatch.setattr(server_app, "prompt_ids", lambda *a: threads.append(threading.current_thread().name) or real(*a))
    assert post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 2})[0] == 200
    assert len(threads) == 1 and threads[0].startswith("ssd-tokenize")


def test_the_key_is_checked_before_the_body_is_parsed(loaded):
    app = create_app(engine(loaded), SamplingParams(max_new_tokens=4), api_key="sesame")
    with running(app) as url:
        for raw in (b'{"messages": [', b"[1, 2]", b'{"messages": []}'):
            status, _h, out = post(f"{url}/v1/chat/completions", None, raw=raw)
            assert status == 401 and out["error"]["code"] == "invalid_api_key", out
        status, _h, out = post(f"{url}/v1/chat/completions", None, raw=b'{"messages": [', headers={"Authorization": "Bearer sesame"})
        assert status == 400


def ssd_engine(loaded) -> Engine:
    target, draft = loaded
    return Engine(EngineConfig(target=target.name, mode="ssd", draft="layers:1"), target, draft)


def kill_speculator(e: Engine) -> int:
    pid = e.decoder().worker_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30)
    return pid


def ask_mode(url: str, **extra) -> tuple[int, str | None]:
    status, _h, out = post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 6, "temperature": 0, **extra})
    return status, out.get("ssd_stats", {}).get("mode") if status == 200 else None


def test_requests_that_break_the_speculator_do_not_disable_ssd(loaded):
    """Three failures, each followed by a reply the restarted speculator serves: SSD stays on (the
    restart budget counts failures in a row, not in the server's life)."""
    e = ssd_engine(loaded)
    app = create_app(e, SamplingParams(max_new_tokens=8))
    with running(app) as url:
        for bad in ('"temperature": 1e999', '"seed": 18446744073709551616', '"top_p": NaN'):
            assert post(f"{url}/v1/chat/completions", None, raw=chat_raw(bad))[0] == 400  # never reaches the speculator
        assert ask_mode(url) == (200, "ssd")
        for _ in range(3):
            kill_speculator(e)
            assert ask_mode(url) == (200, "sd")  # this reply goes on without it
            assert ask_mode(url) == (200, "ssd")  # the next one has a fresh speculator
        status, _h, health = get(f"{url}/health")
        assert status == 200 and health["status"] == "ok" and "reason" not in health


def test_health_says_degraded_when_ssd_is_given_up(loaded):
    e = ssd_engine(loaded)
    app = create_app(e, SamplingParams(max_new_tokens=8))
    with running(app) as url:
        assert get(f"{url}/health")[2]["status"] == "ok"
        e.decoder().max_restarts = 0
        kill_speculator(e)
        assert ask_mode(url) == (200, "sd")
        status, _h, health = get(f"{url}/health")
        assert status == 200 and health["status"] == "degraded" and health["mode"] == "ssd"
        assert "speculator" in health["reason"] and "as SD" in health["reason"]
        assert ask_mode(url) == (200, "sd")  # still answering, as SD
        from ssd_chat.server.client import model_card

        assert model_card(url)["id"] == e.config.target  # `ask` still uses it: the replies are exact, only slower
