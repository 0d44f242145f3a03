"""Pilot tests: /attach puts a text file into the next message (and the saved chat keeps it), refusals
for binary, missing and too-large files, ``c`` on a focused message copying one code block at a time,
and /save N FILE."""

from __future__ import annotations

import pytest
import torch
from helpers.tui import chat, FakeBackend, laid_out, notices, ready, saved, scripted_app, ssd_events, wait_until

from helpers.models import as_loaded, tiny_llama
from ssd_chat.chat import attach
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.tui.app import ChatApp
from ssd_chat.tui.widgets.chat_log import AssistantMessage, UserMessage

CODE = "def add(a, b):\n    return a + b\n"
REPLY = ["Here it is:\n\n```python\n", "x = 1\ny = 2\n", "```\n\nand to run it:\n\n```bash\npython x.py\n```\n"]


def said(app: ChatApp) -> list[str]:
    out: list[str] = []
    app.notify = lambda message, **kw: out.append(message)
    return out


@pytest.mark.asyncio
async def test_attach_stages_a_file_for_the_next_message_and_the_saved_chat_keeps_it(tmp_path):
    src = tmp_path / "add.py"
    src.write_text(CODE)
    app, backend = scripted_app(tmp_path / "h.db", "ok", "again")
    async with ready(app, size=(140, 45)) as pilot:
        view = app.chat_view
        await view.submit(f"/attach {src}")
        assert f"attached {src} ({len(CODE)} characters)" in notices(app)[-1]  # no tokenizer here: its size
        assert str(view.prompt.border_subtitle) == f"attached: {src}"
        await view.submit("/attach")
        assert f"attached to your next message: {src}" in notices(app)[-1]
        await chat(app, pilot, "What does it do?")
        sent = f"File: {src}\n```python\n{CODE}```\n\nWhat does it do?"
        assert backend.calls[0] == [{"role": "user", "content": sent}]
        assert [w.text for w in app.query(UserMessage)] == [sent]
        assert not view.prompt.border_subtitle and view.controller.attach.staged == []
        await chat(app, pilot, "And now?")  # sent once: the next message goes alone
        assert backend.calls[1][-1] == {"role": "user", "content": "And now?"}
        await view.submit("/attach " + str(src))
        await view.submit("/attach clear")
        assert notices(app)[-1] == "dropped 1 attached file" and view.controller.attach.staged == [] and not view.prompt.border_subtitle
        await pilot.press("ctrl+c")
    ((title, messages),) = saved(tmp_path / "h.db")
    assert title.startswith("What does it do?")  # named by what the user wrote, not by the file
    assert messages[0] == ("user", sent)


@pytest.mark.asyncio
async def test_attach_refuses_binary_missing_and_folders_in_one_line_and_shows_hostile_text_literally(tmp_path):
    (tmp_path / "bin.dat").write_bytes(b"\x7fELF\x00\x01")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    hostile = "[bold red]not markup[/] \x1b[31mred\x1b[0m \x1b]0;title\x07\n"
    (tmp_path / "hostile.txt").write_text(hostile)
    backend = FakeBackend([ssd_events(["ok"])])
    app = ChatApp(backend)
    async with ready(app, size=(140, 45)) as pilot:
        view = app.chat_view
        for name, why in (("bin.dat", "it is a binary file (it holds NUL bytes)"), ("latin.txt", "it is not UTF-8 text"),
                          ("nope.txt", "no such file"), (".", "it is a directory")):
            await view.submit(f"/attach {tmp_path / name}")
            (last,) = [n for n in app.query("Notice")][-1:]
            assert why in last.text and "\n" not in last.text and last.has_class("-error"), last.text
        assert view.controller.attach.staged == []
        await view.submit(f"/attach {tmp_path / 'hostile.txt'}")
        await chat(app, pilot, "hi")
        assert hostile.rstrip("\n") in backend.calls[0][-1]["content"]  # sent as it is
        (shown,) = app.query(UserMessage)
        rendered = str(shown.render())
        assert "\x1b" not in rendered and "\\x1b[31mred" in rendered and "[bold red]not markup[/]" in rendered
        await pilot.press("ctrl+c")


WINDOW = 192


@pytest.fixture(scope="module")
def small_context(smol_tokenizer):
    model = tiny_llama(vocab_size=len(smol_tokenizer), max_pos=WINDOW, dtype=torch.float32)
    return as_loaded(model, smol_tokenizer, "tiny-192")


