"""Helpers for the app's Pilot tests: scripted event streams, a scripted backend, polling, and what the screen shows."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from ssd_chat.chat.backend import Backend, EngineBackend
from ssd_chat.engine import Engine
from ssd_chat.engine.events import Done, Event, Round, Token
from ssd_chat.engine.metrics import Metrics
from ssd_chat.history.store import History
from ssd_chat.tui.app import ChatApp
from ssd_chat.tui.widgets.chat_log import AssistantMessage, UserMessage


def plain(static) -> str:
    """What a Static shows, as plain text."""
    import io

    from rich.console import Console

    console = Console(width=200, file=io.StringIO(), color_system=None)
    console.print(static.content)
    return console.file.getvalue()


# -- scripted streams -------------------------------------------------------------------------
def ssd_events(words: list[str], k: int = 3, hits: list[bool] | None = None, dt: float = 0.001) -> list[Event]:
    """An SSD-shaped stream with the engine's semantics: rounds of up to k accepted draft tokens + a bonus.

    Round i accepts ``i % (k + 1)`` drafts.  Round i's ``predicted`` is what the speculator cached
    while round i-1 was verified; ``hits[i]`` says whether round i-1's (accepted, bonus) was in it.
    The first round has nothing cached (a miss served by the fallback).
    """
    events: list[Event] = []
    metrics = Metrics("ssd")
    ids = list(range(100, 100 + len(words)))
    pos, r, t = 0, 0, 0.0
    prev: tuple[int, int] | None = None
    while pos < len(words):
        acc = min(r % (k + 1), len(words) - pos - 1)
        for j in range(acc + 1):
            t += dt
            ev = Token(ids[pos], words[pos], "draft" if j < acc else "target", t)
            metrics.add(ev)
            events.append(ev)
            pos += 1
        if prev is None:
            hit, predicted = False, ()
        else:
            hit = hits[r % len(hits)] if hits else True
            predicted = tuple((j, (prev[1] if (hit and j == prev[0]) else 900 + j, 950 + j)) for j in range(k + 1))
        rd = Round(r, tuple(range(1, k + 1)), acc, ids[pos - 1], acc + 1, 0.0 if hit else 0.0005, 0.002, t, cache_hit=hit,
                   predicted=predicted, wait_s=0.0001, speculator_busy_s=0.001, fallback=None if hit else "fast")
        metrics.add(rd)
        events.append(rd)
        prev = (acc, ids[pos - 1])
        r += 1
    metrics.sd_estimate_s = 0.004 * r
    events.append(Done("eos", "".join(words), tuple(ids), metrics.stats(t + dt)))
    return events


def timed_reply(mode: str, ids: list[int], dt: float, k: int = 3, draft: float = 0.0, verify: float = 0.0,
                rounds: bool = True, end_s: float | None = None) -> list[Event]:
    """A greedy reply at ``dt`` per token; SD/SSD (with ``rounds``) in rounds of two tokens with the given
    draft/verify times; it ends at ``end_s`` (default: with its last token)."""
    m = Metrics(mode)
    events = []
    for i, t in enumerate(ids):
        ev = Token(t, f"w{t} ", "target", (i + 1) * dt)
        m.add(ev)
        events.append(ev)
        if rounds and mode != "ar" and i % 2 == 1:
            r = Round(i // 2, tuple(range(k)), 1, t, 2, draft, verify, (i + 1) * dt)
            m.add(r)
            events.append(r)
    text = "".join(e.text for e in events if isinstance(e, Token))
    return events + [Done("length", text, tuple(ids), m.stats(len(ids) * dt if end_s is None else end_s))]


class FakeBackend(Backend):
    """Replies with scripted streams; with ``block=True`` the first reply stops mid-way until Esc sets the stop flag."""

    def __init__(self, replies: list[list[Event]], block: bool = False, mode: str = "ssd", delay: float = 0.0) -> None:
        self.replies = list(replies)
        self.block = block
        self.delay = delay  # seconds between events, so one reply spans several screen frames
        self.calls: list[list[dict]] = []
        self.info_ = {"mode": mode, "k": 3, "target": "fake-target", "target_device": "cpu", "draft": "fake-draft",
                      "draft_device": "cpu:1"}
        self.blocked = threading.Event()
        self.closed = False
        self.thread_ended = threading.Event()

    def info(self):
        return dict(self.info_)

    def stream(self, messages, params, stop):
        self.calls.append(messages)
        events = self.replies.pop(0)
        text, ids = "", []
        try:
            for n, ev in enumerate(events):
                if self.block and len(self.calls) == 1 and n == len(events) // 2:
                    self.blocked.set()
                    stop.wait(30)
                if stop.is_set():
                    yield Done("cancelled", text + "<held>", tuple(ids), Metrics(self.info_["mode"]).stats(0.1))
                    return
                if isinstance(ev, Token):
                    text += ev.text
                    ids.append(ev.id)
                time.sleep(self.delay)
                yield ev
        finally:
            self.thread_ended.set()

    def reconfigure(self, **changes):
        if changes.get("mode") == "bogus":
            raise ValueError("unknown mode 'bogus'")
        self.info_.update(changes)

    def token_text(self, token_id):
        return {900: "x", 901: "y"}.get(token_id)

    def close(self):
        self.closed = True


async def wait_until(pilot, predicate, timeout: float = 10.0) -> None:
    """Poll rather than trust one pause().

    It sleeps instead of calling ``pilot.pause()``: pause() waits for a callback queued on every widget,
    and one that a streaming Markdown removes meanwhile never runs it, so pause() then hangs for 30 s.
    """
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


WORDS = ["Hello", " there", "!", " Here", " is", " some", " **bold**", " text", " and", " a", " list", ":\n\n", "- one", "\n- two"]


def replies_text(app: ChatApp) -> list[str]:
    return [m.text for m in app.query(AssistantMessage)]


def saved(path, all_branches: bool = False) -> list[tuple[str, list[tuple[str, str]]]]:
    """Every saved chat, newest first: (title, [(role, content)]) of its current branch (or of every message)."""
    h = History(path)
    try:
        return [(c.title, [(m.role, m.content) for m in h.messages(c.id, all_branches)]) for c in h.list_conversations()]
    finally:
        h.close()


def on_screen(app: ChatApp) -> list[tuple[str, str]]:
    return [("user" if isinstance(w, UserMessage) else "assistant", w.text)
            for w in app.chat_view.chat.children if isinstance(w, (UserMessage, AssistantMessage))]


def scripted_app(db, *replies: str) -> tuple[ChatApp, FakeBackend]:
    """An app that saves its chats in ``db``, whose backend answers each prompt with the next of ``replies``."""
    backend = FakeBackend([ssd_events([r]) for r in replies])
    return ChatApp(backend, history=History(db)), backend


@contextlib.asynccontextmanager
async def ready(app: ChatApp, timeout: float = 10.0, **run_test):
    """``app`` under Textual's Pilot (``run_test``'s options), once its chat view is ready; yields the pilot."""
    async with app.run_test(**run_test) as pilot:
        await wait_until(pilot, lambda: app.chat_view.ready, timeout)
        yield pilot


def laid_out(app: ChatApp) -> bool:
    """Every message is in the focus chain in its place, the order Shift+Tab walks back through
    (tui/widgets/chat_log.py's ``InTranscriptOrder`` keeps it so before a message's first layout too)."""
    from ssd_chat.tui.widgets.chat_log import AssistantMessage, UserMessage

    kinds = (UserMessage, AssistantMessage)
    return [w for w in app.screen.focus_chain if isinstance(w, kinds)] == [w for w in app.chat_view.chat.children if isinstance(w, kinds)]


@contextlib.asynccontextmanager
async def after_chat(db, replies: tuple[str, ...], prompts: tuple[str, ...], **run_test):
    """A :func:`scripted_app` (``replies``) under Pilot once ``prompts`` were answered; yields (app, backend, pilot)."""
    app, backend = scripted_app(db, *replies)
    async with ready(app, **run_test) as pilot:
        await chat(app, pilot, *prompts)
        yield app, backend, pilot


async def submit(pilot, app: ChatApp, prompt: str, timeout: float = 10.0) -> None:
    """Send ``prompt`` as if typed, and wait until its reply has finished."""
    await app.chat_view.submit(prompt)
    await wait_until(pilot, lambda: app.chat_view.current.finished, timeout)


async def press_for_reply(pilot, app: ChatApp, key: str, calls: int) -> None:
    """Press ``key`` and wait until the reply it starts (the backend's ``calls``-th) has finished."""
    await pilot.press(key)
    await wait_until(pilot, lambda: len(app.backend.calls) == calls and app.chat_view.current.finished)


async def chat(app: ChatApp, pilot, *prompts: str) -> None:
    for p in prompts:
        await app.chat_view.submit(p)
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished and not app.chat_view._reply_worker.is_running)


