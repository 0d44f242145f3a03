"""Files in a prompt (``ssd-chat ask -a FILE``) through the real entry point, and the code blocks of a
message: the turn a file makes, refusals for binary, missing and too-large files, and the fenced blocks found."""

from __future__ import annotations

import json
import os
import shutil

from helpers.cli import cli

from ssd_chat.chat import attach
from ssd_chat.chat.code_blocks import blocks

CODE = "def add(a, b):\n    return a + b\n"


def test_a_file_is_a_fenced_block_headed_by_its_name_before_the_users_text(tmp_path):
    src = tmp_path / "add.py"
    src.write_text("\ufeff" + CODE)  # a byte-order mark is not part of the text
    a = attach.read(str(src))
    assert a.text == CODE and a.lang == "python"
    assert attach.turn([a], "Explain") == f"File: {src}\n```python\n{CODE}```\n\nExplain"
    md = tmp_path / "notes.md"
    md.write_text("see:\n```sh\nls\n````\n")  # backtick runs inside: the fence is longer than any of them
    turn = attach.turn([a, attach.read(str(md))], "")
    assert turn.endswith(f"File: {md}\n`````markdown\nsee:\n```sh\nls\n````\n`````")
    assert [b.code for b in blocks(turn)] == [CODE, "see:\n```sh\nls\n````\n"]


def test_blocks_finds_each_fence_with_its_language_and_lines():
    found = blocks("text\n```python\nx = 1\ny = 2\n```\n- item\n\n  ~~~\n  z\n  ~~~\n```js open\nopen(")
    assert [(b.lang, b.code, b.describe()) for b in found] == [
        ("python", "x = 1\ny = 2\n", "python, 2 lines"), ("", "z\n", "no language, 1 line"), ("js", "open(\n", "js, 1 line")]
    assert blocks("no code here, only `inline`") == []


def test_ask_refuses_binary_missing_and_unreadable_files_in_one_line(tmp_path):
    (tmp_path / "bin.dat").write_bytes(b"PK\x03\x04\x00\x00")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9 au lait")
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    cases = [("bin.dat", "it is a binary file (it holds NUL bytes); only text files can be attached"),
             ("latin.txt", "it is not UTF-8 text (a bad byte at offset 3)"), ("nope.txt", "no such file"),
             (".", "it is a directory")]
    if not os.access(locked, os.R_OK):  # root reads it anyway
        cases.append(("locked.txt", "Permission denied"))
    for name, why in cases:
        r = cli("ask", "-a", str(tmp_path / name), "hi")
        assert r.returncode == 1, (name, r.stderr)
        assert r.stderr.strip() == f"ssd-chat: error: cannot attach {tmp_path / name}: {why}" or why in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr and r.stdout == ""


def test_ask_refuses_a_file_larger_than_the_context_before_the_weights_load(tmp_path, tiny_dir):  # noqa: F811
    broken = tmp_path / "tiny-broken"
    shutil.copytree(tiny_dir, broken)
    for w in broken.glob("*.safetensors"):
        w.write_bytes(b"not weights")  # a load would fail: the refusal comes from the tokenizer and config alone
    big = tmp_path / "big.txt"
    big.write_text("word " * 2000)
    r = cli("ask", "--target", str(broken), "-a", str(big), "hi")
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip()
    assert line.startswith(f"ssd-chat: error: cannot attach {big}: it is ") and "Traceback" not in r.stderr
    assert line.endswith(f"tokens, more than {broken}'s context of 512 tokens"), line
    assert int(line.split(" it is ")[1].split(" tokens")[0].replace(",", "")) > 2000


def test_ask_sends_the_file_in_the_question(tmp_path, tiny_dir, smol_tokenizer):  # noqa: F811
    src = tmp_path / "add.py"
    src.write_text(CODE)
    r = cli("ask", "--target", str(tiny_dir), "--mode", "ar", "-n", "3", "--json", "-a", str(src), "--attach", str(src), "hi")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["new_tokens"] == 3
    # a file that fits the context alone, but not with the question's chat template around it: the
    # prompt sent holds the file (the same question with the small file above is answered)
    near, words = tmp_path / "near.txt", 500
    while attach.count(smol_tokenizer, attach.Attachment(str(near), "word " * words).block()) > 505:
        words -= 1
    near.write_text("word " * words)
    r = cli("ask", "--target", str(tiny_dir), "--mode", "ar", "-n", "3", "-a", str(near), "hi")
    assert r.returncode == 1 and "has a context of 512 tokens" in r.stderr and "Traceback" not in r.stderr, r.stderr
