"""GGUF-precision linears for a GGUF target and its ``int8`` draft (CPU); the other derived drafts'
are in :mod:`drafts.gguf`.

* The target: every Q4_0/Q4_1/Q8_0 linear of the file becomes a :class:`quant.GGUFLinear` over
  its own blocks (exact weights; :mod:`gguf_map`), with the tiles cached in the converted folder.
* A draft shares the target's GGUFLinear where it shares its modules; its own float weights are
  quantized to Q8_0, and a reduced head takes the target head's blocks for its rows.  A draft need
  not be exact: speculative decoding stays exact because the target verifies every token.
* :func:`q8_copy` is the "int8" draft: the target with every layer re-quantized to Q8_0.

Order: load and derive drafts on the float32 target first (a trained draft checks a hash of the
shared float weights), then swap: :func:`gguf_target` and :func:`drafts.gguf.fast_draft` return the
module maps that :func:`quant.swap_modules` puts in place (and can undo).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import ModelError
from . import gguf_map
from ..cpu import quant
from ..cpu.quant import GGUFLinear


def gguf_target(lm: object, check_rows: int = 4) -> dict[str, GGUFLinear]:
    """The GGUFLinear for each quantized linear of a loaded GGUF target (``models.LoadedModel``)."""
    spec = getattr(lm, "spec", None)
    if getattr(spec, "kind", None) != "gguf":
        raise ModelError(f"'{getattr(lm, 'name', '?')}' is not a GGUF model: its linears have no blocks to compute from")
    if getattr(lm, "device", torch.device("cpu")).type != "cpu":
        raise ModelError("GGUF-precision linears run on the CPU")
    return gguf_map.gguf_linears(lm.model, spec.source, check_rows=check_rows, cache=getattr(lm, "folder", None))


def q8_copy(target: nn.Module, target_mods: dict[str, GGUFLinear]) -> nn.Module:
    """The target with every GGUF linear re-quantized to Q8_0 blocks (a GGUF Q8_0 head kept as is);
    embedding and norms shared, not copied."""
    linears = {n: m for n, m in target.named_modules() if isinstance(m, (nn.Linear, GGUFLinear))}
    memo: dict[int, object] = {id(p): p for p in target.parameters()}  # share every float tensor
    for n, m in linears.items():
        g = target_mods.get(n)
        if g is not None and g.kind == "Q8_0":
            memo[id(m)] = g
        elif isinstance(m, GGUFLinear):
            memo[id(m)] = quant.quantize(m.dequantized(), m.bias, "Q8_0")
        else:
            memo[id(m)] = quant.quantize((g.dequantized() if g is not None else m.weight), m.bias, "Q8_0")
    try:
        return copy.deepcopy(target, memo).eval()
    except Exception as e:  # noqa: BLE001 - a model object that cannot be copied
        raise ModelError(f"could not build the Q8_0 copy of the target: {e}") from e
