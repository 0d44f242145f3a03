"""A local stand-in for the Hugging Face hub's HTTP endpoints that ``ssd-chat models pull`` uses (model info,
auth check, tree listing, file HEAD/GET), serving files from memory; point ``HF_ENDPOINT`` at it.  Never the
network.  ``gated`` repos answer 403 with the hub's gated error code; ``delay`` slows every file body down
(a pull long enough to interrupt).  Run as a script it serves one repo until killed (for trying it in tmux)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "c" * 40


class Hub:
    def __init__(self, repos: dict[str, dict[str, bytes]], gated: set[str] = frozenset(), delay: float = 0.0):
        self.repos, self.gated, self.delay = repos, set(gated), delay
        self.gets: list[str] = []
        self.ranges: list[tuple[str, int]] = []  # (file, first byte sent): a resumed GET starts past 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub.answer(self, head=True)

            def do_GET(self):
                hub.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Hub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _json(self, h, body, status=200):
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _refuse(self, h, status, code, message):
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def answer(self, h, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        repo = next((r for r in self.repos if f"/{r}/" in path + "/"), None)
        if repo is None:
            return self._refuse(h, 404, "RepoNotFound", "Repository not found")
        files = self.repos[repo]
        if repo in self.gated and (path.endswith("/auth-check") or "/resolve/" in path):
            return self._refuse(h, 403, "GatedRepo", "Access to this model is restricted")
        if path.startswith("/api/models/"):
            rest = path[len(f"/api/models/{repo}"):]
            if rest == "/auth-check":
                return self._json(h, {})
            if rest.startswith("/tree/"):
                return self._json(h, [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                      for f, b in files.items()])
            return self._json(h, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "gated": repo in self.gated,
                                  "siblings": [{"rfilename": f, "size": len(b)} for f, b in files.items()]})
        name = path.split("/resolve/", 1)[1].split("/", 1)[1] if "/resolve/" in path else ""
        if name not in files:
            return self._refuse(h, 404, "EntryNotFound", "Entry not found")
        body = files[name]
        etag = hashlib.sha1(body).hexdigest()
        start = 0
        ranged = h.headers.get("Range", "")
        if not head and ranged.startswith("bytes=") and ranged.endswith("-"):
            start = int(ranged[len("bytes="):-1])
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{etag}"')
        h.send_header("Content-Length", str(len(body) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        h.end_headers()
        if head:
            return
        self.gets.append(name)
        self.ranges.append((name, start))
        body = body[start:]
        for i in range(0, len(body), 1 << 16):
            if self.delay:
                time.sleep(self.delay)
            try:
                h.wfile.write(body[i:i + (1 << 16)])
            except OSError:
                return


if __name__ == "__main__":  # python tests/hub_server.py: a slow 40 MB repo for trying a pull by hand
    import sys

    repo = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
    with Hub({repo: {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": b"\0" * 40_000_000}},
             delay=float(sys.argv[2]) if len(sys.argv) > 2 else 0.02) as hub:
        print(hub.url, flush=True)
        threading.Event().wait()
