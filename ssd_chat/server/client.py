"""``ssd-chat ask`` through a running ``ssd-chat serve`` instead of loading the models again.

``serve`` leaves one state file per server, ``<data dir>/servers/<pid>.json`` with its URL, pid
and model, and removes it when it exits.  ``ask`` (unless ``--no-server``) uses such a server
when it is alive (its pid exists and ``/health`` answers), serves the same target, and runs
with the engine options the user set (command line, environment or config file; options left
at their defaults take the server's).  A mode the user set that differs from the server's is
asked for per request (``ssd_mode``) when the server's draft allows it.  Anything else, and
``ask`` loads the models itself exactly as without a server.  ``--server URL`` names a server
instead of looking; then a mismatch is an error rather than a reason to load locally.

Requests go out with the standard library's HTTP client, and nothing here imports torch (of the
engine, only its settings class): ``ask`` through a server does not import torch.  The key for a
server started with ``--api-key`` comes from ``SSD_CHAT_API_KEY``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..engine import processes  # process helpers, without importing torch
from ..engine import EngineConfig  # the engine's settings, without importing torch

KEY_ENV = "SSD_CHAT_API_KEY"


class ServerError(Exception):
    """The server could not be used; ``status`` is the HTTP status when it answered."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param
        self.started = False  # set when part of the reply was already printed


# -- the state files ------------------------------------------------------------------------------
def servers_dir() -> Path:
    from ..history.store import data_dir

    return data_dir() / "servers"


def write_state(url: str, model_id: str, auth: bool) -> Path:
    path = servers_dir() / f"{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "model": model_id, "auth": auth, "started": time.time()}))
    tmp.replace(path)  # readers never see half a file
    return path


