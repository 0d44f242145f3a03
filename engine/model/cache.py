"""A preallocated KV cache for :mod:`core`: one tensor, written at explicit slots.

Per layer one K and one V tensor ``[kv_heads, capacity + 1, head_dim]``: per head the slots are
contiguous, so attention reads ``[:, :W]`` without a copy, and each is its own allocation, so a
compiled graph writes it in place (a view of one big tensor as a graph input is functionalized
into a copy of the whole cache per layer).  The last slot (``trash``) takes the KV of a compiled
shape's padding rows; nothing ever attends to it.

The committed sequence occupies slots ``[0, length)`` with slot = position; rollback, scratch
rows (any slot past ``length``) and adopting a branch are the caller's slots and masks.
Capacity is bucketed (:func:`bucket`), so growing reallocates and copies rarely, and no step ever
costs in proportion to the model's whole context window.
"""

from __future__ import annotations

import torch

from ..errors import ModelError

MIN_CAPACITY = 256


def bucket(n: int, limit: int | None = None) -> int:
    """The capacity for ``n`` slots: the next power of two >= max(n, MIN_CAPACITY), cut to ``limit``."""
    cap = max(MIN_CAPACITY, 1 << max(0, int(n) - 1).bit_length())
    return min(cap, limit) if limit else cap


class StaticKV:
    """See the module docstring.  ``limit``: the most slots it may ever hold (the model's
    context plus room for scratch rows); None for no limit."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 name: str = "model", limit: int | None = None) -> None:
        self.shape = (num_layers, 2, kv_heads, head_dim)
        self.dtype, self.device, self.name, self.limit = dtype, torch.device(device), name, limit
        self.length = 0
        with torch.inference_mode():  # the core writes it under inference mode only
            self.k, self.v = self._alloc(0)
        self.version = 0  # bumped on every reallocation (compiled graphs bound to the old tensors rebuild)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1] - 1

    @property
    def trash(self) -> int:
        return self.capacity

    def bytes_for(self, capacity: int) -> int:
        n, two, h, d = self.shape
        return n * two * h * (capacity + 1) * d * torch.empty(0, dtype=self.dtype).element_size()

    def _alloc(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n, _, h, d = self.shape
        try:
            def one() -> torch.Tensor:
                return torch.zeros((h, capacity + 1, d), dtype=self.dtype, device=self.device)
            return [one() for _ in range(n)], [one() for _ in range(n)]
        except (torch.OutOfMemoryError, RuntimeError) as e:  # CPU allocators raise RuntimeError
            if not isinstance(e, torch.OutOfMemoryError) and "alloc" not in str(e).lower() and "memory" not in str(e).lower():
                raise
            gib = self.bytes_for(capacity) / 2**30
            raise ModelError(f"out of memory allocating the KV cache of '{self.name}': {capacity} tokens "
                             f"({gib:.2f} GiB on {self.device}); try a shorter chat or fewer new tokens") from e

    @torch.inference_mode()
    def reserve(self, n: int) -> None:
        """Make room for slots ``[0, n)``: reallocate to :func:`bucket` (n) and copy what is there."""
        if n <= self.capacity:
            return
        if self.limit is not None and n > self.limit:
            raise ValueError(f"'{self.name}': {n} cache slots asked for, but its context limit is {self.limit}")
        old = self.capacity
        k, v = self._alloc(bucket(n, self.limit))
        for new, cur in zip(k + v, self.k + self.v):
            new[:, :old].copy_(cur[:, :old])
        self.k, self.v = k, v
        self.version += 1

    def truncate(self, keep: int) -> None:
        """Drop every committed slot at index >= keep (rollback)."""
        if not 0 <= keep <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {keep}")
        self.length = keep

    def set_length(self, n: int) -> None:
        """Declare slots ``[0, n)`` committed (after the caller wrote them with explicit slots)."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"length {n} is outside the cache (capacity {self.capacity})")
        self.length = n

    @torch.inference_mode()
    def adopt(self, keep: int, src: torch.Tensor | list[int]) -> None:
        """Make slots ``src`` (e.g. an SSD branch in the scratch region) the committed slots
        ``[keep, keep + len(src))``, one gather per K/V tensor; length becomes keep + len(src)."""
        n = len(src)
        if keep < 0 or keep > self.length or keep + n > self.capacity:
            raise ValueError(f"cannot adopt {n} slots at {keep} (length {self.length}, capacity {self.capacity})")
        if n:
            lo, hi = (min(src), max(src)) if isinstance(src, list) else (int(src.min()), int(src.max()))  # a list: no device read
            if lo < 0 or hi >= self.capacity:
                raise ValueError(f"adopt: source slots must lie in [0, {self.capacity})")
            idx = torch.as_tensor(src, dtype=torch.long, device=self.device)
            for t in self.k + self.v:
                t[:, keep:keep + n] = t.index_select(1, idx)
        self.length = keep + n

    # -- masks --------------------------------------------------------------------------------------
    def causal_mask(self, start: int, rows: int, width: int) -> torch.Tensor:
        """bool [rows, width]: row i sees slots [0, start + i]."""
        cols = torch.arange(width, device=self.device)
        return cols[None, :] <= (start + torch.arange(rows, device=self.device))[:, None]

    def tree_mask(self, slots: torch.Tensor, ancestors: list[list[int]] | torch.Tensor, prefix: int, width: int) -> torch.Tensor:
        """bool [rows, width]: row r sees slots [0, prefix), its ``ancestors`` (slot lists, or a bool
        [rows, <=width] of extra visible slots) and its own slot (:func:`kv.tree_mask`, on this cache's device)."""
        from .runner import tree_mask

        return tree_mask(slots.to(self.device), ancestors, prefix, width)
