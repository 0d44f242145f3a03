"""A trained draft derived from its target: shared trunk + small trained tail + reduced-vocabulary head.

Shape (for a Llama-style target with ``model.layers``)::

    target embedding ─> target layers 0..S-1 ─> new layers (trained) ─> final norm (trained) ─> reduced head
    └──────────── shared, frozen, never saved ─┘  └────────────────── saved in the draft folder ───────────┘

* The shared trunk is the target's own modules (no copy, no extra memory); a hash of the shared
  weights in the manifest makes loading refuse a different target.
* The head scores only the ``V'`` tokens the target emits on the training data, with the target's
  own output-embedding rows, and returns full-vocabulary logits with ``-inf`` elsewhere.
  Speculative sampling is exact for *any* proposal q (the residual ``max(p - q, 0)`` gives a token
  outside q's support its target probability), so this costs acceptance, never correctness.
* The draft is an object of the target's own class (a shallow copy with its own layer list and
  config), so it is called exactly like any model, with one cache entry per layer it runs.

Loading a draft folder is :mod:`draft_folder`; training one is ``ssd_chat.train``.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from ..model.layout import parts, set_layer_idx, shallow, sub_config


class ReducedHead(nn.Module):
    """Logits over ``ids`` (the reduced vocabulary) from fixed target rows plus a trained bias,
    scattered into a full-vocabulary tensor that is ``-inf`` elsewhere.

    The rows are the weight of a frozen ``proj`` Linear (so the CPU fast path serves it like any
    other), not a ``weight`` of the head: code that reads the head's width from ``weight`` falls
    back to ``config.vocab_size``, the full width."""

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor, vocab_size: int, row_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.proj = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        self.proj.weight = nn.Parameter(rows.detach().clone(), requires_grad=False)  # [V', H], from the target
        self.register_buffer("ids", ids.detach().clone().long(), persistent=False)  # [V']
        fixed = row_bias.detach().clone() if row_bias is not None else torch.zeros(len(ids), dtype=rows.dtype, device=rows.device)
        self.register_buffer("fixed_bias", fixed, persistent=False)  # the target head's own bias, if any
        self.bias = nn.Parameter(torch.zeros(len(ids), dtype=rows.dtype, device=rows.device))  # trained

    @property
    def rows(self) -> torch.Tensor:
        return self.proj.weight

    def sub_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> logits over the reduced vocabulary [..., V']."""
        return self.proj(h) + (self.fixed_bias + self.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sub = self.sub_logits(h)
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.ids] = sub
        return full


@dataclass(frozen=True, slots=True)
class DraftShape:
    """Which target layers are shared and which target layers initialise the new ones."""

    num_shared: int
    init_from: tuple[int, ...]  # one target layer index per new layer

    @property
    def num_layers(self) -> int:
        return self.num_shared + len(self.init_from)


def check_shape(target: nn.Module, shape: DraftShape) -> None:
    _, layers, _, _ = parts(target)
    n = len(layers)
    if not 0 <= shape.num_shared < n:
        raise ModelError(f"--layers {shape.num_shared}: the target has {n} layers, so share between 0 and {n - 1}")
    if not shape.init_from:
        raise ModelError("a trained draft needs at least one new layer")
    bad = [i for i in shape.init_from if not 0 <= i < n]
    if bad:
        raise ModelError(f"cannot initialise new layers from target layer(s) {bad}: the target has layers 0-{n - 1}")


def reduced_head(head: nn.Linear, vocab_ids: torch.Tensor) -> "ReducedHead":
    """A zero-bias head over ``vocab_ids`` made of the target head's rows (checked ids)."""
    vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long, device=head.weight.device)
    vocab_size = int(head.weight.shape[0])
    if vocab_ids.numel() == 0 or int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= vocab_size:
        raise ModelError(f"the draft's vocabulary ids must lie in 0..{vocab_size - 1}")
    bias = head.bias.detach()[vocab_ids] if head.bias is not None else None
    return ReducedHead(head.weight.detach()[vocab_ids], vocab_ids, vocab_size, bias)


def build(target: nn.Module, shape: DraftShape, vocab_ids: torch.Tensor) -> nn.Module:
    """A fresh draft for ``target``: shared trunk, new layers copied from ``shape.init_from``,
    a copy of the final norm, and a zero-bias head over ``vocab_ids``."""
    check_shape(target, shape)
    inner, layers, norm, head = parts(target)
    lm_head = reduced_head(head, vocab_ids)
    new_layers = []
    for j, src in enumerate(shape.init_from):
        layer = copy.deepcopy(layers[src])
        set_layer_idx(layer, shape.num_shared + j)
        layer.requires_grad_(True)
        new_layers.append(layer)
    source = list(range(shape.num_shared)) + list(shape.init_from)
    cfg = sub_config(target.config, source)
    draft_inner = shallow(inner)
    draft_inner.layers = nn.ModuleList(list(layers)[: shape.num_shared] + new_layers)  # shared layers are the same objects
    draft_inner.norm = copy.deepcopy(norm).requires_grad_(True)
    draft_inner.config = cfg
    draft = shallow(target)
    draft.model = draft_inner
    draft.config = cfg
    draft.lm_head = lm_head
    draft.ssd_shape = shape
    return draft.eval()


# --- what a draft folder stores and checks -------------------------------------------------------


def shared_params(target: nn.Module, num_shared: int) -> list[tuple[str, torch.Tensor]]:
    """The target tensors a draft with ``num_shared`` shared layers depends on (names are stable).
    ``num_shared`` -1: the whole target (a feature draft reads its final hidden states)."""
    inner, layers, norm, head = parts(target)
    out = [(f"embed.{n}", p) for n, p in inner.embed_tokens.named_parameters()]
    for i in range(len(layers) if num_shared < 0 else num_shared):
        out += [(f"layers.{i}.{n}", p) for n, p in layers[i].named_parameters()]
    if num_shared < 0:
        out += [(f"norm.{n}", p) for n, p in norm.named_parameters()]
    if head.weight is not inner.embed_tokens.weight:
        out.append(("head.weight", head.weight))
    if head.bias is not None:
        out.append(("head.bias", head.bias))
    return out


def shared_hash(target: nn.Module, num_shared: int) -> str:
    """sha256 over the shared tensors rounded to bfloat16 (so fp32 and bf16 loads of the same
    checkpoint agree), with their names and shapes."""
    h = hashlib.sha256()
    cfg = target.config
    h.update(f"{getattr(cfg, 'model_type', '')}:{cfg.hidden_size}:{cfg.vocab_size}:{num_shared}".encode())
    for name, t in shared_params(target, num_shared):
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def own_state(layers: Any, norm: nn.Module, head: "ReducedHead") -> dict[str, torch.Tensor]:
    """The stored names of a draft's own layers, final norm and head bias."""
    out: dict[str, torch.Tensor] = {}
    for j, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            out[f"layers.{j}.{n}"] = p
    for n, p in norm.named_parameters():
        out[f"norm.{n}"] = p
    out["head.bias"] = head.bias
    return out


def trainable_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the draft folder stores (tail layers, norm, head bias; a feature draft adds its fc)."""
    if getattr(draft, "needs_features", False):  # a feature draft lists its own
        return draft.trainable_state()
    return own_state(list(draft.model.layers)[draft.ssd_shape.num_shared :], draft.model.norm, draft.lm_head)