def notices(app: ChatApp) -> list[str]:
    return [n.text for n in app.query("Notice")]


class Preloaded(EngineBackend):
    def __init__(self, engine: Engine) -> None:
        super().__init__({"mode": "ar"})
        self._engine = engine

    def load(self, progress) -> None:
        progress("loading target", 0.5)
        self.engine = self._engine

    def close(self) -> None:  # the session fixture owns the model
        self.engine = None


class FakeEngine:
    def __init__(self) -> None:
        self.config = {"mode": "ssd", "k": 4, "fan_out": None}  # what `auto` resolved to
        self.changes: list[dict] = []
        self.sampling_defaults: dict = {}  # the model declares none

    def describe(self) -> dict:
        return {**self.config, "target": "fake-target"}

    def reconfigure(self, **changes) -> None:
        self.changes.append(changes)
        self.config.update(changes)

    def decoder(self) -> None:
        pass

    def close(self) -> None:
        pass


class SlowEngineBackend(EngineBackend):
    """The real app backend (``engine`` is None until loaded, ``info()`` says the unresolved ``auto``),
    with a load that waits for the test to release it, then fails or gives a fake engine."""

    def __init__(self, fail: str | None = None) -> None:
        super().__init__({"mode": "auto", "target": "fake-target"})
        self.release = threading.Event()
        self.fail = fail

    def load(self, progress) -> None:
        progress("loading fake-target", None)
        self.release.wait(30)
        if self.fail:
            raise ValueError(self.fail)
        self.engine = FakeEngine()

