"""Test models: tiny random-weight Llama/Qwen models (no download), their tokenizer, and model folders."""

from __future__ import annotations

import copy
import json
import random

import torch

from ssd_chat.engine.load.models import LoadedModel, ModelSpec, Placement


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


def randomize(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Random norm weights and biases (transformers initialises them to 1 and 0, which would hide a
    norm or bias the core forgot)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype) if "norm" in name
                        else 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def tiny_qwen(kind: str, dtype=torch.float64, tied: bool = False) -> torch.nn.Module:
    """A random Qwen3 (q/k norms, head_dim set apart from hidden/heads) or Qwen2 (qkv biases)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tied,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(11)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=24, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    return randomize(model.to(dtype).eval())


PROMPT = [3, 17, 42, 5, 9, 61, 0, 33, 12]


def save_tiny(folder, tokenizer, seed=0):
    model = tiny_llama(vocab_size=len(tokenizer.get_vocab()), seed=seed, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_chat_model(folder, tokenizer):
    """A random-weight Llama with ``tokenizer`` (SmolLM2's real one: its chat template) and a 4096-token
    context, so a long reply can keep the engine busy while a test queues requests behind it."""
    model = tiny_llama(vocab_size=len(tokenizer.get_vocab()), seed=0, dtype=torch.float32, max_pos=4096)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # the model declares greedy decoding, so replies that set no sampling option are reproducible
    # (a model that declares nothing would get the chat default: sampling, engine/load/gen_defaults.py)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}), encoding="utf-8")
    return folder


def saved_draft(result, target: LoadedModel, folder) -> LoadedModel:
    """The draft that training gave (``result``) saved to ``folder``, then derived from it for ``target``
    as a user's ``--draft FOLDER`` is."""
    from ssd_chat import train
    from ssd_chat.engine.drafts import shipped

    train.save(result.draft, folder, target.name, target.model)
    return shipped.derive(str(folder), target)
