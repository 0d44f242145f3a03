"""The KV cache and the per-model runner every decoder drives: the one place that drives a cache.

A runner is one model's forward over one growing sequence (``append``, ``truncate``, scratch
``step`` rows and ``adopt``; decoders and the SSD speculator call nothing else to run a model).
:class:`Runner` runs a transformers model (or a feature draft) on a ``DynamicCache``, where scratch
rows are appended after the committed ones, so tree slots must continue the scratch region in order
and the next ``append`` or ``truncate`` drops them.  :class:`CoreRunner` runs the compact core
(:mod:`core`) over its :class:`cache.StaticKV`, where any slot past the committed length is scratch.

transformers 5 changed ``Cache.crop`` to take the number of tokens to *remove*; everything here
goes through :func:`truncate`, which takes the length to keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

LOGITS = ("all", "last", "none")


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


def tree_mask(slots: torch.Tensor, ancestors: list[list[int]] | torch.Tensor, prefix: int, width: int) -> torch.Tensor:
    """bool [rows, width]: row r sees slots [0, prefix), its ``ancestors`` (slot lists, or a bool
    [rows, <= width] of extra visible slots) and its own slot ``slots[r]``."""
    dev = slots.device
    rows = int(slots.numel())
    mask = torch.zeros(rows, width, dtype=torch.bool, device=dev)
    mask[:, :prefix] = True
    if isinstance(ancestors, torch.Tensor):
        mask[:, : ancestors.shape[1]] |= ancestors.to(dev, torch.bool)
    else:
        if len(ancestors) != rows:
            raise ValueError(f"{len(ancestors)} ancestor lists for {rows} rows")
        r = [i for i, a in enumerate(ancestors) for _ in a]
        c = [s for a in ancestors for s in a]
        if c:
            mask[torch.tensor(r, device=dev), torch.tensor(c, device=dev)] = True
    mask[torch.arange(rows, device=dev), slots] = True
    return mask


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask [T, W] as the 4D additive mask transformers takes: 0 where visible, the dtype's min elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)[None, None]


@dataclass
class Out:
    """What a forward returns (the fields of the core's ``CoreOutput``)."""

    logits: torch.Tensor | None  # [rows asked for, V]
    hidden: torch.Tensor | None = None  # [T, H]: the final normed hidden state (a feature draft: its own)
    mid: torch.Tensor | None = None  # [T, H]: the output of the first ``mid_layer`` layers


class ModelRunner(Protocol):
    """What a decoder calls on one model's forward over one sequence: :class:`Runner` (transformers'
    modules and DynamicCache) and :class:`CoreRunner` (the compact core) both are one."""

    device: torch.device

    @property
    def length(self) -> int: ...
    def append(self, ids: list[int] | torch.Tensor, logits: str = "all", hidden: bool = False) -> Out: ...
    def step(self, ids: list[int] | torch.Tensor, positions: list[int] | torch.Tensor, slots: list[int],
             mask: torch.Tensor, logits: str = "all") -> Out: ...
    def truncate(self, keep: int) -> None: ...
    def adopt(self, keep: int, slots: list[int]) -> bool: ...


class Runner:
    """One model's forward over one sequence, on a transformers ``DynamicCache``.

    ``mid_layer`` n: forwards asked for ``hidden`` also return the output of the first n layers
    (0: the embedding), what a fused feature draft reads."""

    label = "transformers"  # what forwards it, for the panel and ``ask --json``

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None, mid_layer: int | None = None) -> None:
        emb = _first_weight(model)
        self.model = model
        self.device = torch.device(device) if device is not None else emb.device
        self.dtype = emb.dtype
        self.mid_layer = mid_layer
        self.cache = new_cache(model)
        self._length = 0  # committed tokens; the cache may hold scratch rows after them

    @property
    def length(self) -> int:
        return self._length

    @property
    def scratch(self) -> int:
        """Scratch rows the cache holds after the committed ones."""
        return length(self.cache) - self._length

    def reset(self) -> None:
        self.truncate(0)

    def truncate(self, keep: int) -> None:
        """Drop every committed position at index >= keep (and any scratch rows)."""
        if not 0 <= keep <= self._length:
            raise ValueError(f"cannot truncate a sequence of {self._length} tokens to {keep}")
        truncate(self.cache, keep)
        self._length = keep

    @torch.inference_mode()
    def append(self, ids: list[int] | torch.Tensor, logits: str = "all", hidden: bool = False,
               features: torch.Tensor | None = None) -> Out:
        """Feed ``ids`` after the committed tokens (causal) and commit them.  ``logits``: ``all``,
        ``last`` or ``none``; ``hidden``: also the final normed hidden states (and the ``mid_layer``
        output); ``features``: a feature draft's input features [T, H]."""
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {', '.join(LOGITS)}, got '{logits}'")
        if self.scratch:
            truncate(self.cache, self._length)
        x = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=self.device)
        x = x.reshape(1, -1).to(self.device)
        start = self._length
        pos = torch.arange(start, start + x.shape[1], device=self.device)[None]
        kwargs: dict[str, Any] = {} if features is None else {"features": features[None]}
        with _Recorder(self.model, self.mid_layer if hidden and features is None else None, hidden and features is None) as rec:
            out = self.model(input_ids=x, cache=self.cache, use_cache=True, position_ids=pos,
                             logits_to_keep=0 if logits == "all" else 1, **kwargs)
        self._length = start + x.shape[1]
        own = getattr(out, "hidden", None)  # a feature draft returns its own hidden states
        h = (own[0] if own is not None else rec.final) if hidden else None
        return Out(None if logits == "none" else out.logits[0], h, rec.mid)

    @torch.inference_mode()
    def step(self, ids: list[int] | torch.Tensor, positions: list[int] | torch.Tensor, slots: list[int] | torch.Tensor,
             mask: torch.Tensor, logits: str = "all") -> Out:
        """Scratch rows ``ids`` at RoPE ``positions``, their K/V at ``slots`` (on a DynamicCache: the
        next slots after the scratch region), row r attending to the slots where ``mask[r]`` (bool
        [rows, end of the rows' slots], :func:`tree_mask`) is True: one depth of an SSD tree, whose
        caller keeps the mask across depths.  Nothing is committed."""
        x = torch.as_tensor(ids, device=self.device).reshape(-1)
        sl = torch.as_tensor(slots, device=self.device).reshape(-1)
        end = length(self.cache)
        if not torch.equal(sl, torch.arange(end, end + x.numel(), device=self.device)):
            raise ValueError(f"tree rows on a DynamicCache go at slots {end}..{end + x.numel() - 1}")
        mask = additive(mask.to(self.device, torch.bool), self.dtype)
        pos = torch.as_tensor(positions, device=self.device).reshape(1, -1)
        out = self.model(input_ids=x[None], cache=self.cache, use_cache=True, position_ids=pos, attention_mask=mask,
                         logits_to_keep=0 if logits == "all" else 1)
        return Out(None if logits == "none" else out.logits[0])

    @torch.inference_mode()
    def adopt(self, keep: int, slots: list[int]) -> bool:
        """Make scratch ``slots`` the committed positions ``keep..keep+len(slots)-1`` (their RoPE
        positions must already be those), dropping everything else after ``keep``.  False (and
        nothing changed) where this cache cannot: the caller recomputes those positions instead."""
        layers = getattr(self.cache, "layers", None)
        end = length(self.cache)
        if not layers or any(type(x).__name__ != "DynamicLayer" for x in layers):
            return False  # sliding-window and quantized layers keep their own bookkeeping
        if not 0 <= keep <= self._length or any(not self._length <= s < end for s in slots):
            return False
        idx = torch.cat([torch.arange(keep), torch.as_tensor(slots, dtype=torch.long)]).to(self.device)
        for layer in layers:
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)
        self._length = keep + len(slots)
        return True


