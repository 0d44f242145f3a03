"""Drafts derived from the target itself, for targets without a small sibling.

``--draft`` names understood here (the target's tokenizer is shared by construction):

* ``copy``      an identical copy (every draft token is accepted; a sanity check)
* ``int8``      an int8 dynamic-quantized copy (per-channel weights, CPU only):
                 ~79 % greedy acceptance on SmolLM2-135M at ~65 % of a target step
* ``layers:N``  the target's embedding, first N layers, final norm and head (weights shared)
* ``trained``   the layers draft shipped in ``assets/drafts`` for the target (SmolLM2-135M only)
* ``features``  the feature draft shipped there (SD only: it reads the target's hidden states)
* a folder with a ``draft.json`` manifest: a draft trained for this target by
  ``ssd-chat draft train`` (see folder.py); its shared part is rebuilt from the target
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from ..cpu import fastlinear
from ..errors import ModelError, ParamError
from ..load.models import LoadedModel, ModelSpec
from ..model.layout import shallow, sub_config

_LAYERS = re.compile(r"^layers:(\d+)$")


SHIPPED = {"trained": "layers", "features": "features"}  # alias -> kind of a draft shipped in assets/drafts


def is_derived(name: str) -> bool:
    from .folder import is_draft_dir

    return name in ("copy", "int8") or name in SHIPPED or bool(_LAYERS.match(name)) or is_draft_dir(name)


def shipped_drafts() -> list[tuple[str, str, str]]:
    """(folder, target name, kind) of every trained draft in ``assets/drafts``."""
    import json
    from importlib.resources import files

    from .folder import MANIFEST

    out = []
    root = Path(str(files("ssd_chat.assets") / "drafts"))
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            m = json.loads((folder / MANIFEST).read_text())
            out.append((str(folder), m["target"]["name"], m.get("kind", "layers")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def shipped_draft(alias: str, target: LoadedModel) -> str:
    """The folder of the draft shipped for ``target`` under ``alias`` (trained: the layers draft,
    features: the feature draft), or a ModelError that says what exists."""
    kind = SHIPPED[alias]
    mine = [(f, k) for f, t, k in shipped_drafts() if t == target.name]
    for folder, k in mine:
        if k == kind:
            return folder
    have = ", ".join(a for a, kk in SHIPPED.items() if any(k == kk for _, k in mine))
    raise ModelError(
        f"no '{alias}' draft ships for target '{target.name}'"
        + (f" (shipped for it: {have})" if have else "; drafts ship only for the packaged default model")
        + "; train one with `ssd-chat draft train --target ... --out DIR` and pass --draft DIR"
    )


def label(name: str, target: str) -> str:
    """The draft ``name`` as users see it (panel, ``ask --json``, ``config``, bench, serve): a trained
    draft with what it is ("trained (2 shared layers + 2 own, 8192-token head)"), others as named."""
    from .folder import is_draft_dir
    from .folder import label as folder_label

    try:
        if name in SHIPPED:
            folder = next((f for f, t, k in shipped_drafts() if t == target and k == SHIPPED[name]), None)
            return folder_label(folder, name) if folder else name
        return folder_label(name) if is_draft_dir(name) else name
    except ModelError:  # an unreadable manifest: loading it says why
        return name


def default_draft(target: str) -> str:
    """The draft used when --draft is not given: ``trained``, the layers draft shipped for the
    target, when one ships for it (the packaged SmolLM2 has one), otherwise the ``int8`` copy.
    On the packaged model at the default k=2, SSD beat AR with ``trained`` and not with ``int8``
    (docs/performance.md)."""
    if any(t == target and kind == SHIPPED["trained"] for _, t, kind in shipped_drafts()):
        return "trained"
    return "int8"


def check_draft_for_mode(mode: str, draft: LoadedModel | None) -> None:
    """A ParamError now, before any reply, for a draft the mode cannot use."""
    if mode == "ssd" and draft is not None:
        from .feature import is_feature_draft

        if is_feature_draft(draft.model):
            raise ParamError(
                f"draft '{draft.name}' is a feature draft: it reads the target's hidden states, which SSD's speculator does "
                "not have while it drafts ahead; use it with --mode sd, or use SSD with another draft (e.g. --draft int8)"
            )


def derive(name: str, target: LoadedModel) -> LoadedModel:
    """Build the derived draft ``name`` from ``target``."""
    from . import folder as draft_folder

    alias = name if name in SHIPPED else None
    if alias:
        name = shipped_draft(name, target)
    if draft_folder.is_draft_dir(name):
        return draft_folder.load_draft_folder(name, target, alias)
    base = target.model
    if name == "copy":
        model = copy.deepcopy(base)
    elif name == "int8":
        if target.device.type != "cpu":
            raise ModelError("the 'int8' draft uses torch's dynamic quantization, which runs on CPU only; on a GPU use a small model of the target's family as --draft")
        model = _int8_copy(base)
    else:
        m = _LAYERS.match(name)
        if not m:
            raise ModelError(f"unknown derived draft '{name}' (use copy, int8 or layers:N)")
        model = _first_layers(base, int(m.group(1)))
    model.eval()
    return LoadedModel(
        name=name,
        spec=ModelSpec(name, "derived", name),
        model=model,
        tokenizer=target.tokenizer,
        placement=target.placement,
        folder=target.folder,
        eos_ids=target.eos_ids,
    )


def _int8_copy(base: nn.Module) -> nn.Module:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    model = copy.deepcopy(base).float()
    fastlinear.restore(model)  # torch's quantization swaps exactly-typed nn.Linear modules
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        # untie, so the input embedding stays fp32 while the head is quantized
        new_head = nn.Linear(head.in_features, head.out_features, bias=False)
        new_head.weight = nn.Parameter(head.weight.detach().clone())
        model.set_output_embeddings(new_head)
        model.config.tie_word_embeddings = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


def _first_layers(base: nn.Module, n: int) -> nn.Module:
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ModelError("layers:N drafts need a decoder with model.layers (Llama/Qwen/Mistral-style)")
    total = len(layers)
    if not 1 <= n <= total:
        raise ModelError(f"layers:{n} is out of range: the target has {total} layers")
    cfg = sub_config(base.config, list(range(n)))
    inner_c = shallow(inner)
    inner_c.layers = nn.ModuleList(list(layers)[:n])  # the same layer objects: weights are shared
    inner_c.config = cfg
    draft = shallow(base)
    draft.model = inner_c
    draft.config = cfg
    return draft
