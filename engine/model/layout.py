"""The Llama-style layout the derived drafts are cut from: where a model's embedding, layers,
final norm and head are, and how to make a model that shares some of them.

Used by the drafts (``layers:N``, trained, feature drafts), by :mod:`runner` to record hidden
states, and by training.  Everything here reads or rebinds modules; no weight is copied.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ..errors import ModelError


def parts(target: nn.Module) -> tuple[nn.Module, Any, nn.Module, nn.Linear]:
    """(inner model, its layer list, its final norm, the output head) of a Llama-style decoder,
    or a ModelError saying why ``target`` is not one."""
    inner = getattr(target, "model", None)
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None)
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if layers is None or norm is None or not isinstance(head, nn.Linear) or not hasattr(inner, "embed_tokens"):
        raise ModelError(
            f"trained drafts need a Llama-style decoder (model.embed_tokens, model.layers, model.norm, a linear lm_head); "
            f"'{type(target).__name__}' is not one"
        )
    if getattr(target.config, "final_logit_softcapping", None) or getattr(target.config, "logit_scale", None):
        raise ModelError(f"trained drafts do not support targets that rescale their logits ('{type(target).__name__}')")
    return inner, layers, norm, head


def final_norm(model: nn.Module) -> nn.Module:
    """The module whose output is the model's final normed hidden state (what its head reads)."""
    return parts(model)[2]


def output_module(target: nn.Module, n: int) -> nn.Module:
    """The module whose output is the output of the target's first ``n`` layers (the embedding for 0);
    a forward hook on it records that hidden state (see :func:`hidden_of`)."""
    inner, layers, _, _ = parts(target)
    return inner.embed_tokens if n == 0 else layers[n - 1]


def hidden_of(out: Any) -> Any:
    """The hidden state in a module's output (decoder layers may return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def shallow(module: nn.Module) -> nn.Module:
    """A shallow copy whose module/parameter registries are its own (edits don't touch the original)."""
    c = copy.copy(module)
    c._modules = dict(module._modules)
    c._parameters = dict(module._parameters)
    c._buffers = dict(module._buffers)
    return c


def set_layer_idx(layer: nn.Module, idx: int) -> None:
    """Renumber a decoder layer (its attention reads its cache entry by this index)."""
    for m in layer.modules():
        if hasattr(m, "layer_idx"):
            m.layer_idx = idx


def sub_config(config: Any, source_layers: list[int]) -> Any:
    """A copy of ``config`` for a model made of the layers ``source_layers`` of the original."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = len(source_layers)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == config.num_hidden_layers:
        cfg.layer_types = [types[i] for i in source_layers]
    return cfg
