"""Grouped-query attention without copying the KV cache, for few-token CPU forwards.

transformers' ``sdpa`` attention passes ``enable_gqa=True`` to torch's SDPA only when there is
no attention mask.  A one-token decode step has none; a verification of k+1 tokens against a
KV cache does (the causal block), and then transformers expands K and V to every query head
(``repeat_kv``): a copy of the whole cache, in every layer, for every verification.  On
SmolLM2-135M (9 query heads over 3 KV heads) at 200 cached tokens that copy and the slower
masked kernel cost about 6-8 ms of a 2-3-token forward, 10 % of it.  torch's CPU SDPA handles
``enable_gqa`` with a mask itself, so this implementation, registered with transformers as
``ssd_sdpa``, does that on CPU and hands every other case (no mask, GPU, position bias,
softcap, attention weights asked for) to transformers' own ``sdpa`` unchanged.  Same products
per head, so the same results up to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "ssd_sdpa"
_registered = False


def sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
             is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups <= 1 or query.device.type != "cpu" or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions") or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, sdpa_gqa)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


def install(model: torch.nn.Module) -> bool:
    """Switch a CPU model that uses transformers' ``sdpa`` attention to :func:`sdpa_gqa`; True if switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    _register()
    try:
        model.set_attn_implementation(NAME)
    except Exception:  # noqa: BLE001 - a model class that refuses other implementations keeps sdpa
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME
