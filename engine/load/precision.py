"""Which precision a model computes in, and the switch of a GGUF target to its own precision.

A GGUF target on the CPU with ``--dtype auto`` (the default) computes its quantized linears from
the file's blocks (:class:`quant.GGUFLinear`: the same weights as the float32 copy transformers
loads, read at 0.6 byte per weight instead of 4), and the drafts derived from it follow
(:mod:`drafts.gguf`): ``layers:N`` and ``copy`` share the target's GGUF linears, ``int8`` is a
Q8_0 copy on the same kernels, a trained draft shares the target's blocks and keeps its own layers
as Q8_0 blocks.  ``--dtype float32`` keeps the float32-dequantized model: the reference path.

The float32 modules stay with the target (:class:`GGUFWeights.replaced`): drafts are derived on
the float32 view (a trained draft checks a hash of the target's float weights; the layers it
shares are the target's layer objects, which hold the GGUF linears again afterwards).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

GGUF = "gguf"


def wanted(spec_kind: str, device_type: str, dtype: str | None) -> bool:
    """Whether a model loads in its GGUF precision: a GGUF, on the CPU, and no dtype asked for
    (``--dtype`` unset or ``auto``; ``float32`` is the float32-dequantized reference)."""
    return spec_kind == "gguf" and device_type == "cpu" and (dtype or "auto").strip().lower() == "auto"


def load_with_precision(name: str, placement: Any, dtype: str | None, trust_remote_code: bool = False, progress: Any = None,
                        tqdm_class: Any = None) -> Any:
    """:func:`models.load_model`, then a GGUF on the CPU without a dtype asked for (``dtype``: the option as
    given) computes in its own precision."""
    from ..cpu import fastlinear
    from . import models

    progress = progress or models._no_progress
    if not (wanted(models.resolve(name).kind, placement.device.type, dtype) and not placement.device_map):
        return models.load_model(name, placement, trust_remote_code, progress, tqdm_class)
    with fastlinear.suspended():  # the linears it would time and wrap are replaced next
        lm = models.load_model(name, placement, trust_remote_code, progress, tqdm_class)
    progress(f"reading {name}'s GGUF blocks", None)
    t0 = time.perf_counter()
    to_gguf(lm)
    fastlinear.install(lm.model)  # any plain float32 linear left (one the file keeps in F32/F16)
    lm.load_s += time.perf_counter() - t0
    return lm


def num_params(lm: Any) -> int:
    """A loaded model's weights, each once: its parameters and its GGUF linears' blocks (a head tied
    to the embedding counted once)."""
    params = {tensor_key(p): p.numel() for p in lm.model.parameters()}
    blocks = sum(m.block_weights for m in lm.model.modules() if hasattr(m, "block_weights")
                 and (m.dense is None or tensor_key(m.dense) not in params))
    return sum(params.values()) + blocks


def tensor_key(t: Any) -> int:
    """One key per weight tensor, shared by its aliases (a tied head): its storage address, or for a
    tensor with no storage (a tensor-parallel target's ``meta`` copy) the tensor itself."""
    return id(t) if t.is_meta else t.data_ptr()


def gguf_label(path: str | Path | None, kinds: Counter | None = None) -> str:
    """``gguf Q4_1``: the file type the GGUF's header names, else the kind most weights have."""
    from .gguf_header import file_type

    name = file_type(path) if path is not None else None
    if name is None and kinds:
        name = kinds.most_common(1)[0][0]
    return f"{GGUF} {name}" if name else GGUF


def planned(target: str, device: str | None, dtype: str | None) -> str | None:
    """The precision a target will compute in, from the settings alone (no weights): ``gguf Q4_1``
    for a GGUF loaded by default on the CPU, None when it is the dtype's (``ssd-chat config``)."""
    from . import models

    spec = models.resolve(target)
    place = models.parse_placement(device or "auto", dtype or "auto")
    if place.ranks or not wanted(spec.kind, place.device.type, dtype):  # ranks read the float32 copy
        return None
    return gguf_label(spec.source)


# model -> its GGUFWeights; kept beside the model (not on it), so copies of a model do not carry it
_states: "weakref.WeakKeyDictionary[nn.Module, GGUFWeights]" = weakref.WeakKeyDictionary()


def state(lm: Any) -> "GGUFWeights | None":
    """A loaded model's GGUF-precision state (None: it computes in its dtype)."""
    return _states.get(lm.model)


def of(lm: Any) -> str:
    """What a loaded model's linears compute in: ``gguf Q4_1`` (the file's blocks), ``int8 dynamic`` or its dtype (``float32``)."""
    g = state(lm)
    if g is not None:
        return g.label
    if any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in lm.model.modules()):
        return "int8 dynamic"  # the float path's int8 draft: torch's dynamic quantization
    return str(lm.placement.dtype).removeprefix("torch.")


def where(lm: Any) -> str:
    """Device and precision as the app shows them: ``cpu gguf Q4_1``, ``cpu float32``, ``cuda:0 bfloat16``."""
    label = lm.placement.label
    return f"{label.rsplit(' ', 1)[0]} {of(lm)}"


@dataclass
class GGUFWeights:
    """A model's GGUF-precision modules, the float modules they replaced (by module name) and its label."""

    modules: dict[str, nn.Module]
    replaced: dict[str, nn.Module]
    label: str


def to_gguf(target: Any) -> None:
    """Swap a loaded GGUF target's quantized linears for GGUF linears over the file's blocks (tiles
    read from the converted folder's cache after the first time)."""
    from . import gguf_weights as fast_weights
    from ..cpu import quant

    mods = fast_weights.gguf_target(target)
    replaced = quant.swap_modules(target.model, mods)
    _states[target.model] = GGUFWeights(mods, replaced, gguf_label(target.spec.source, _kinds(mods.values())))


def _kinds(modules: Any) -> Counter:
    """Weights per GGUF block kind among ``modules``."""
    from ..cpu.quant import GGUFLinear

    out: Counter = Counter()
    for m in modules:
        if isinstance(m, GGUFLinear):
            out[m.kind] += m.in_features * m.out_features
    return out


@contextlib.contextmanager
def float_view(target: Any) -> Iterator[None]:
    """The target's float32 modules in place for the duration (for deriving a draft from them)."""
    from ..cpu import quant

    g = state(target)
    if g is None:
        yield
        return
    quant.swap_modules(target.model, g.replaced)
    try:
        yield
    finally:
        quant.swap_modules(target.model, g.modules)


def label_derived(draft: Any, target: Any) -> None:
    """Record what a draft derived from a GGUF-precision ``target`` computes in."""
    kinds = _kinds(draft.model.modules())
    _states[draft.model] = GGUFWeights({}, {}, f"{GGUF} {kinds.most_common(1)[0][0]}" if kinds else of(target))
