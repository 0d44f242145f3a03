"""Q4 GGUF linears through torch's int4 CPU GEMM (bfloat16 activations), and the CPU graph's
row-invariant attention: a verify of k + 1 rows computes bit for bit what k + 1 one-row steps compute,
which is what makes greedy SD and SSD equal AR by construction on the compiled CPU core."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ssd_chat.engine.load import gguf_map
from ssd_chat.engine.load import store as model_cache
from ssd_chat.engine.cpu import quant
from ssd_chat.engine.model.core import Core, attend_rows
from ssd_chat.engine.cpu.quant import GGUFLinear

from helpers.gguf import blocks, gguf_weight, load_gguf, write_tiny_gguf

pytestmark = pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512", "AMX")),
                                reason="torch's int4 CPU GEMM needs AVX2")


@pytest.fixture(autouse=True)
def _int4_on():
    """SSD_CHAT_CPU_KERNELS=int4, as a user sets it (the modules pack their blocks when built)."""
    old, quant.INT4[0], quant.EAGER_INT4[0] = (quant.INT4[0], quant.EAGER_INT4[0]), True, True
    yield
    quant.INT4[0], quant.EAGER_INT4[0] = old
PROMPT = [3, 17, 42, 5, 9, 61, 0, 33, 12, 7, 88, 21]


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("out_f", [130, 192])  # 130: rows padded to a multiple of 16 inside
def test_int4_product_is_the_blocks_product_in_bfloat16(kind, out_f):
    raw = blocks(out_f, 160, kind, np.random.default_rng(out_f))
    mod = GGUFLinear(raw, kind, 160)
    assert mod.int4 is not None
    w = gguf_weight(raw, kind)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(1))
    y, ref = mod(x), F.linear(x, w)
    assert y.shape == ref.shape == (3, out_f) and y.dtype == torch.float32
    # bfloat16 activations, scales and outputs: relative error of a few 2^-8
    assert (y - ref).abs().max().item() < 0.03 * ref.abs().max().item()
    assert (y - ref).abs().max().item() > 0  # it is the int4 path, not the float32 kernels


def test_int4_rows_do_not_depend_on_the_other_rows():
    mod = GGUFLinear(blocks(200, 576, "Q4_1", np.random.default_rng(7)), "Q4_1", 576)
    x = torch.randn(quant.KERNEL_MAX_ROWS, 576)
    full = mod(x)
    for r in range(1, quant.KERNEL_MAX_ROWS + 1):
        assert torch.equal(mod(x[:r]), full[:r])
        assert torch.equal(mod(x[r - 1:r]), full[r - 1:r])


def test_switching_int4_off_gives_the_float32_kernels():
    raw = blocks(64, 96, "Q4_1", np.random.default_rng(3))
    mod = GGUFLinear(raw, "Q4_1", 96)
    x = torch.randn(2, 96)
    fast = mod(x)
    old, quant.INT4[0] = quant.INT4[0], False
    try:
        exact = mod(x)
    finally:
        quant.INT4[0] = old
    w = gguf_weight(raw, "Q4_1")
    assert (exact - F.linear(x, w)).abs().max().item() < 1e-5 * F.linear(x, w).abs().max().item()
    assert not torch.equal(fast, exact)


def test_attend_rows_is_attention_and_row_invariant():
    g = torch.Generator().manual_seed(0)
    hkv, hq, d, W = 2, 6, 16, 40
    q, k, v = torch.randn(3, hq, d, generator=g), torch.randn(hkv, W, d, generator=g), torch.randn(hkv, W, d, generator=g)
    mask = torch.zeros(3, W, dtype=torch.bool)
    for i, p in enumerate((20, 21, 22)):
        mask[i, :p + 1] = True
    got = attend_rows(q, k, v, mask, 0.25)
    qf = q.transpose(0, 1).reshape(hkv, hq // hkv, 3, d)
    ref = F.scaled_dot_product_attention(qf, k[:, None], v[:, None], attn_mask=mask[None].expand(hkv, hq // hkv, 3, W)[:, :],
                                         scale=0.25).reshape(hq, 3, d).transpose(0, 1)
    assert torch.allclose(got, ref, atol=1e-5)
    for i in range(3):  # alone, and with a window padded by masked slots
        assert torch.allclose(attend_rows(q[i:i + 1], k, v, mask[i:i + 1], 0.25), got[i:i + 1], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("threads,attention", [(1, "inductor"), (2, "inductor"), (2, "numba")])
def test_the_compiled_cpu_core_verifies_bit_for_bit_like_one_row_steps(tmp_path_factory, monkeypatch, threads, attention):
    """Real inductor, the tiny GGUF model: every row of a 3-row verify equals the one-row step at its
    position, bit for bit, across window sizes that cross the padding step (SDPA does not give this),
    with either attention (``SSD_CHAT_ATTENTION``)."""
    monkeypatch.setenv("SSD_CHAT_ATTENTION", attention)
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", layers=2, seed=5)
    model = load_gguf(path)
    quant.swap_modules(model, gguf_map.gguf_linears(model, path, check_rows=10**6))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        notices: list[str] = []
        core = Core(model, "comp", compile="on", rows=(1, 3), notify=notices.append)
        core.append(PROMPT, logits="none")  # a prompt: eager, the same in both
        start = core.kv.length
        seq = [int(t) for t in torch.randint(0, 90, (24,), generator=torch.Generator().manual_seed(2))]
        steps = torch.stack([core.append([t]).logits[-1] for t in seq])
        for j in range(0, len(seq) - 2):
            core.kv.truncate(start + j)
            verify = core.append(seq[j:j + 3]).logits
            assert torch.equal(verify, steps[j:j + 3]), f"rows at {start + j}.. differ"
        assert not notices, notices
        assert core.compiler.active and set(core.compiler._fns) == {(1, threads), (3, threads)}
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_cpu_graph_is_built_once_then_loaded(tmp_path, monkeypatch):
    """The AOTInductor package is stored under the cache dir; a second core over the same weights
    loads it (no 'compiling' line) and computes the same logits; other weights get a package of their own."""
    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", layers=1, seed=9)
    model = load_gguf(path)
    quant.swap_modules(model, gguf_map.gguf_linears(model, path, check_rows=10**6))
    said: list[str] = []
    first = Core(model, "pkg", compile="on", rows=(1,), progress=said.append)
    first.append(PROMPT, logits="none")
    a = first.append([4]).logits
    assert said == ["compiling pkg for 1 row (once)"] and len(list((tmp_path / "aoti").glob("*.pt2"))) == 1
    (built,) = (tmp_path / "aoti").glob("*.pt2")  # who can load it, for `models cache prune`
    assert not model_cache.built_elsewhere(built) and built.with_suffix(".json").is_file()
    again: list[str] = []
    second = Core(model, "pkg", compile="on", rows=(1,), progress=again.append)
    second.append(PROMPT, logits="none")
    assert torch.equal(second.append([4]).logits, a) and again == []
    from ssd_chat.engine.model import aoti

    same, other = load_gguf(path), load_gguf(write_tiny_gguf(tmp_path / "other.gguf", layers=1, seed=10))
    assert aoti.fingerprint(same) == aoti.fingerprint(load_gguf(path)) != aoti.fingerprint(other)

    # The loader unpacks a package under the cache dir, not in $TMPDIR: a process that ends without
    # destroying its loader (a signal, os._exit) leaves its ~200 MB there, and the next load removes them.
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    package = next((tmp_path / "aoti").glob("*.pt2"))
    script = ("import os, pathlib; from ssd_chat.engine.cpu import quant; from ssd_chat.engine.model import aoti; "
              f"f = aoti.load_package(pathlib.Path({str(package)!r})); "
              "print(os.getpid(), len(list(aoti.unpack_dir().glob('aotinductor_*'))), "
              "len(list(pathlib.Path(os.environ['TMPDIR']).glob('aotinductor_*'))), flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(tmpdir)},
                         capture_output=True, text=True, check=True).stdout
    pid, unpacked, in_tmp = (int(x) for x in out.split()[-3:])
    assert (unpacked, in_tmp) == (1, 0)
    gone = tmp_path / "unpacked" / str(pid)
    (gone / "aotinductor_left").mkdir(parents=True, exist_ok=True)  # as a process killed while loaded leaves it
    aoti.load_package(package)
    assert not gone.exists()