def remove_state(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()



def local_servers() -> list[dict[str, Any]]:
    """State files of servers whose process still exists, newest first (stale ones are removed)."""
    out = []
    folder = servers_dir()
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []:
        try:
            state = json.loads(path.read_text())
            pid, url = int(state["pid"]), str(state["url"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not processes.pid_alive(pid):
            remove_state(path)
            continue
        out.append({**state, "pid": pid, "url": url})
    return out


# -- talking to a server --------------------------------------------------------------------------
def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    headers = {"Content-Type": "application/json"}
    if os.environ.get(KEY_ENV):
        headers["Authorization"] = f"Bearer {os.environ[KEY_ENV]}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - a URL the user gave or our own state file
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read())["error"]
            raise ServerError(err["message"], e.code, err.get("code"), err.get("param")) from None
        except (ValueError, KeyError, TypeError):
            raise ServerError(f"HTTP {e.code} {e.reason}", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"cannot reach {url} ({reason})") from None


def model_card(base_url: str, timeout: float = 5.0) -> dict[str, Any]:
    """The served model's card (``/v1/models``), after ``/health`` says the server is up."""
    with _request(f"{base_url}/health", timeout=timeout) as r:
        if json.loads(r.read()).get("status") not in ("ok", "degraded"):  # degraded (SSD given up) still answers exactly
            raise ServerError(f"the server at {base_url} is shutting down")
    with _request(f"{base_url}/v1/models", timeout=timeout) as r:
        return json.loads(r.read())["data"][0]


def _same_target(a: str, b: str) -> bool:
    if a == b:
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b)


def mismatch(card: dict[str, Any], values: dict[str, Any], explicit: set[str]) -> tuple[str | None, str | None]:
    """(why this server cannot answer as the user asked, or None; the ssd_mode to ask for, or None)."""
    ssd = card.get("ssd", {})
    cfg = ssd.get("config", {})
    if not _same_target(str(values.get("target")), str(cfg.get("target"))):
        return f"it serves '{cfg.get('target')}', not '{values.get('target')}'", None
    for key in (f.name for f in fields(EngineConfig)):
        if key in ("target", "mode") or key not in explicit or values.get(key) is None:
            continue
        if key == "draft" and values.get("mode", ssd.get("mode")) == "ar":
            continue
        if values[key] != cfg.get(key):
            return f"it runs {key.replace('_', '-')} {cfg.get(key)}, not {values[key]}", None
    mode = values.get("mode")
    if "mode" in explicit and mode != ssd.get("mode"):
        if mode not in ssd.get("modes", ()):
            return f"it runs mode {ssd.get('mode')} and cannot switch to {mode}", None
        return None, mode
    return None, None


@dataclass
class Server:
    url: str
    card: dict[str, Any]
    ssd_mode: str | None
    pid: int | None = None


def find(url: str | None, no_server: bool, values: dict[str, Any], explicit: set[str]) -> Server | None:
    """The server ``ask`` should use, or None to load the models here."""
    if no_server:
        return None
    if url:
        base = url.rstrip("/").removesuffix("/v1")
        card = model_card(base)
        why, mode = mismatch(card, values, explicit)
        if why is not None:
            raise ServerError(f"the server at {base} cannot answer this: {why}", 400)
        return Server(base, card, mode)
    for state in local_servers():
        if state.get("auth") and not os.environ.get(KEY_ENV):
            continue
        try:
            card = model_card(state["url"], timeout=2.0)
        except ServerError:
            continue
        why, mode = mismatch(card, values, explicit)
        if why is None and card.get("id") == state.get("model"):
            return Server(state["url"], card, mode, state["pid"])
    return None


def _events(resp: Any):
    """The JSON objects of a server-sent-events stream, up to ``data: [DONE]``."""
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class _Streamed:
    """A streamed reply as it arrives: printed unless ``--json``, kept for the summary."""

    def __init__(self, json_out: bool) -> None:
        self.json_out = json_out
        self.text, self.ids, self.final = "", [], None

    def read(self, resp: Any, url: str) -> None:
        try:
            for chunk in _events(resp):
                if "error" in chunk:
                    if self.text and not self.json_out:
                        sys.stdout.write("\n")
                    raise ServerError(chunk["error"].get("message", "the reply failed"), 500)
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content") or ""
                    self.ids += choice.get("token_ids") or []
                    self.text += delta
                    if delta and not self.json_out:
                        sys.stdout.write(delta)
                        sys.stdout.flush()
                    if choice.get("finish_reason"):
                        self.final = chunk
        except (OSError, ValueError) as e:
            raise ServerError(f"the server at {url} broke off the reply ({e})") from None


def answer(server: Server, prompt: str, values: dict[str, Any], explicit: set[str], json_out: bool,
           stats_line: Callable[[Any], str] | None) -> int:
    """Stream one reply from ``server`` the way ``ask`` prints a local one; the exit status."""

    messages = ([{"role": "system", "content": values["system"]}] if values.get("system") else []) + [{"role": "user", "content": prompt}]
    sampling = values["sampling"]
    body: dict[str, Any] = {"model": server.card["id"], "messages": messages, "stream": True, "return_token_ids": True,
                            "stream_options": {"include_usage": True}, "max_tokens": sampling.max_new_tokens}
    body.update({k: v for k, v in sampling.choices().items() if k != "max_new_tokens"})  # the server's where none was chosen
    if server.ssd_mode:
        body["ssd_mode"] = server.ssd_mode
    try:
        resp = _request(f"{server.url}/v1/chat/completions", body, timeout=None)
    except ServerError as e:
        if e.code != "context_length_exceeded" or e.param != "max_tokens" or "max_new_tokens" in explicit:
            raise
        body.pop("max_tokens")  # like a local reply: the default budget is cut to what fits the context
        resp = _request(f"{server.url}/v1/chat/completions", body, timeout=None)
    reply = _Streamed(json_out)
    with resp:
        try:
            reply.read(resp, server.url)
        except ServerError as e:
            e.started = bool(reply.text)
            raise
    text, ids, final = reply.text, reply.ids, reply.final
    if final is None:
        raise ServerError(f"the server at {server.url} ended the reply without finishing it")
    s = final.get("ssd_stats") or {}
    if json_out:
        from ..chat.stats import STATS_SHOWN

        # the keys and order of a local answer's (cli._answer), and where it came from
        out = {"text": text, "token_ids": ids, "mode": s.get("mode"), "mode_label": s.get("mode_label"), "mode_reason": s.get("mode_reason"),
               "target": server.card["ssd"]["config"]["target"], "draft": s.get("draft"), "forward": s.get("forward"),
               "draft_forward": s.get("draft_forward"), "precision": s.get("precision"),
               # the engine's reason ("eos"), not OpenAI's ("stop" for an EOS too)
               "finish_reason": s.get("reason") or final["choices"][0]["finish_reason"], "sampling": s.get("sampling"),
               "stats": {k: s.get(k) for k in STATS_SHOWN}, "server": server.url}
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    if stats_line is not None:
        # the figures `format_stats` reads off an engine Stats (not imported: that would import torch)
        st = SimpleNamespace(mode=s.get("mode", "?"), label=s.get("mode_label") or str(s.get("mode", "?")).upper(), new_tokens=s.get("new_tokens", len(ids)), tok_per_s=s.get("tok_per_s"),
                             ttft_s=s.get("ttft_s"), acceptance_rate=s.get("acceptance_rate"),
                             mean_accepted_length=s.get("mean_accepted_length"), cache_hit_rate=s.get("cache_hit_rate"))
        print(stats_line(st), file=sys.stderr)
    note = length_note(final["choices"][0]["finish_reason"], s.get("new_tokens", len(ids)), body.get("max_tokens"))
    if note:
        print(note, file=sys.stderr)
    return 0


def length_note(reason: str | None, new_tokens: int | None, max_new_tokens: int | None) -> str | None:
    """One stderr line when the reply was cut at --max-new-tokens (``finish_reason`` "length"), not at EOS or a stop."""
    if reason != "length" or not max_new_tokens or (new_tokens or 0) < max_new_tokens:
        return None
    return f"ssd-chat: stopped at --max-new-tokens {max_new_tokens}; raise -n for more"


def explicit_keys(cli_values: dict[str, Any]) -> set[str]:
    """The settings the user chose (command line, environment or config file), not defaults."""
    from ..chat import settings as config

    _values, sources = config.resolve(cli_values)
    return {k for k, src in sources.items() if src != "default"}


def ask_via_server(url: str | None, no_server: bool, cli_values: dict[str, Any], values: dict[str, Any], prompt: str,
                   json_out: bool, stats_line: Callable[[Any], str] | None) -> int | None:
    """``ask`` through a server: its exit status, or None when the models should load here.

    A server that was found (not named) and fails before the reply starts is passed over with a
    note on stderr; once text has been printed, or with ``--server``, a failure is an error."""
    explicit = explicit_keys(cli_values)
    try:
        server = find(url, no_server, values, explicit)
    except ServerError as e:
        print(f"ssd-chat: error: {e}", file=sys.stderr)
        return 2 if e.status == 400 else 1
    if server is None:
        return None
    if url is None:
        mode = server.ssd_mode or server.card["ssd"]["mode"]
        print(f"ssd-chat: using the ssd-chat server at {server.url} (pid {server.pid}: {server.card['id']}, {mode}); "
              "--no-server loads the models here instead", file=sys.stderr)
    try:
        return answer(server, prompt, values, explicit, json_out, stats_line)
    except ServerError as e:
        if url is None and not e.started:
            print(f"ssd-chat: the server at {server.url} could not answer ({e}); loading the models here", file=sys.stderr)
            return None
        print(f"ssd-chat: error: {e}", file=sys.stderr)
        return 2 if e.status == 400 else 1
    except KeyboardInterrupt:  # closing the connection cancels the reply on the server
        if not json_out:
            sys.stdout.write("\n")
        sys.stdout.flush()
        return 130
