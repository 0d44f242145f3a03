"""Ctrl+G in the app: the prompt in the box (or the last one sent) answered greedily in AR, SD and
SSD in turn, :data:`ssd_chat.chat.compare.DEFAULT_REPEATS` times over, on the loaded models, each run's
figures as it ends, then whether every output is identical and the speedups measured on that
prompt (median, spread, physical bound).  Part of
:class:`~ssd_chat.tui.chat_view.ChatView`; the loop itself is :func:`ssd_chat.chat.compare.run`.

The comparison is not part of the conversation: nothing is added to the chat's messages or history.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

from textual import work
from textual.message import Message

from ..chat import compare as cmp
from ..engine import threads, messages_for, SamplingParams
from ..chat.backend import readable
from .figures import Baseline, baseline_from_reply
from .replies import settle


class CompareRun(Message, bubble=False):
    def __init__(self, run: cmp.Run) -> None:
        super().__init__()
        self.run = run


class CompareDone(Message, bubble=False):
    def __init__(self, result: cmp.Comparison | None, error: str | None) -> None:
        super().__init__()
        self.result, self.error = result, error


class CompareActions:
    """``self`` is the ChatView."""

    _compare_stop: threading.Event | None = None
    _compare_worker: Any = None
    _compare_same_prompt: dict[str, Baseline]

    def compare_prompt(self) -> str | None:
        self.prompt.flush_typed()
        typed = self.prompt.text.strip()
        if typed and not typed.startswith("/"):
            return typed
        return self.session.last("user")

    async def action_compare(self) -> None:
        if not self.ready:
            await self.chat.add_notice(self.load_error or "the model is still loading", "warning")
            return
        if (self.current is not None and not self.current.finished) or self.switching is not None:
            await self.chat.add_notice("compare between replies: let this one finish or stop it (Esc)", "warning")
            return
        text = self.compare_prompt()
        if text is None:
            await self.chat.add_notice("type a prompt first: Ctrl+G answers it in AR, SD and SSD in turn", "warning")
            return
        try:
            limit = min(int(self.params.get("max_new_tokens") or cmp.DEFAULT_MAX_NEW_TOKENS), cmp.DEFAULT_MAX_NEW_TOKENS)
            params = SamplingParams(**{**self.params, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": limit})
        except ValueError as e:
            await self.chat.add_notice(str(e), "error")
            return
        info = self.backend.info()
        current = "auto" if info.get("auto") else (info.get("mode") or "ar")  # auto stays auto, its why line too
        self.switching = "compare"  # prompts and settings wait until the engine is back in its mode
        self._compare_stop = threading.Event()
        self._compare_same_prompt = {}
        short = text if len(text) <= 60 else text[:57] + "…"
        await self.chat.add_notice(f"compare: “{short}” in AR, SD and SSD in turn, {cmp.DEFAULT_REPEATS} times over, greedy, "
                                   f"up to {limit} tokens each, each run after a short warm-up (Esc stops)")
        msgs = messages_for(text, self.system)  # not part of the conversation: no earlier turns, nothing kept
        self._compare_worker = self.run_compare(msgs, params, current, self._compare_stop)

    @work(thread=True, group="compare", exit_on_error=False)
    def run_compare(self, msgs: list[dict[str, str]], params: SamplingParams, current: str, stop: threading.Event) -> None:
        threads.worker(threads.count())
        try:
            result = cmp.run(lambda m: self.backend.reconfigure(mode=m),
                             lambda n: self.backend.stream(msgs, replace(params, max_new_tokens=n) if n else params, stop),
                             current, on_run=lambda r: self.post_message(CompareRun(r)), stop=stop)
        except BaseException as e:  # noqa: BLE001 - shown in the chat, the app goes on
            self.post_message(CompareDone(None, readable(e)))
            return
        self.post_message(CompareDone(result, None))

    async def on_compare_run(self, msg: CompareRun) -> None:
        r = msg.run
        for n in r.notices:
            await self.chat.add_notice(f"{r.mode.upper()}: {n}", "warning")
        await self.chat.add_notice(cmp.run_line(r), "info" if r.done is not None else "error")
        if r.done is not None:
            self.panel.show(r.done.stats, live=False, measured=dict(self._compare_same_prompt))
            b = baseline_from_reply(r.done.stats, f"{r.ran_as.upper()} run of the same prompt (compare)", min_tokens=2)
            if b is not None:  # keyed by the mode that ran: an SSD run that fell back to SD is an SD rate
                self._compare_same_prompt[b.mode] = b

    async def on_compare_done(self, msg: CompareDone) -> None:
        self.switching = None
        self._compare_stop = None
        self._update_info()
        if msg.result is None:
            await self.chat.add_notice(f"compare failed: {msg.error}", "error")
            return
        result = msg.result
        if result.identical is None and any(r.done is None for r in result.runs):
            await self.chat.add_notice("compare stopped", "warning")
        else:
            await self.chat.add_notice(cmp.summary(result), "error" if result.identical is False else "info")
        if result.finished:
            first = result.finished[0]
            await self.chat.add_notice(f"reply ({first.mode.upper()}{', the same in all' if result.identical else ''}): "
                                       f"{first.done.text}")
        for mode, b in list(self._compare_same_prompt.items()):  # each mode's median over the repeats, not its last run
            med = result.median_tok_per_s(mode)
            if med is not None:
                bound = result.bound("ssd", "sd") if mode == "sd" else None
                self._compare_same_prompt[mode] = replace(b, tok_per_s=med, source=f"{mode.upper()} runs of the same prompt (compare, median)",
                                                          ssd_bound=bound if bound is not None else b.ssd_bound)
        for b in self._compare_same_prompt.values():  # later replies in this chat compare with these rates
            self.panel.set_measured(replace(b, source=f"{b.mode.upper()} runs in the last compare (median)"))
        if result.finished:  # the last mode's median run, against the other modes' medians on the same prompt
            last = result.finished[-1]
            med = result.median_tok_per_s(last.mode)
            runs = result.of(last.mode)
            shown = min(runs, key=lambda r: abs(r.tok_per_s - med)) if runs and med is not None else last
            self.panel.show(shown.done.stats, live=False, measured=dict(self._compare_same_prompt))

    async def stop_compare(self) -> None:
        """Esc / quit: stop the comparison at the next token and wait for the engine to be back."""
        if self._compare_stop is not None:
            self._compare_stop.set()
        await settle(self._compare_worker, 15)
