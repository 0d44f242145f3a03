"""Writing a trained draft's folder (the engine reads it: ``engine/drafts/folder.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..engine import DRAFT_FORMAT as FORMAT, DRAFT_MANIFEST as MANIFEST, DRAFT_VERSION as VERSION, DRAFT_WEIGHTS as WEIGHTS
from ..engine import DraftShape, shared_hash, trainable_state, is_feature_draft


def save(draft: nn.Module, folder: Path, target_name: str, target: nn.Module, extra: dict[str, Any] | None = None,
         dtype: torch.dtype = torch.float16) -> Path:
    """Write the draft's own weights (matrices in ``dtype``, vectors in fp32) and its manifest."""
    from safetensors.torch import save_file

    shape: DraftShape = draft.ssd_shape
    kind = "features" if is_feature_draft(draft) else "layers"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    def stored(p: torch.Tensor) -> torch.dtype:  # matrices in `dtype`, vectors in at least fp32
        return dtype if p.dim() >= 2 else (torch.float64 if p.dtype == torch.float64 else torch.float32)

    tensors = {n: p.detach().to("cpu", stored(p)).contiguous() for n, p in trainable_state(draft).items()}
    tensors["vocab_ids"] = draft.lm_head.ids.detach().to("cpu", torch.int32).contiguous()
    save_file(tensors, str(folder / WEIGHTS))
    cfg = target.config
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "target": {
            "name": target_name,
            "model_type": getattr(cfg, "model_type", None),
            "hidden_size": cfg.hidden_size,
            "vocab_size": int(draft.lm_head.vocab_size),
            "num_hidden_layers": cfg.num_hidden_layers,
            "shared_hash": shared_hash(target, -1 if kind == "features" else shape.num_shared),
        },
        "num_shared": shape.num_shared,
        "init_from": list(shape.init_from),
        "num_vocab": int(draft.lm_head.ids.numel()),
        "kind": kind,
        **({"fuse_layer": draft.fuse_layer} if kind == "features" and draft.fuse_layer is not None else {}),
        **(extra or {}),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return folder
