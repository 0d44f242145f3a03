"""``ssd-chat serve``: the command-line side of :mod:`server` (options, binding, the state file)."""


import contextlib
import logging
import os
import socket
import sys
from typing import Annotated, Any, Optional

import typer

from .options import engine_options, fail, settings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket, before any model loads: a taken port fails in a second, not after minutes."""
    family, kind, proto, _name, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _url(host: str, port: int) -> str:
    """The URL a local client uses (a wildcard address is reached through loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _say(line: str) -> None:
    """A line on stderr, where a closed terminal (SIGHUP) must not turn the drain into a traceback."""
    with contextlib.suppress(OSError):
        typer.echo(line, err=True)


@engine_options(exclude=("system",))  # a request brings its own
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on. 127.0.0.1 keeps it to this machine; 0.0.0.0 opens it to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="TCP port (0: any free one; the URL is printed).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="SSD_CHAT_API_KEY", help="Require 'Authorization: Bearer KEY' on every endpoint but /health.", show_default=False)] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="Requests that may wait behind the one decoding; more are refused with 429.")] = 16,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", min=0.001, max=1024, help="Largest request body in MB; larger ones are refused with 413.")] = 8.0,
    ignore_tools: Annotated[bool, typer.Option("--ignore-tools", help="When the model's chat template has no tool support, answer requests that offer tools in text (a log line says so) instead of refusing them with 400.")] = False,
    *, given: dict[str, Any],
) -> None:
    """Serve the engine over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /metrics, /health, /openapi.json); sampling options are the defaults for requests that leave them out.

    One request decodes at a time; the others wait in order. SIGTERM, SIGHUP or Ctrl-C finishes the reply being decoded, refuses the waiting ones, and exits. See docs/serve.md."""
    from ..chat.loading import load_engine
    from ..chat.settings import engine_config
    from ..engine import SSDChatError, resolve_model

    values = settings(given)  # the sampling settings checked: the model's own defaults join after it loads
    try:
        resolve_model(engine_config(values).target)  # a wrong name is refused before the server's imports (torch)
    except SSDChatError as e:
        raise fail(e) from None
    from ..server.app import create_app
    from ..server.app import serve as run_server
    from ..server.client import remove_state, write_state

    if max_body_mb != max_body_mb:  # NaN passes click's range check
        raise typer.BadParameter("must be a number", param_hint="--max-body-mb")
    if api_key is not None and not api_key.strip():
        raise typer.BadParameter("must not be empty", param_hint="--api-key")
    try:
        sock = _bind(host, port)
    except OSError as e:
        raise fail(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if host not in LOOPBACK and not host.startswith("127."):
        typer.echo(f"ssd-chat: warning: listening on {host}: anyone who can reach this machine can use the model"
                   + ("" if api_key else " (set --api-key to require a key)") + "; the default 127.0.0.1 keeps it local", err=True)
    from ..engine import threads

    n = threads.coordinator()  # this thread runs the HTTP server: no OpenMP pool here (engine/threads.py)

    def load_and_start():
        engine = load_engine(values, measure="background", log_stages=True)
        engine.decoder()  # SSD: the speculator starts loading its draft now, not at the first request
        return engine

    try:
        engine = threads.call(n, load_and_start)
    except SSDChatError as e:
        sock.close()
        raise fail(e) from None
    except KeyboardInterrupt:
        # The load has unwound, but torch's C++ threads may still hold state that its exit-time
        # destructors abort on ("terminate called ..."): leave at once; workers die with us
        # (PR_SET_PDEATHSIG, engine/processes.py).
        sock.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    url = _url(host, sock.getsockname()[1])
    state = []
    cfg = engine.config
    from ..engine import default_draft

    desc = cfg.mode + (f", draft {cfg.draft or default_draft(cfg.target)}, k={cfg.k}" if engine.draft is not None and cfg.mode != "ar" else "")

    def ready() -> None:
        state.append(write_state(url, cfg.target, api_key is not None))
        typer.echo(f"ssd-chat: serving {cfg.target} ({desc}) at {url}/v1 - Ctrl-C to stop", err=True)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ssd-chat: %(message)s"))
    log = logging.getLogger("ssd_chat.server")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    def stopping() -> None:
        for path in state:  # `ask` stops choosing this server now
            remove_state(path)
        _say("ssd-chat: stopping: finishing the reply in progress")

    try:
        defaults = values["sampling"].over(engine.sampling_defaults)  # the model's own where the user set none
        app_ = create_app(engine, defaults, api_key=api_key, max_queue=max_queue, on_ready=ready,
                          max_body_mb=max_body_mb, ignore_tools=ignore_tools)
        run_server(app_, sock, on_signal=stopping)
    except KeyboardInterrupt:  # before the server took Ctrl-C over (from then on it stops the server: exit 0)
        raise typer.Exit(130) from None
    finally:
        for path in state:
            remove_state(path)
        engine.close()
    _say("ssd-chat: stopped")
