"""The drafts derived from a GGUF target in its precision (:mod:`load.precision`, CPU): ``copy`` is
the target's very modules; ``int8`` its Q8_0 copy (:func:`gguf_weights.q8_copy`); ``layers:N`` and a
trained draft are derived on the float view, then share the target's GGUF linears and keep their own
linears as Q8_0 blocks (:func:`fast_draft`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..cpu import fastlinear, quant
from ..cpu.quant import GGUFLinear
from ..load import gguf_weights, precision
from ..load.models import LoadedModel, ModelSpec
from ..model.layout import shallow
from . import shipped
from .model import ReducedHead


def derive(name: str, target: Any) -> Any:
    """The derived draft ``name`` (:func:`shipped.derive`) in the target's precision."""
    g = precision.state(target)
    if g is None:
        return shipped.derive(name, target)
    if name in ("int8", "copy"):
        if name == "int8":  # Q8_0 blocks for every linear: what torch's dynamic int8 copy is for the float model
            model = gguf_weights.q8_copy(target.model, g.modules)
        else:  # the target's very modules, GGUF blocks included
            model = shallow(target.model)
        draft = LoadedModel(name=name, spec=ModelSpec(name, "derived", name), model=model.eval(), tokenizer=target.tokenizer,
                            placement=target.placement, folder=target.folder, eos_ids=target.eos_ids)
    else:
        with precision.float_view(target), fastlinear.suspended():  # its linears are replaced next
            draft = shipped.derive(name, target)
        quant.swap_modules(draft.model, fast_draft(draft.model, g.modules))
        fastlinear.install(draft.model)
    precision.label_derived(draft, target)
    return draft


def _by_weight(target_mods: dict[str, GGUFLinear]) -> dict[int, GGUFLinear]:
    """The target's GGUFLinears keyed by the float weight they replace (data pointer)."""
    return {m.dense.data_ptr(): m for m in target_mods.values() if m.dense is not None}


def fast_draft(draft: nn.Module, target_mods: dict[str, GGUFLinear], kind: str = "Q8_0") -> dict[str, nn.Module]:
    """Modules to swap into ``draft`` (derived from the float32 target whose GGUF linears are
    ``target_mods``): shared target linears -> the target's GGUFLinear, the draft's own linears ->
    ``kind`` blocks, a reduced head's rows (its ``proj``) -> the target head's blocks for those rows."""
    shared = _by_weight(target_mods)
    head = next((m for m in target_mods.values() if m.kind == "Q8_0" and m.dense is not None
                 and m.dense.shape[0] == getattr(draft.config, "vocab_size", -1)), None)
    out: dict[str, nn.Module] = {}
    heads: set[int] = set()
    for name, m in draft.named_modules():
        if isinstance(m, ReducedHead):
            out[f"{name}.proj" if name else "proj"] = _head_rows(m, shared, head)
            heads.add(id(m.proj))
        elif isinstance(m, nn.Linear) and id(m) not in heads:  # nn.Linear or the fast path's FastLinear
            out[name] = shared.get(m.weight.data_ptr()) or quant.quantize(m.weight, m.bias, kind)
    return out


def _head_rows(m: nn.Module, shared: dict[int, GGUFLinear], head: GGUFLinear | None) -> GGUFLinear:
    """The reduced head's rows as blocks: the target head's own blocks where its rows are that
    head's rows (bit for bit, on sampled rows: a trained draft copies them), else quantized."""
    j = torch.linspace(0, len(m.ids) - 1, min(16, len(m.ids))).long()  # sampled rows (all would cost 0.2 s a start)
    if head is not None and head.dense is not None and torch.equal(head.dense[m.ids[j].cpu()], m.rows[j].cpu()):
        return head.select_rows(m.ids)
    return quant.quantize(m.rows, None, "Q8_0")
