"""ssd_sdpa: grouped-query attention with a mask (a verification against the KV cache) without
expanding the cache to every head, and the same logits as transformers' sdpa."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations import sdpa_attention

from helpers.models import tiny_llama
from ssd_chat.engine.model import attention


def _logits_after_prefix(model, prefix: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=prefix, cache=cache, use_cache=True)
        return model(input_ids=block, cache=cache, use_cache=True).logits


def test_verification_block_matches_sdpa_without_copying_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = tiny_llama(vocab_size=64, layers=2)  # 4 query heads over 2 KV heads
    ref.set_attn_implementation("sdpa")
    fast = copy.deepcopy(ref)
    assert attention.install(fast) and fast.config._attn_implementation == attention.NAME
    assert ref.config._attn_implementation == "sdpa"
    repeats = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda h, n: repeats.append(n) or original(h, n))
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 64, (1, 20), generator=gen)
    for rows in (1, 2, 3, 5):
        block = torch.randint(0, 64, (1, rows), generator=gen)
        repeats.clear()
        want = _logits_after_prefix(ref, prefix, block)
        assert bool(repeats) == (rows > 1)  # transformers' sdpa copies K and V once a mask is needed
        repeats.clear()
        got = _logits_after_prefix(fast, prefix, block)
        assert repeats == []
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # the prompt (no cache, causal without a mask) goes to transformers' own path, same result
    torch.testing.assert_close(fast(input_ids=prefix).logits, ref(input_ids=prefix).logits, rtol=1e-10, atol=1e-10)


def test_other_attention_implementations_are_left_alone() -> None:
    model = tiny_llama(vocab_size=64, layers=1)
    model.set_attn_implementation("eager")
    assert not attention.install(model)
    assert model.config._attn_implementation == "eager"
