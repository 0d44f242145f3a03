"""``/model`` in the app (Pilot, fake backends; the local models are a hub cache made in tmp_path): the list,
a name refused before anything unloads, the confirmation, the switch (the old backend's process exits, a new
chat, a new backend with the new target, loaded with the load line), Cancel, refusal while a reply streams,
Tab completion."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.tui import FakeBackend, ready, ssd_events, wait_until

from ssd_chat.history.store import History  # noqa: E402
from ssd_chat.tui.app import ChatApp  # noqa: E402
from ssd_chat.tui.switch_model import target_values  # noqa: E402
from ssd_chat.tui.widgets.chat_log import Notice, UserMessage  # noqa: E402
from ssd_chat.tui.widgets.confirm_dialog import ConfirmDialog  # noqa: E402
from ssd_chat.tui.widgets.load_status import LoadStatus  # noqa: E402

psutil = pytest.importorskip("psutil")


@pytest.fixture(autouse=True)
def hub(tmp_path, monkeypatch):
    """Two hub models on this machine, offline: SmolLM2-360M (alias smollm2-360m) and SmolLM2-1.7B."""
    cache = tmp_path / "hub"
    for repo in ("HuggingFaceTB/SmolLM2-360M-Instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct"):
        snap = cache / ("models--" + repo.replace("/", "--")) / "snapshots" / "abc"
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    return cache


CREATED: list = []


@pytest.fixture(autouse=True)
def no_child_outlives_the_test():
    yield
    while CREATED:
        CREATED.pop().close()


class ProcBackend(FakeBackend):
    """A fake whose load starts a child process (as the engine's), ended by close()."""

    def __init__(self, values: dict, **kw) -> None:
        super().__init__([ssd_events(["hi"]) for _ in range(3)], **kw)
        self.values = values
        self.info_["target"] = values.get("target")
        self.child: subprocess.Popen | None = None
        self.close_calls = 0
        CREATED.append(self)

    def load(self, progress):
        progress("loading target", 0.5)
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    def close(self):
        self.close_calls += 1
        self.closed = True
        if self.child is not None and self.child.poll() is None:
            self.child.terminate()
            self.child.wait(10)


def make(tmp_path, values=None, **kw):
    values = values or {"target": "smollm2-1.7b", "mode": "ssd", "draft": "smollm2-360m", "k": 3}
    built: list[ProcBackend] = []

    def factory(v):
        built.append(ProcBackend(v))
        return built[-1]

    first = factory(values)
    app = ChatApp(first, settings=values, history=History(tmp_path / "h.db"), backend_factory=factory, **kw)
    app.toasts, notify = [], app.notify
    app.notify = lambda message, **kw: (app.toasts.append(message), notify(message, **kw))[1]  # what the toasts said
    return app, built


def notices(app) -> list[str]:
    return [n.text for n in app.query(Notice)]


async def notices_with(pilot, app, text: str) -> list[str]:
    """The chat's notices that contain ``text``, once there is one."""
    await wait_until(pilot, lambda: any(text in n for n in notices(app)))
    return [n for n in notices(app) if text in n]


async def type_line(pilot, app, text: str) -> None:
    app.chat_view.prompt.set_text(text)
    await pilot.press("enter")


def test_the_new_values_keep_the_mode_and_a_derived_draft_only():
    v = {"target": "a", "draft": "b", "mode": "sd", "k": 5, "resume": 3}
    assert target_values(v, "c", {"mode": "ssd"}) == {"target": "c", "draft": None, "mode": "ssd", "k": 5}
    for d in ("int8", "copy", "trained", "layers:4"):
        assert target_values({**v, "draft": d}, "c", {})["draft"] == d


@pytest.mark.asyncio
async def test_model_alone_lists_the_local_models_and_the_one_in_use(tmp_path):
    app, built = make(tmp_path)
    async with ready(app, size=(140, 45)) as pilot:
        await type_line(pilot, app, "/model")
        text = (await notices_with(pilot, app, "models on this machine"))[0]
        assert "in use: smollm2-1.7b" in text
        assert "HuggingFaceTB/SmolLM2-360M-Instruct (smollm2-360m)" in text
        (line,) = [ln for ln in text.splitlines() if "SmolLM2-1.7B" in ln]
        assert "← in use" in line
        assert len(built) == 1 and not built[0].closed


@pytest.mark.asyncio
async def test_a_name_not_available_is_refused_in_one_line_and_nothing_changes(tmp_path):
    app, built = make(tmp_path)
    async with ready(app, size=(140, 45)) as pilot:
        await type_line(pilot, app, "/model llama-3-8b")
        (msg,) = await notices_with(pilot, app, "cannot switch")
        assert "\n" not in msg and "not in the local Hugging Face cache" in msg and "download meta-llama/Llama-3.1-8B-Instruct" in msg
        await type_line(pilot, app, "/model no-such-model")
        await notices_with(pilot, app, "unknown model 'no-such-model'")
        assert not isinstance(app.screen, ConfirmDialog)
        assert len(built) == 1 and app.backend is built[0] and not built[0].closed and app.chat_view.ready


@pytest.mark.asyncio
async def test_switch_after_confirming_closes_the_old_backend_starts_a_new_chat_and_loads_the_new_target(tmp_path):
    app, built = make(tmp_path)
    async with ready(app, size=(140, 45)) as pilot:
        await app.chat_view.controller.actions.apply_settings({"mode": "sd"})  # changed since the load: the switch keeps it
        await app.chat_view.submit("hello")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        old_conv = app.chat_view.conversation_id
        child = psutil.Process(built[0].child.pid)
        await type_line(pilot, app, "/model smollm2-360m")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        assert "Switch the target to smollm2-360m? The current chat stays saved; the next chat uses smollm2-360m" in app.screen.question
        await pilot.pause()
        shown = app.screen.query_one("#confirm-question")
        assert shown.size.height >= 2 and shown.size.width <= 80  # wrapped inside the dialog, not cut off
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(built) == 2 and app.chat_view.ready)
        assert built[0].close_calls == 1
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        new = built[1]
        assert app.backend is new and app.chat_view.controller.backend is new
        assert new.values["target"] == "smollm2-360m" and new.values["mode"] == "sd"
        assert new.values["draft"] is None  # another model as draft: the new target's default
        assert new.child is not None and new.child.poll() is None  # loaded by the app's load path
        assert not app.query(UserMessage) and app.chat_view.conversation_id is None
        assert any(n == "new chat" for n in notices(app))
        assert "smollm2-360m" in app.sub_title and not app.query_one(LoadStatus).display
        await app.chat_view.submit("again")  # the next chat replies through the new backend
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        assert new.calls and not built[0].calls[1:]
        await pilot.press("ctrl+c")
    assert new.closed
    assert [m.content for m in History(tmp_path / "h.db").messages(old_conv)][0] == "hello"


