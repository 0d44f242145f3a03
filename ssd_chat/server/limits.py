"""The server's limits, checked before work is spent on a request.

* The API key, before the body is read: a client without the key learns nothing else (401
  even for a malformed body).
* The body's size (``--max-body-mb``): a 20 MB upload is refused with 413 before it is read
  (or, sent in chunks, as soon as it passes the limit), never parsed.
* The prompt's length, before it is tokenized: a text of more than ``context`` x (the longest
  token's length in characters) characters cannot fit in the context whatever it says, so it
  is refused without tokenizing it; a shorter one is tokenized (off the event loop) and
  counted exactly.
"""

from __future__ import annotations

import secrets
from typing import Any

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .schema import APIError, error_body

DEFAULT_MAX_BODY_MB = 8.0
FALLBACK_TOKEN_CHARS = 64  # a tokenizer that does not list its vocabulary: a generous bound


class Guard:
    """ASGI middleware, before anything else runs (FastAPI reads and parses the body before a
    route's dependencies): the key on every path but /health (401), then the body's size (413,
    from Content-Length at once, or counted as a chunked body arrives).  Not FastAPI's
    ``max_body_size``: its 413 is plain text, and an OpenAI client expects an error object."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_mb: float) -> None:
        self.app, self.key = app, api_key.encode() if api_key is not None else None
        self.max_body_mb, self.max_bytes = max_body_mb, int(max_body_mb * 2**20)

    def allowed(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.key or b"")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.key is not None and scope["path"] != "/health" and not self.allowed(headers):
            body = error_body(401, "missing or incorrect API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await JSONResponse(self.too_large(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, "too large")  # answered by the app's handler, as too_large()
            return message

        await self.app(scope, counted, send)

    def too_large(self) -> dict[str, Any]:
        return error_body(413, too_large(self.max_body_mb), code="body_too_large")


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token stands for (a byte-level BPE lists each token as one
    character per byte, so this bounds bytes as well)."""
    try:
        return max(FALLBACK_TOKEN_CHARS // 8, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - no vocabulary to read
        return FALLBACK_TOKEN_CHARS


def check_prompt_chars(chars: int, context: int, token_chars: int, param: str) -> None:
    """A prompt of ``chars`` characters that cannot fit in ``context`` tokens: 400, untokenized."""
    if context and chars > context * token_chars:
        raise APIError(400, f"the prompt is {chars} characters, more than the model's context of {context} tokens can hold "
                            f"(a token here is at most {token_chars} characters)", param, "context_length_exceeded")


def too_large(max_body_mb: float) -> str:
    return f"the request body is larger than this server's limit of {max_body_mb:g} MB (serve --max-body-mb)"