class CoreRunner:
    """:class:`Runner`'s calls on a :class:`core.Core` (its cache is a :class:`cache.StaticKV`)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.model = core.model
        self.device, self.dtype = core.device, core.dtype
        self.mid_layer = core.mid_layer

    @property
    def length(self) -> int:
        return self.core.kv.length

    @property
    def label(self) -> str:
        """What forwards this runner: "core compiled" while its reply runs compiled graphs, else "core eager"."""
        return tp_label("core compiled" if self.core.compiler.compiled else "core eager", getattr(self.core, "world", 1))

    def reset(self) -> None:
        self.core.reset()

    def truncate(self, keep: int) -> None:
        self.core.kv.truncate(keep)

    def append(self, ids: list[int] | torch.Tensor, logits: str = "all", hidden: bool = False,
               features: torch.Tensor | None = None) -> Out:
        if features is not None:
            raise ValueError("the core runs plain decoders; a feature draft runs on transformers")
        out = self.core.append(ids, logits=logits, hidden=hidden)
        return Out(out.logits, out.hidden, out.mid)

    def step(self, ids: list[int] | torch.Tensor, positions: list[int] | torch.Tensor, slots: list[int],
             mask: torch.Tensor, logits: str = "all") -> Out:
        """As :meth:`Runner.step`; ``slots`` (a list: no device sync to check them) past the committed length."""
        if min(slots) < self.length:
            raise ValueError(f"tree rows must go at slots >= the committed length {self.length}")
        return Out(self.core.step(ids, positions, slots, mask, logits=logits).logits)

    def adopt(self, keep: int, slots: list[int]) -> bool:
        """As :meth:`Runner.adopt`: one gather of the branch's slots into place."""
        kv = self.core.kv
        if not 0 <= keep <= kv.length or any(not kv.length <= s < kv.capacity for s in slots):
            return False
        kv.adopt(keep, slots)
        return True


def tp_label(label: str, world: int) -> str:
    """A forward's label with its tensor-parallel ranks: "core eager, 2 tensor-parallel ranks"."""
    return f"{label}, {world} tensor-parallel ranks" if world > 1 else label


def _first_weight(model: torch.nn.Module) -> torch.Tensor:
    """The input embedding's weight (where the ids go, and the dtype of the activations), else any parameter."""
    get = getattr(model, "get_input_embeddings", None)
    w = getattr(get(), "weight", None) if callable(get) else None
    return w if isinstance(w, torch.Tensor) else next(model.parameters())


class _Recorder:
    """Forward hooks that record the final normed hidden state and the output of layer ``mid``
    (batch row 0) during one forward, for a target whose drafts read them."""

    def __init__(self, model: torch.nn.Module, mid: int | None, final: bool) -> None:
        self.final: torch.Tensor | None = None
        self.mid: torch.Tensor | None = None
        self._hooks: list[Any] = []
        if final or mid is not None:
            from .layout import final_norm, hidden_of, output_module

            def recorder(attr: str) -> Any:
                def record(mod: Any, args: Any, out: Any) -> None:
                    setattr(self, attr, hidden_of(out)[0].detach())
                return record

            if final:
                self._hooks.append(final_norm(model).register_forward_hook(recorder("final")))
            if mid is not None:
                self._hooks.append(output_module(model, mid).register_forward_hook(recorder("mid")))

    def __enter__(self) -> "_Recorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