@pytest.mark.asyncio
async def test_cancel_changes_nothing(tmp_path):
    app, built = make(tmp_path)
    async with ready(app, size=(140, 45)) as pilot:
        await type_line(pilot, app, "/model smollm2-360m")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, ConfirmDialog))
        await pilot.pause()
        assert len(built) == 1 and app.backend is built[0] and not built[0].closed and app.chat_view.ready


@pytest.mark.asyncio
async def test_refused_while_a_reply_streams(tmp_path):
    app, built = make(tmp_path)
    built[0].block = True
    async with ready(app, size=(140, 45)) as pilot:
        await app.chat_view.submit("long one")
        await wait_until(pilot, lambda: built[0].blocked.is_set())
        await type_line(pilot, app, "/model smollm2-360m")
        await notices_with(pilot, app, "a reply is streaming")
        assert not isinstance(app.screen, ConfirmDialog) and len(built) == 1 and not built[0].closed
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.chat_view.current.finished)


@pytest.mark.asyncio
async def test_a_failed_load_leaves_the_app_usable_to_switch_back(tmp_path):
    app, built = make(tmp_path)
    async with ready(app, size=(140, 45)) as pilot:
        app.backend_factory = lambda v: built.append(Broken(v)) or built[-1]
        await type_line(pilot, app, "/model smollm2-360m")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_view.load_error is not None)
        (line,) = [n for n in notices(app) if "could not load" in n]
        assert "\n" not in line and "/model NAME loads another" in line
        app.backend_factory = lambda v: built.append(ProcBackend(v)) or built[-1]
        await type_line(pilot, app, "/model smollm2-1.7b")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(built) == 3 and app.chat_view.ready)
        assert built[1].closed and app.backend.values["target"] == "smollm2-1.7b"
        assert app.query_one(LoadStatus).display is False and not app.query_one(LoadStatus).has_class("-failed")
        await pilot.press("ctrl+c")


class Broken(ProcBackend):
    def load(self, progress):
        from ssd_chat.engine.errors import ModelError

        raise ModelError("the weights are damaged")


@pytest.mark.asyncio
async def test_tab_completes_a_local_model_name(tmp_path):
    app, built = make(tmp_path)
    async with ready(app, size=(140, 45)) as pilot:
        prompt = app.chat_view.prompt
        prompt.set_text("/model smollm2-3")
        await pilot.press("tab")
        await wait_until(pilot, lambda: prompt.text == "/model smollm2-360m")
        assert app.focused is prompt
        prompt.set_text("/model HuggingFaceTB/Smol")
        await pilot.press("tab")
        await wait_until(pilot, lambda: prompt.text == "/model HuggingFaceTB/SmolLM2-")
        await wait_until(pilot, lambda: any("SmolLM2-1.7B-Instruct" in t and "SmolLM2-360M-Instruct" in t for t in app.toasts))
        prompt.set_text("/model zzz")
        await pilot.press("tab")
        await wait_until(pilot, lambda: any("no local model starts with 'zzz'" in t for t in app.toasts))
        assert prompt.text == "/model zzz"


def test_the_app_lowers_its_threads_but_not_the_one_that_starts_engine_processes():
    """A new engine process (after /model) inherits the spawner thread's priority: it must stay the engine's."""
    code = """
import os, threading
from ssd_chat.engine import processes as workers
from ssd_chat.tui.app import yield_to_engine
p = workers.context().Process(target=os.getpid)
workers.start(p); p.join()
yield_to_engine()
child_nice = workers._spawner.submit(lambda: os.getpriority(os.PRIO_PROCESS, 0)).result()
print(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), child_nice)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    main, spawner = map(int, out.stdout.split())
    assert main == spawner + 10 or main == 19
    assert spawner == os.getpriority(os.PRIO_PROCESS, 0)
