"""A feature-conditioned draft (EAGLE-style, Li et al. 2024) derived from its target.

The draft reads, besides each token, the target's own final hidden state at the position before
it: the vector the target's head turns into the distribution of that very token, the richest
summary of the context there is, so a single small layer on top of it predicts the target's next
step far better than a small stand-alone model (measured on SmolLM2-135M in the README)::

    f[p-1] (target feature, or the draft's own for a drafted token) ─┐
    token x[p] ─> target embedding (shared, frozen) ────────────────┴> fc ─> new layer(s) ─> norm ─> h[p]
                                                                              reduced head(h[p]) = next-token logits

* ``h[p]`` is trained to be both the target's feature at p (regression) and, through the target's
  head rows over a reduced vocabulary, its next-token distribution (KL).  A drafted position's
  feature is the draft's own ``h`` until the target verifies the token and its true feature replaces it.
* With ``fuse_layer`` n (EAGLE-3-style, Li et al. 2025), a feature is ``fuse([mid_norm(m) | f])``,
  m the output of the target's first n layers: a lower layer keeps more of the context than the
  final state, which the target has already spent on predicting the next token.  ``fuse`` starts
  as "f alone", so an untrained fused draft equals the plain one.
* As for :mod:`draft_model`, the folder stores only the draft's own tensors; the embedding and
  head rows are rebuilt from the target, whose hash the manifest records.

Calling convention (not a transformers model): ``draft(input_ids=[B, T], features=[B, T, H],
cache=..., position_ids=..., attention_mask=..., logits_to_keep=...)`` returns ``logits`` [B, T', V]
(full vocabulary, -inf outside the reduced one) and ``hidden`` [B, T, H]; ``features[:, t]`` is the
feature of the position *before* token t (zeros for the first token of a sequence).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ParamError
from ..model.layout import parts, set_layer_idx, shallow, sub_config
from .model import DraftShape, check_shape, own_state, reduced_head

__all__ = ["FeatureDraft", "FeatureOutput", "check_fuse_layer", "is_feature_draft"]


def is_feature_draft(model: Any) -> bool:
    """A feature draft reads the target's hidden states besides its tokens (only SD provides them)."""
    return bool(getattr(model, "needs_features", False))


@dataclass
class FeatureOutput:
    logits: torch.Tensor
    hidden: torch.Tensor


class FeatureDraft(nn.Module):
    """See the module docstring.  ``needs_features`` tells decoders to feed it target features."""

    needs_features = True

    def __init__(self, target: nn.Module, init_from: tuple[int, ...], vocab_ids: torch.Tensor,
                 fuse_layer: int | None = None) -> None:
        super().__init__()
        inner, layers, norm, head = parts(target)
        self.init_from = tuple(int(i) for i in init_from)
        self.fuse_layer = check_fuse_layer(target, fuse_layer)
        self.ssd_shape = DraftShape(0, self.init_from)  # nothing shared but the embedding and head rows
        check_shape(target, self.ssd_shape)
        lm_head = reduced_head(head, vocab_ids)
        hid = int(target.config.hidden_size)
        w = head.weight
        self.hidden_size = hid
        object.__setattr__(self, "_embed", inner.embed_tokens)  # shared and frozen: not a submodule (never saved)
        self.fc = nn.Linear(2 * hid, hid, bias=True, device=w.device, dtype=w.dtype)
        with torch.no_grad():  # start as "embedding + feature": a sensible residual stream for the copied layers
            self.fc.weight.zero_()
            self.fc.weight[:, :hid].copy_(torch.eye(hid))
            self.fc.weight[:, hid:].copy_(torch.eye(hid))
            self.fc.bias.zero_()
        if self.fuse_layer is not None:  # fuse(mid_norm(mid), final): starts as "final" alone
            self.mid_norm = copy.deepcopy(norm)
            self.fuse = nn.Linear(2 * hid, hid, bias=True, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                self.mid_norm.weight.fill_(1.0)
                self.fuse.weight.zero_()
                self.fuse.weight[:, hid:].copy_(torch.eye(hid))
                self.fuse.bias.zero_()
        new_layers = []
        for j, src in enumerate(self.init_from):
            layer = copy.deepcopy(layers[src])
            set_layer_idx(layer, j)
            new_layers.append(layer)
        cfg = sub_config(target.config, list(self.init_from))
        body = shallow(inner)
        body.layers = nn.ModuleList(new_layers)
        body.norm = copy.deepcopy(norm)
        body.config = cfg
        body._modules.pop("embed_tokens", None)  # inputs_embeds only
        body.embed_tokens = None
        self.body = body
        self.config = cfg
        self.lm_head = lm_head
        self.requires_grad_(True)
        self.lm_head.rows.requires_grad_(False)

    # transformers-like accessors used around the engine
    def get_input_embeddings(self) -> nn.Module:
        return self._embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def true_features(self, f: torch.Tensor) -> torch.Tensor:
        """The feature the draft reads for a position the target has run: the target's final
        normed hidden state ``f`` [.., H], or, for a fused draft, ``fuse`` over [mid | final]
        (``f`` [.., 2H] as :func:`drafting.target_features` gives it)."""
        if self.fuse_layer is None:
            return f
        hid = self.hidden_size
        return self.fuse(torch.cat([self.mid_norm(f[..., :hid]), f[..., hid:]], dim=-1))

    def inputs(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        e = self._embed(input_ids).detach().to(self.fc.weight.dtype)
        return self.fc(torch.cat([e, features.to(e.dtype)], dim=-1))

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, cache: Any = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0, use_cache: bool = True,
                **_: Any) -> FeatureOutput:
        x = self.inputs(input_ids, features)
        out = self.body(inputs_embeds=x, cache=cache, use_cache=use_cache and cache is not None,
                        position_ids=position_ids, attention_mask=attention_mask)
        h = out.last_hidden_state
        hk = h[:, -logits_to_keep:] if logits_to_keep else h
        return FeatureOutput(self.lm_head(hk), h)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        own = {f"fc.{n}": p for n, p in self.fc.named_parameters()}
        if self.fuse_layer is not None:
            own.update({f"fuse.{n}": p for n, p in self.fuse.named_parameters()})
            own.update({f"mid_norm.{n}": p for n, p in self.mid_norm.named_parameters()})
        return {**own, **own_state(self.body.layers, self.body.norm, self.lm_head)}


def check_fuse_layer(target: nn.Module, fuse_layer: int | None) -> int | None:
    """``fuse_layer`` n: the draft also reads the output of the target's first n layers
    (0: the embedding); it must be a layer below the last."""
    if fuse_layer is None:
        return None
    n = int(target.config.num_hidden_layers)
    if not 0 <= int(fuse_layer) < n:
        raise ParamError(f"--fuse-layer must be between 0 and {n - 1} for this target ({n} layers), got {fuse_layer}")
    return int(fuse_layer)
