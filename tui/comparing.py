"""Ctrl+G in the app (:class:`Comparison`): the prompt in the box (or the last one sent) answered greedily in AR,
SD and SSD in turn, several times over on the loaded models (the loop is :func:`ssd_chat.chat.compare.run`), then
whether every output is identical and the speedups measured on that prompt.  It is not part of the conversation:
nothing is added to the chat's messages or history."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace
from typing import Any

from textual.message import Message

from ..chat import compare as cmp
from ..engine import threads, messages_for, SamplingParams
from ..chat.backend import readable
from .widgets.figures import Baseline, baseline_from_reply


@dataclass
class CompareRun(Message, bubble=False):
    run: cmp.Run


@dataclass
class CompareDone(Message, bubble=False):
    result: cmp.Comparison | None
    error: str | None


class Comparison:
    """``stop`` is set while a comparison runs (Esc sets it); ``ctl`` is the chat's controller."""

    def __init__(self, ctl: Any) -> None:
        self.ctl, self.view = ctl, ctl.view
        self.stop: threading.Event | None = None
        self.worker: Any = None
        self.same_prompt: dict[str, Baseline] = {}

    async def start(self) -> None:
        """Ctrl+G and /compare."""
        c, chat = self.ctl, self.view.chat
        if not c.ready:
            await chat.add_notice(c.load_error or "the model is still loading", "warning")
            return
        if c.streaming() or c.switching is not None:
            await chat.add_notice("compare between replies: let this one finish or stop it (Esc)", "warning")
            return
        self.view.prompt.flush_typed()
        text = self.view.prompt.text.strip()
        text = text if text and not text.startswith("/") else c.session.last("user")  # the box's prompt, else the last one sent
        if text is None:
            await chat.add_notice("type a prompt first: Ctrl+G answers it in AR, SD and SSD in turn", "warning")
            return
        try:
            limit = min(int(c.params.get("max_new_tokens") or cmp.DEFAULT_MAX_NEW_TOKENS), cmp.DEFAULT_MAX_NEW_TOKENS)
            params = SamplingParams(**{**c.params, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": limit})
        except ValueError as e:
            await chat.add_notice(str(e), "error")
            return
        info = c.backend.info()
        current = "auto" if info.get("auto") else (info.get("mode") or "ar")  # auto stays auto, its why line too
        c.switching = "compare"  # prompts and settings wait until the engine is back in its mode
        self.stop = threading.Event()
        self.same_prompt = {}
        short = text if len(text) <= 60 else text[:57] + "…"
        await chat.add_notice(f"compare: “{short}” in AR, SD and SSD in turn, {cmp.DEFAULT_REPEATS} times over, greedy, "
                              f"up to {limit} tokens each, each run after a short warm-up (Esc stops)")
        msgs = messages_for(text, c.system)  # not part of the conversation: no earlier turns, nothing kept
        run = functools.partial(self.run, msgs, params, current, self.stop)
        self.worker = self.view.run_worker(run, group="compare", exit_on_error=False, thread=True)

    def run(self, msgs: list[dict[str, str]], params: SamplingParams, current: str, stop: threading.Event) -> None:
        """The comparison (a thread worker); each run and the end are posted to the view."""
        threads.worker(threads.count())
        backend, post = self.ctl.backend, self.view.post_message
        try:
            result = cmp.run(lambda m: backend.reconfigure(mode=m),
                             lambda n: backend.stream(msgs, replace(params, max_new_tokens=n) if n else params, stop),
                             current, on_run=lambda r: post(CompareRun(r)), stop=stop)
        except BaseException as e:  # noqa: BLE001 - shown in the chat, the app goes on
            post(CompareDone(None, readable(e)))
            return
        post(CompareDone(result, None))

    async def on_run(self, msg: CompareRun) -> None:
        r, chat, panel = msg.run, self.view.chat, self.view.panel
        for n in r.notices:
            await chat.add_notice(f"{r.mode.upper()}: {n}", "warning")
        await chat.add_notice(cmp.run_line(r), "info" if r.done is not None else "error")
        if r.done is not None:
            panel.show(r.done.stats, live=False, measured=dict(self.same_prompt))
            b = baseline_from_reply(r.done.stats, f"{r.ran_as.upper()} run of the same prompt (compare)", min_tokens=2)
            if b is not None:  # keyed by the mode that ran: an SSD run that fell back to SD is an SD rate
                self.same_prompt[b.mode] = b

    async def on_done(self, msg: CompareDone) -> None:
        chat, panel = self.view.chat, self.view.panel
        self.ctl.switching = None
        self.stop = None
        self.ctl.update_info()
        if msg.result is None:
            await chat.add_notice(f"compare failed: {msg.error}", "error")
            return
        result = msg.result
        if result.identical is None and any(r.done is None for r in result.runs):
            await chat.add_notice("compare stopped", "warning")
        else:
            await chat.add_notice(cmp.summary(result), "error" if result.identical is False else "info")
        if result.finished:
            first = result.finished[0]
            await chat.add_notice(f"reply ({first.mode.upper()}{', the same in all' if result.identical else ''}): "
                                  f"{first.done.text}")
        for mode, b in list(self.same_prompt.items()):  # each mode's median over the repeats, not its last run
            med = result.median_tok_per_s(mode)
            if med is not None:
                bound = result.bound("ssd", "sd") if mode == "sd" else None
                self.same_prompt[mode] = b = replace(b, tok_per_s=med, ssd_bound=bound if bound is not None else b.ssd_bound,
                                                     source=f"{mode.upper()} runs of the same prompt (compare, median)")
            panel.set_measured(replace(b, source=f"{mode.upper()} runs in the last compare (median)"))  # for later replies
        if result.finished:  # the last mode's median run, against the other modes' medians on the same prompt
            last = result.finished[-1]
            med = result.median_tok_per_s(last.mode)
            runs = result.of(last.mode)
            shown = min(runs, key=lambda r: abs(r.tok_per_s - med)) if runs and med is not None else last
            panel.show(shown.done.stats, live=False, measured=dict(self.same_prompt))
