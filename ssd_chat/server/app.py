"""``ssd-chat serve``: one engine behind an OpenAI-compatible HTTP API.

Built on FastAPI over uvicorn.  FastAPI because request bodies become pydantic models checked
strictly before any handler runs (every bad field turns into one 400 with the field named), it
streams server-sent events through Starlette's ``StreamingResponse`` and notices a client that
hangs up, and it is what vLLM's, SGLang's and llama-cpp-python's OpenAI servers are written
with, so behaviour matches theirs where clients notice.  uvicorn because it is the reference
ASGI server and on SIGTERM stops accepting, lets in-flight responses finish, then runs the
app's shutdown: exactly the drain a server restart needs.

Threads: the event loop only parses and queues; the engine runs on one thread of its own
(:mod:`server_worker`), one request at a time.  Prompts are tokenized on one more thread, with a
private copy of the tokenizer (a fast tokenizer must not be used by two threads at once), so a
long prompt never stops the loop from answering /health.  Limits: :mod:`server_limits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import prompt_ids, SamplingParams
from .logprobs import TokenTexts
from .limits import DEFAULT_MAX_BODY_MB, Guard, check_prompt_chars, max_token_chars, too_large
from .metrics import CONTENT_TYPE, ServerMetrics
from .reply import OpenAIReply
from .schema import APIError, ChatRequest, CompletionRequest, describe_validation, error_body
from .tools import template_supports_tools
from .engine_thread import END, EngineWorker, Job, QueueFull, ShuttingDown

log = logging.getLogger("ssd_chat.server")
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


def create_app(engine: Any, defaults: SamplingParams, *, model_id: str | None = None, api_key: str | None = None,
               max_queue: int = 16, on_ready: Callable[[], None] | None = None, max_body_mb: float = DEFAULT_MAX_BODY_MB,
               ignore_tools: bool = False) -> FastAPI:
    """The ASGI app over a loaded engine; ``app.state.worker`` is its engine thread."""
    model_id = model_id or engine.config.target
    worker = EngineWorker(engine, ServerMetrics(model_id), max_queue)
    api = _API(engine, worker, defaults, model_id, ignore_tools)
    limits = {"max_body_mb": max_body_mb, "max_queue": max_queue, "context": api.context or None}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield
        await asyncio.to_thread(worker.close)  # stops the engine thread and SSD's speculator
        api.tokenizing.shutdown(wait=False, cancel_futures=True)

    # the schema is how API tools (client generators, fuzzers) find the endpoints; behind the key like the rest
    app = FastAPI(title="ssd-chat", version="1", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.worker = worker
    app.add_middleware(Guard, api_key=api_key, max_body_mb=max_body_mb)

    @app.get("/health")
    async def health() -> JSONResponse:
        # degraded: still answering, but not in the mode it was started for (200, as it serves)
        why = None if worker.closing else worker.degraded()
        status = "draining" if worker.closing else "degraded" if why else "ok"
        body = {"status": status, "model": model_id, "mode": engine.config.mode, "running": 1 if worker.running else 0,
                "waiting": worker.waiting, "limits": limits}
        return JSONResponse({**body, "reason": why} if why else body, status_code=503 if worker.closing else 200)

    router = APIRouter()
    router.add_api_route("/v1/models", api.list_models, methods=["GET"])
    router.add_api_route("/v1/models/{name:path}", api.get_model, methods=["GET"])
    router.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    router.add_api_route("/v1/completions", api.completions, methods=["POST"])
    router.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.include_router(router)

    @app.exception_handler(APIError)
    async def on_api_error(_r: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(_r: Request, e: RequestValidationError) -> JSONResponse:
        message, param = describe_validation(list(e.errors()))
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        message = too_large(max_body_mb) if e.status_code == 413 else str(e.detail)
        return JSONResponse(error_body(e.status_code, message, code="body_too_large" if e.status_code == 413 else None),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def on_bug(_r: Request, e: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(e).__name__, e)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

    return app


class _API:
    """The request handlers: validate, tokenize, queue, then answer from the job's events."""

    def __init__(self, engine: Any, worker: EngineWorker, defaults: SamplingParams, model_id: str, ignore_tools: bool = False) -> None:
        self.engine, self.worker, self.defaults, self.model_id = engine, worker, defaults, model_id
        self.ignore_tools = ignore_tools
        try:
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared (slow tokenizers are pure Python)
            self.tokenizer = engine.tokenizer
        self.context = int(getattr(engine.target.model.config, "max_position_embeddings", 0) or 0)
        self.token_chars = max_token_chars(self.tokenizer)
        # read once: from here on only the tokenizing thread uses the tokenizer
        self.vocab = len(self.tokenizer.get_vocab()) if hasattr(self.tokenizer, "get_vocab") else None
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="ssd-tokenize")  # one thread: one tokenizer user
        self.tools_ok = template_supports_tools(self.tokenizer)
        self.token_texts = TokenTexts(self.tokenizer)  # logprobs' token strings, read on the event loop
        self.created = int(time.time())

    # -- models and metrics ------------------------------------------------------------------
    def model_card(self) -> dict[str, Any]:
        from ..engine import default_draft

        cfg, draft = self.engine.config, self.engine.draft
        config = {k: getattr(cfg, k) for k in ("target", "draft", "mode", "k", "target_device", "draft_device", "dtype",
                                               "fan_out", "budget", "saguaro_c", "fallback", "compile", "trust_remote_code")}
        if draft is not None and cfg.draft is None:
            config["draft"] = default_draft(cfg.target)  # the setting that chose it, as `ask --draft` would name it
        info = {"mode": cfg.mode, "modes": self.worker.modes(), "draft": draft.name if draft is not None else None,
                "k": cfg.k, "context": self.context or None, "config": config}
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "ssd-chat", "ssd": info}

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    async def get_model(self, name: str) -> dict[str, Any]:
        self._check_model(name)
        return self.model_card()

    async def metrics(self) -> Response:
        return Response(self.worker.metrics.render(), media_type=CONTENT_TYPE)

    # -- completions -------------------------------------------------------------------------
    async def chat_completions(self, req: ChatRequest, request: Request) -> Response:
        req.check_supported()
        self._check_model(req.model)
        tools, headers = self._tools(req)
        messages = req.chat()
        check_prompt_chars(sum(len(m["content"] or "") for m in messages), self.context, self.token_chars, "messages")
        ids, extra_stop = await self._tokenize(prompt_ids, self.tokenizer, messages, tools)
        names = {t["function"]["name"] for t in tools} if tools else None
        return await self._answer(req, request, ids, extra_stop, chat_api=True, tools=names, headers=headers)

    def _tools(self, req: ChatRequest) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
        """The tools to show the model, and a header saying they were not shown: tool_choice "none",
        or a template without tools under --ignore-tools; else a 400 that says why."""
        if not req.tools:
            return None, {}
        if req.tool_choice == "none":
            return None, {"X-SSD-Chat-Tools": "not shown: tool_choice is none"}
        if self.tools_ok:
            return [t.model_dump(exclude_none=True) for t in req.tools], {}
        if self.ignore_tools:
            log.info("tools offered, not shown: %s's chat template has no tool support (--ignore-tools)", self.model_id)
            return None, {"X-SSD-Chat-Tools": "ignored: the chat template has no tool support (serve --ignore-tools)"}
        raise APIError(400, f"tools are not supported by {self.model_id}: its chat template cannot show them to the model. "
                            "Send tool_choice \"none\" (or no tools), or start the server with --ignore-tools to answer in text", "tools")

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        req.check_supported()
        self._check_model(req.model)
        prompt = req.text_or_ids()
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), self.context, self.token_chars, "prompt")
            ids = list((await self._tokenize(self.tokenizer, prompt))["input_ids"])
        else:
            vocab = self.vocab
            if vocab is not None and any(not 0 <= i < vocab for i in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
            ids = list(prompt)
        echo = None
        if req.echo:
            echo = prompt if isinstance(prompt, str) else await self._tokenize(self.tokenizer.decode, ids)
        return await self._answer(req, request, ids, (), chat_api=False, echo=echo)

    async def _tokenize(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
            raise APIError(404, f"the model '{name}' does not exist: this server serves '{self.model_id}'", "model", "model_not_found")

    def _max_new(self, num_prompt: int, wanted: int | None, prompt_param: str) -> int:
        ctx = self.context
        if num_prompt == 0:
            raise APIError(400, "the prompt is empty", prompt_param)
        if ctx and num_prompt >= ctx:
            raise APIError(400, f"the prompt is {num_prompt} tokens but the model's context is {ctx} tokens", prompt_param, "context_length_exceeded")
        if wanted is None:
            return min(self.defaults.max_new_tokens, ctx - num_prompt) if ctx else self.defaults.max_new_tokens
        if ctx and num_prompt + wanted > ctx:
            raise APIError(400, f"the model's context is {ctx} tokens: the prompt's {num_prompt} plus max_tokens {wanted} do not fit "
                                f"(at most {ctx - num_prompt})", "max_tokens", "context_length_exceeded")
        return wanted

    async def _answer(self, req: ChatRequest | CompletionRequest, request: Request, ids: list[int], extra_stop: tuple[str, ...],
                      chat_api: bool, tools: set[str] | None = None, headers: dict[str, str] | None = None,
                      echo: str | None = None) -> Response:
        max_new = self._max_new(len(ids), req.wanted_tokens, "messages" if chat_api else "prompt")
        try:
            params = req.sampling(self.defaults, max(max_new, 1), extra_stop)
        except ValueError as e:  # ParamError: a setting out of range
            raise APIError(400, str(e)) from None
        mode = req.ssd_mode or self.engine.config.mode
        why = self.worker._check_mode(mode)
        if why is not None:
            raise APIError(400, why, "ssd_mode")
        top = req.top_wanted()
        job = Job(ids, params, mode, asyncio.get_running_loop(), prompt_logprobs=top if echo is not None else None, generate=max_new > 0)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {self.worker.max_queue} requests are already waiting; retry in {e.retry_after_s} s",
                           code="queue_full", headers={"Retry-After": str(e.retry_after_s)}) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        reply = OpenAIReply(self, job, req, chat_api, tools, echo)
        try:
            first = await reply.next()  # waits for its turn; errors before any token are a plain HTTP error
        except BaseException:
            watcher.cancel()
            job.stop.set()
            raise
        if first is END:  # the client hung up while the request waited: nobody to answer
            watcher.cancel()
            return Response(status_code=204)
        if not req.stream:
            try:
                return JSONResponse(await reply.whole(first), headers=headers)
            finally:
                watcher.cancel()
        return EventSourceResponse(reply.sse(first, watcher), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job (at the engine's next round) when the client hangs up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.stop.set()


# -- running it ---------------------------------------------------------------------------------
class _DrainingServer(uvicorn.Server):
    """uvicorn, plus: the first SIGTERM/SIGINT/SIGHUP also refuses queued requests (503) so that only the
    reply being decoded is finished; the process then exits 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._worker, self._on_signal = worker, on_signal
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            self._on_signal()
            if self._loop is not None:  # not from inside the signal handler: the loop may hold the worker's lock
                self._loop.call_soon_threadsafe(self._worker.drain)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        # SIGHUP (the terminal closed, or a supervisor's reload) drains too: its default would kill the
        # process mid-stream, with no [DONE] and the state file left behind
        old = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def serve(app: FastAPI, sock: socket.socket, on_signal: Callable[[], None] = lambda: None) -> None:
    """Serve ``app`` on the bound socket until SIGTERM/SIGINT/SIGHUP; the engine is closed on return."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=None)
    server = _DrainingServer(config, app.state.worker, on_signal)
    main = threading.current_thread() is threading.main_thread()
    # ours from the start: asyncio.run puts its own SIGINT handler (it cancels the startup) over Python's default only
    previous = signal.signal(signal.SIGINT, server.handle_exit) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        app.state.worker.close()
