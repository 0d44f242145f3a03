"""One request's answer over HTTP: the job's events as OpenAI's chat or completion response,
whole or as server-sent events (with tool calls read from the text when tools were shown)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.sse import format_sse_event

from . import tools as server_tools
from ..engine import Done, Error, Notice, Token
from ..chat.stats import SAMPLING_SHOWN
from .schema import APIError, ChatRequest, CompletionRequest, error_body
from .logprobs import CompletionLogprobs, chat_content
from .engine_thread import END, Job, PromptLogprobs, ShuttingDown


class OpenAIReply:
    """One request's answer, built from its job's events (OpenAI's chat or completion shape).
    ``tools``: the names of the tools the model was shown; its calls are read from the text."""

    def __init__(self, api: Any, job: Job, req: ChatRequest | CompletionRequest, chat_api: bool, tools: set[str] | None = None,
                 echo: str | None = None) -> None:
        self.api, self.job, self.req, self.chat_api, self.tools = api, job, req, chat_api, tools
        self.echo = echo  # a completion's echoed prompt text, or None
        self.logprobs = req.top_wanted() is not None
        self.legacy = CompletionLogprobs(api.token_texts) if self.logprobs and not chat_api else None
        self.prompt_lps: list[Any] | None = None
        self.id = f"{'chatcmpl' if chat_api else 'cmpl'}-{secrets.token_hex(6)}-{job.id}"
        self.created = int(time.time())
        self.notices: list[str] = []

    async def next(self) -> Any:
        """The job's next event, or END; a drain before the job started is a 503."""
        while True:
            item = await self.job.events.get()
            if isinstance(item, ShuttingDown):
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if isinstance(item, Notice):
                self.notices.append(item.message)
                continue
            if isinstance(item, PromptLogprobs):
                self.prompt_lps = item.values
                continue
            if isinstance(item, Error) and not item.token_ids and not item.text:
                raise APIError(400 if item.kind == "param" else 500, item.message, code="engine_error")
            return item

    def ssd_stats(self, done: Done) -> dict[str, Any]:
        s, cfg = done.stats, self.api.engine.config
        spec = s.mode != "ar"
        job = self.job
        return {
            "mode": s.ran_as or s.mode, "mode_label": s.label, "draft": self.api.engine.draft.name if spec and self.api.engine.draft is not None else None,
            "k": cfg.k if spec else None, "new_tokens": s.new_tokens, "rounds": s.rounds,
            "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length, "cache_hit_rate": s.cache_hit_rate,
            "per_position_acceptance": list(s.per_position_acceptance) if s.per_position_acceptance is not None else None,
            "tok_per_s": s.tok_per_s, "ttft_s": s.ttft_s, "elapsed_s": s.elapsed_s,
            "queue_s": (job.started_s - job.arrived_s) if job.started_s is not None else None, "notices": self.notices,
            "path": s.path, "reason": done.reason, **self.setup(),  # reason: the engine's (eos, stop, length), as `ask --json` names it
        }

    def setup(self) -> dict[str, Any]:
        """What `ask --json` shows beside the figures: the sampling the reply used, why the mode, what forwarded
        the models and in what precision (as a local answer has them)."""
        info, spec = self.api.engine.describe(), self.api.engine.config.mode != "ar"
        return {"sampling": {key: getattr(self.job.params, key) for key in SAMPLING_SHOWN}, "mode_reason": info.get("mode_reason"),
                "forward": info.get("forward"), "draft_forward": info.get("draft_forward"),
                "precision": {"target": info.get("precision"), "draft": info.get("draft_precision") if spec else None}}

    def usage(self, done: Done | None, num_tokens: int) -> dict[str, int]:
        n = len(done.token_ids) if done is not None else num_tokens
        return {"prompt_tokens": len(self.job.prompt_ids), "completion_tokens": n, "total_tokens": len(self.job.prompt_ids) + n}

    def _base(self) -> dict[str, Any]:
        obj = ("chat.completion" if self.chat_api else "text_completion")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.api.model_id}

    def _echoed(self) -> str:
        """The echoed prompt's text, and its tokens' logprobs into ``legacy`` (first in the answer)."""
        if self.echo is None:
            return ""
        if self.legacy is not None:
            for tid, value in zip(self.job.prompt_ids, self.prompt_lps or [None] * len(self.job.prompt_ids)):
                self.legacy.add(tid, value)
        return self.echo

    def _logprobs(self, tokens: list[Token], done: Done | None = None) -> dict[str, Any] | None:
        """The logprobs of these tokens; a completion's also list the EOS that ended it (a chat's, as OpenAI's, do not)."""
        if not self.logprobs:
            return None
        if self.chat_api:
            return chat_content(self.api.token_texts, [(t.id, t.logprob, t.top_logprobs) for t in tokens])
        for t in tokens:
            self.legacy.add(t.id, (t.logprob, t.top_logprobs))  # type: ignore[union-attr]
        if done is not None and done.eos_logprob is not None:
            tid, lp, top = done.eos_logprob
            self.legacy.add(tid, (lp, top))  # type: ignore[union-attr]
        return self.legacy.take()  # type: ignore[union-attr]

    async def whole(self, first: Any) -> dict[str, Any]:
        item, done, tokens = first, None, []
        echoed = self._echoed()
        while item is not END:
            if isinstance(item, Token):
                tokens.append(item)
            elif isinstance(item, Error):
                raise APIError(500, f"{item.message} (after {len(item.token_ids)} tokens)", code="engine_error")
            elif isinstance(item, Done):
                done = item
            item = await self.next()
        if done is None:  # the engine thread ended the job without a result (it was closed)
            raise APIError(503, "the server is shutting down", code="shutting_down")
        content, calls = server_tools.parse(done.text, self.tools) if self.tools is not None else (done.text, [])
        choice: dict[str, Any] = {"index": 0, "finish_reason": server_tools.finish_reason(done.reason, calls),
                                  "logprobs": self._logprobs(tokens, done)}
        if self.chat_api:
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        else:
            choice["text"] = echoed + done.text
        if self.req.return_token_ids:
            choice["token_ids"] = list(done.token_ids)
        out = {**self._base(), "choices": [choice], "usage": self.usage(done, len(tokens)), "ssd_stats": self.ssd_stats(done)}
        if self.req.return_token_ids:
            out["prompt_token_ids"] = list(self.job.prompt_ids)
        return out

    def _chunk(self, text: str | None, token_ids: list[int] | None = None, finish: str | None = None, role: bool = False,
               calls: list[dict[str, Any]] | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.chat_api:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            if calls:
                delta["tool_calls"] = server_tools.stream_deltas(calls)
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        if token_ids is not None and self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return {**self._base(), "object": "chat.completion.chunk" if self.chat_api else "text_completion", "choices": [choice]}

    async def sse(self, first: Any, watcher: Any) -> AsyncIterator[bytes]:
        def event(obj: Any) -> bytes:
            return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))

        try:
            if self.chat_api:
                yield event(self._chunk(None, role=True))
            elif self.echo is not None:  # the echoed prompt, with its logprobs, comes first
                text = self._echoed()
                yield event(self._chunk(text, list(self.job.prompt_ids), logprobs=self.legacy.take() if self.legacy is not None else None))
            item, count = first, 0
            held = server_tools.ToolStream(self.tools) if self.tools is not None else None
            while item is not END:
                if isinstance(item, Token):
                    count += 1
                    text = held.feed(item.text) if held is not None else item.text
                    if text or self.req.return_token_ids or self.logprobs:
                        yield event(self._chunk(text, [item.id], logprobs=self._logprobs([item])))
                elif isinstance(item, Error):  # mid-reply: what streamed stays; the error closes the stream
                    if held is not None and held.text[held.shown:]:  # text held back as a possible call goes out as it is
                        yield event(self._chunk(held.text[held.shown:]))
                    yield event(error_body(500, f"{item.message} (after {len(item.token_ids)} tokens)", code="engine_error"))
                elif isinstance(item, Done):
                    rest, calls = held.finish() if held is not None else (None, [])
                    if rest or calls:  # what was held back: text that was no call after all, and the calls
                        yield event(self._chunk(rest, calls=calls))
                    chunk = self._chunk(None, [] if self.req.return_token_ids else None, server_tools.finish_reason(item.reason, calls),
                                        logprobs=self._logprobs([], item) if self.legacy is not None else None)
                    chunk["ssd_stats"] = self.ssd_stats(item)
                    yield event(chunk)
                    if self.req.stream_options is not None and self.req.stream_options.include_usage:
                        yield event({**self._chunk(None), "choices": [], "usage": self.usage(item, count)})
                item = await self.next()
            yield format_sse_event(data_str="[DONE]")
        finally:  # the client hung up, or the reply ended: either way the engine moves on
            self.job.stop.set()
            watcher.cancel()
