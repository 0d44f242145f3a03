"""Helpers for the server tests: a real uvicorn server on a loopback port, requests and streams."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

from ssd_chat.engine import Engine, EngineConfig

MSG = [{"role": "user", "content": "What is the capital of France?"}]


@contextlib.contextmanager
def running(app):
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 60)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def wait_until(predicate, timeout: float = 60.0, step: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(step)


def post(url: str, body, headers: dict | None = None, raw: bytes | None = None, timeout: float = 120):
    """(status, headers, parsed JSON body) of a POST, errors included."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    return _send(req, timeout)


def get(url: str, headers: dict | None = None, timeout: float = 60):
    return _send(urllib.request.Request(url, headers=headers or {}), timeout)


def _send(req, timeout):
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            status, hdrs = r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        body, status, hdrs = e.read(), e.code, dict(e.headers)
    try:
        return status, hdrs, json.loads(body)
    except ValueError:
        return status, hdrs, body.decode("utf-8", "replace")


def open_stream(base: str, body: dict) -> tuple[socket.socket, "socket.SocketIO"]:
    """A raw streaming POST on its own socket, so a test can hang up mid-reply; returns (sock, reader)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock, sock.makefile("rb")


def read_data_events(reader, n: int) -> list[str]:
    """The next ``n`` ``data:`` payloads from a raw event stream (chunked framing lines skipped)."""
    out = []
    while len(out) < n:
        line = reader.readline()
        if not line:
            break
        line = line.decode().strip()
        if line.startswith("data: "):
            out.append(line[6:])
    return out


def engine(loaded, mode="sd", with_draft=True) -> Engine:
    """An engine over the (target, draft) of the ``server_models`` fixture."""
    target, draft = loaded
    return Engine(EngineConfig(target=target.name, mode=mode, draft="layers:1" if with_draft else None), target,
                  draft if with_draft else None)


def client(url: str, **kw):
    """The official ``openai`` client of the server at ``url``."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=300, **kw)
