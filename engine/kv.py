"""The KV-cache discipline: create, append (through the model's forward), roll back.

Rollback is truncation to a length.  transformers 5 changed ``Cache.crop`` to take the
number of tokens to *remove*; everything else in ssd-chat goes through
:func:`truncate`, which takes the length to keep.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model: torch.nn.Module) -> DynamicCache:
    return DynamicCache(config=model.config)


def length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def truncate(cache: DynamicCache, keep: int) -> None:
    """Drop every cached position at index >= keep."""
    n = length(cache)
    if keep < 0 or keep > n:
        raise ValueError(f"cannot truncate a cache of {n} tokens to {keep}")
    if keep < n:
        cache.crop(-(n - keep))  # transformers 5.24: a negative count removes that many; positive raises


@torch.inference_mode()
def forward(model: torch.nn.Module, ids: torch.Tensor, cache: DynamicCache, last_only: bool = False) -> torch.Tensor:
    """Run ``ids`` [T] (or [B, T]) through ``model`` after the cached prefix and append
    their KV to ``cache``.  Returns logits [T, V] (or [B, T, V]); ``last_only``: [1, V]."""
    batched = ids.dim() == 2
    x = ids if batched else ids[None]
    start = length(cache)
    pos = torch.arange(start, start + x.shape[1], device=x.device)
    out = model(
        input_ids=x,
        cache=cache,
        use_cache=True,
        position_ids=pos[None].expand(x.shape[0], -1),
        logits_to_keep=1 if last_only else 0,
    )
    logits = out.logits
    return logits if batched else logits[0]