@pytest.mark.asyncio
async def test_attach_counts_with_the_real_tokenizer_and_refuses_a_file_larger_than_the_context(tmp_path, small_context):
    from helpers.tui import Preloaded

    small, big = tmp_path / "small.py", tmp_path / "big.txt"
    small.write_text(CODE)
    big.write_text("word " * 400)
    app = ChatApp(Preloaded(Engine(EngineConfig(mode="ar"), small_context)), settings={"sampling": SamplingParams.given({"max_new_tokens": 4})})
    async with ready(app, 60, size=(140, 45)) as pilot:
        view = app.chat_view
        await view.submit(f"/attach {big}")
        n_big = attach.count(small_context.tokenizer, attach.read(str(big)).block())
        assert notices(app)[-1] == f"cannot attach {big}: it is {n_big:,} tokens, more than tiny-192's context of {WINDOW} tokens"
        assert view.controller.attach.staged == []
        await view.submit(f"/attach {small}")
        n_small = attach.count(small_context.tokenizer, attach.read(str(small)).block())
        assert notices(app)[-1].startswith(f"attached {small} ({n_small} tokens)")
        await pilot.press("ctrl+c")


@pytest.mark.asyncio
async def test_c_on_a_focused_reply_copies_one_code_block_at_a_time():
    app = ChatApp(FakeBackend([ssd_events(REPLY)]))
    async with ready(app, size=(140, 45)) as pilot:
        await chat(app, pilot, "show me")
        out = said(app)
        view = app.chat_view
        view.prompt.focus()
        await wait_until(pilot, lambda: laid_out(app) and any(isinstance(w, AssistantMessage) for w in app.screen.focus_chain))
        await pilot.press("shift+tab")  # from the prompt box: the last reply
        await wait_until(pilot, lambda: isinstance(app.focused, AssistantMessage))
        await pilot.press("c")
        await wait_until(pilot, lambda: out)
        assert view.controller.actions.clipboard_text == "x = 1\ny = 2\n" and out[-1] == "copied block 1/2 (python, 2 lines)"
        await pilot.press("c")
        await wait_until(pilot, lambda: len(out) == 2)
        assert view.controller.actions.clipboard_text == "python x.py\n" and out[-1] == "copied block 2/2 (bash, 1 line)"
        await pilot.press("c")  # round again
        await wait_until(pilot, lambda: len(out) == 3)
        assert out[-1] == "copied block 1/2 (python, 2 lines)"
        await pilot.press("shift+tab")  # your message: no block in it
        await wait_until(pilot, lambda: isinstance(app.focused, UserMessage))
        await pilot.press("c")
        await wait_until(pilot, lambda: len(out) == 4)
        assert out[-1] == "no code block in this message" and view.controller.actions.clipboard_text == "x = 1\ny = 2\n"
        await pilot.press("ctrl+c")


@pytest.mark.asyncio
async def test_save_writes_one_block_of_the_last_reply_and_overwrites_only_with_force(tmp_path):
    app = ChatApp(FakeBackend([ssd_events(REPLY)]))
    async with ready(app, size=(140, 45)) as pilot:
        view = app.chat_view
        await view.submit("/save 1 x.py")
        assert notices(app)[-1] == "the last reply has no code block to save"
        await chat(app, pilot, "show me")
        await view.submit("/save")
        assert notices(app)[-1] == "the last reply's code blocks: 1 python, 2 lines · 2 bash, 1 line"
        out = tmp_path / "run.sh"
        await view.submit(f"/save 2 {out}")
        assert out.read_text() == "python x.py\n" and notices(app)[-1] == f"saved block 2/2 (bash, 1 line) to {out}"
        out.write_text("mine")
        await view.submit(f"/save 1 {out}")
        assert out.read_text() == "mine" and notices(app)[-1] == f"{out} exists: add --force to overwrite it"
        await view.submit(f"/save 1 {out} --force")
        assert out.read_text() == "x = 1\ny = 2\n"
        await view.submit(f"/save 3 {out}")
        assert notices(app)[-1] == "no block 3: the last reply has 2 (/save 1 to /save 2)"
        await view.submit(f"/save 1 {tmp_path / 'no' / 'such' / 'dir.py'}")
        assert notices(app)[-1].startswith(f"cannot save to {tmp_path / 'no' / 'such' / 'dir.py'}: ")
        await view.submit(f"/save 1 {tmp_path}")
        assert notices(app)[-1] == f"cannot save to {tmp_path}: it is a directory"
        await view.submit("/save one x.py")
        assert notices(app)[-1].startswith("usage: /save N FILE [--force]")
        await pilot.press("ctrl+c")
